"""Capture a trace of a VGG-style CNN trained on synthetic 32x32 images on one CPU core.

Four 3x3 convolution stages (64, 128, 256 and 256 channels, each with batch norm, ReLU and 2x2
max pooling) and a VGG classifier of two 2048-wide fully connected layers with dropout. Like
VGG itself, most of its 7.3 million parameters (29 MB of float32 gradients) are in the
classifier, whose gradients backward produces first, while most of its compute is in the
convolutions, whose gradients come last: the layout that makes the overlap of communication
with backward matter. A step on a batch of 32 images takes about 170 ms on one core.

The training loop and profiler settings are those of ``examples/profiled_training.py``; under
``whatif collect`` it writes a trace bundle instead.

Usage::

    pip install torch==2.13.0
    python examples/vgg.py [OUTPUT.pt.trace.json.gz]
    whatif collect --out vgg.bundle -- python examples/vgg.py
"""

from __future__ import annotations

from pathlib import Path

import torch
from convnet import conv_block
from profiled_training import run_example, synthetic_loader
from torch import nn
from torch.utils.data import DataLoader

DEFAULT_OUTPUT = Path("vgg_cpu.pt.trace.json.gz")
IMAGE_SHAPE = (3, 32, 32)
STAGES = (64, 128, 256, 256)
CLASSIFIER_WIDTH = 2048
NUM_CLASSES = 10
BATCH_SIZE = 32
NUM_IMAGES = 1024


class VGG(nn.Module):
    """Convolution stages from 32x32 down to 2x2 feature maps, then the fully connected classifier."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        channels = (IMAGE_SHAPE[0],) + STAGES
        self.features = nn.Sequential(*(conv_block(a, b) for a, b in zip(channels, channels[1:])))
        side = IMAGE_SHAPE[1] >> len(STAGES)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(STAGES[-1] * side * side, CLASSIFIER_WIDTH),
            nn.ReLU(inplace=True),
            nn.Dropout(),
            nn.Linear(CLASSIFIER_WIDTH, CLASSIFIER_WIDTH),
            nn.ReLU(inplace=True),
            nn.Dropout(),
            nn.Linear(CLASSIFIER_WIDTH, num_classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))


def build() -> tuple[nn.Module, DataLoader]:
    images = torch.randn(NUM_IMAGES, *IMAGE_SHAPE, generator=torch.Generator().manual_seed(0))
    return VGG(), synthetic_loader(images, NUM_CLASSES, BATCH_SIZE)


if __name__ == "__main__":
    run_example(__doc__.splitlines()[0], DEFAULT_OUTPUT, build, BATCH_SIZE)
