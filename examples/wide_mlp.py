"""Capture the bundled communication-bound trace: a wide MLP trained on synthetic data on one CPU core.

The trace in ``data/wide_mlp_cpu.pt.trace.json.gz`` is produced by this script. The model is
chosen for its ratio of gradient bytes to compute: six linear layers (five hidden layers 2048
wide) hold 18.9 million parameters, 75.6 MB of float32 gradients, while a step on a batch of 64
takes only about 200 ms on one core. Data-parallel training of such a model is bound by
communication, which is what the cluster scenarios in ``scenarios/`` need to show the effect of
bandwidth, priorities (P3) and the all-reduce algorithm. Every layer's gradient is large, so a
priority scheduler has something to reorder.

The training loop and profiler settings are those of ``examples/profiled_training.py``. Run under
``whatif collect`` it trains the same way under the capture API instead and writes a trace bundle.

Usage::

    pip install torch==2.13.0
    python examples/wide_mlp.py [OUTPUT.pt.trace.json.gz]
    whatif collect --out OUTPUT.bundle -- python examples/wide_mlp.py
"""

from __future__ import annotations

from pathlib import Path

import torch
from profiled_training import run_example, synthetic_loader
from torch import nn
from torch.utils.data import DataLoader

DEFAULT_OUTPUT = Path("data/wide_mlp_cpu.pt.trace.json.gz")
INPUT_FEATURES = 1024
HIDDEN = (2048, 2048, 2048, 2048, 2048)
NUM_CLASSES = 10
BATCH_SIZE = 64
NUM_SAMPLES = 1024


class WideMLP(nn.Module):
    """Linear + ReLU layers of widths ``HIDDEN`` and a linear classifier head."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = INPUT_FEATURES
        for hidden in HIDDEN:
            layers += [nn.Linear(width, hidden), nn.ReLU(inplace=True)]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.layers(features)


def build() -> tuple[nn.Module, DataLoader]:
    features = torch.randn(NUM_SAMPLES, INPUT_FEATURES, generator=torch.Generator().manual_seed(0))
    return WideMLP(), synthetic_loader(features, NUM_CLASSES, BATCH_SIZE)


if __name__ == "__main__":
    run_example(__doc__.splitlines()[0], DEFAULT_OUTPUT, build, BATCH_SIZE)
