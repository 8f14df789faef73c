"""Capture the bundled demo trace: a small CNN trained on synthetic images on one CPU core.

The trace in ``data/convnet_cpu.pt.trace.json.gz`` is produced by this script. It is a plain
PyTorch training loop (DataLoader -> forward -> loss -> backward -> optimizer step) so that the
Kineto trace has the same structure as a real job: ``ProfilerStep#N`` annotations around each
iteration, ``enumerate(DataLoader)`` events for data loading, ``aten::`` operators with input
shapes, autograd backward operators and the optimizer step.

Usage::

    pip install torch==2.13.0
    python examples/convnet.py [OUTPUT.pt.trace.json.gz]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, schedule
from torch.utils.data import DataLoader, TensorDataset

DEFAULT_OUTPUT = Path("data/convnet_cpu.pt.trace.json.gz")
IMAGE_SHAPE = (3, 32, 32)
NUM_CLASSES = 10
BATCH_SIZE = 32
NUM_IMAGES = 1024
WARMUP_STEPS = 3
PROFILED_STEPS = 5


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


def make_synthetic_loader(seed: int = 0) -> DataLoader:
    """Return a shuffling DataLoader over random images with random labels."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(NUM_IMAGES, *IMAGE_SHAPE, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (NUM_IMAGES,), generator=generator)
    return DataLoader(
        TensorDataset(images, labels),
        batch_size=BATCH_SIZE,
        shuffle=True,
        drop_last=True,
        generator=generator,
    )


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
) -> float:
    """Run one forward, backward and optimizer step and return the loss."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(images), labels)
    loss.backward()
    optimizer.step()
    return loss.item()


def endless(loader: DataLoader):
    """Yield batches forever, starting a new epoch whenever the loader is exhausted."""
    while True:
        yield from loader


def capture_trace(output: Path, profiled_steps: int = PROFILED_STEPS) -> None:
    """Warm up the model, then profile ``profiled_steps`` training steps into ``output``."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    batches = endless(make_synthetic_loader())

    model.train()
    for _ in range(WARMUP_STEPS):
        train_step(model, optimizer, loss_fn, *next(batches))

    output.parent.mkdir(parents=True, exist_ok=True)
    profiler_schedule = schedule(wait=0, warmup=1, active=profiled_steps, repeat=1)
    with profile(
        activities=[ProfilerActivity.CPU],
        record_shapes=True,
        with_stack=False,
        schedule=profiler_schedule,
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(output)),
    ) as prof:
        for _ in range(1 + profiled_steps):
            train_step(model, optimizer, loss_fn, *next(batches))
            prof.step()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "output",
        nargs="?",
        type=Path,
        default=DEFAULT_OUTPUT,
        help=f"where to write the gzipped Chrome trace (default: {DEFAULT_OUTPUT})",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=PROFILED_STEPS,
        help=f"number of profiled training steps (default: {PROFILED_STEPS})",
    )
    args = parser.parse_args(argv)
    capture_trace(args.output, args.steps)
    print(f"wrote {args.output} ({args.output.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
