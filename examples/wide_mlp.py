"""Capture the bundled communication-bound trace: a wide MLP trained on synthetic data on one CPU core.

The trace in ``data/wide_mlp_cpu.pt.trace.json.gz`` is produced by this script. The model is
chosen for its ratio of gradient bytes to compute: six linear layers (five hidden layers 2048
wide) hold 18.9 million parameters, 75.6 MB of float32 gradients, while a step on a batch of 64
takes only about 200 ms on one core. Data-parallel training of such a model is bound by
communication, which is what the cluster scenarios in ``scenarios/`` need to show the effect of
bandwidth, priorities (P3) and the all-reduce algorithm. Every layer's gradient is large, so a
priority scheduler has something to reorder.

The training loop is the one of ``examples/convnet.py`` (DataLoader -> forward -> loss ->
backward -> optimizer step, ``ProfilerStep#N`` annotations, CPU activities only,
``record_shapes=True`` so that each ``AccumulateGrad`` records its gradient's shape).

Usage::

    pip install torch==2.13.0
    python examples/wide_mlp.py [OUTPUT.pt.trace.json.gz]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, schedule
from torch.utils.data import DataLoader, TensorDataset

DEFAULT_OUTPUT = Path("data/wide_mlp_cpu.pt.trace.json.gz")
INPUT_FEATURES = 1024
HIDDEN = (2048, 2048, 2048, 2048, 2048)
NUM_CLASSES = 10
BATCH_SIZE = 64
NUM_SAMPLES = 1024
WARMUP_STEPS = 3
PROFILED_STEPS = 5


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


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of gradient one training step produces (one per parameter)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def make_synthetic_loader(seed: int = 0) -> DataLoader:
    """Return a shuffling DataLoader over random feature vectors with random labels."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(NUM_SAMPLES, INPUT_FEATURES, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (NUM_SAMPLES,), generator=generator)
    return DataLoader(
        TensorDataset(features, labels),
        batch_size=BATCH_SIZE,
        shuffle=True,
        drop_last=True,
        generator=generator,
    )


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: nn.Module,
    features: torch.Tensor,
    labels: torch.Tensor,
) -> float:
    """Run one forward, backward and optimizer step and return the loss."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(features), labels)
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
    model = WideMLP()
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
    print(f"wrote {args.output} ({args.output.stat().st_size} bytes); "
          f"{gradient_bytes(WideMLP()) / 1e6:.1f} MB of gradients per step")


if __name__ == "__main__":
    main()
