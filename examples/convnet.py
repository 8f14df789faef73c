"""Capture the bundled demo trace: a small CNN trained on synthetic images on one CPU core.

The trace in ``data/convnet_cpu.pt.trace.json.gz`` is produced by this script, with the training
loop and profiler settings of ``examples/profiled_training.py``. Run under ``whatif collect`` it
trains the same way under the capture API instead and writes a trace bundle
(``data/convnet_cpu.bundle``).

Usage::

    pip install torch==2.13.0
    python examples/convnet.py [OUTPUT.pt.trace.json.gz]
    whatif collect --out OUTPUT.bundle -- python examples/convnet.py
"""

from __future__ import annotations

from pathlib import Path

import torch
from profiled_training import run_example, synthetic_loader
from torch import nn
from torch.utils.data import DataLoader

DEFAULT_OUTPUT = Path("data/convnet_cpu.pt.trace.json.gz")
IMAGE_SHAPE = (3, 32, 32)
NUM_CLASSES = 10
BATCH_SIZE = 32
NUM_IMAGES = 1024


def conv_block(in_channels: int, out_channels: int) -> nn.Sequential:
    """Return a 3x3 convolution, batch norm and ReLU followed by 2x2 max pooling."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    )


class ConvNet(nn.Module):
    """Three conv blocks (32x32 -> 4x4 feature maps) and a linear classifier head."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.features = nn.Sequential(
            conv_block(IMAGE_SHAPE[0], 32),
            conv_block(32, 64),
            conv_block(64, 128),
        )
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(128, num_classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def build() -> tuple[nn.Module, DataLoader]:
    images = torch.randn(NUM_IMAGES, *IMAGE_SHAPE, generator=torch.Generator().manual_seed(0))
    return ConvNet(), synthetic_loader(images, NUM_CLASSES, BATCH_SIZE)


if __name__ == "__main__":
    run_example(__doc__.splitlines()[0], DEFAULT_OUTPUT, build, BATCH_SIZE)
