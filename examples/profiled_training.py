"""The training loop and profiler set-up the example models share.

A plain PyTorch loop (DataLoader -> forward -> loss -> backward -> optimizer step) so that a
Kineto trace of it has the structure of a real job: ``ProfilerStep#N`` around each iteration,
``enumerate(DataLoader)`` for data loading, ``aten::`` operators with their input shapes
(``record_shapes=True``, which also gives each ``AccumulateGrad`` its gradient's shape), the
autograd backward operators and the optimizer step. One intra-op thread, for repeatable times.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, schedule
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

WARMUP_STEPS = 3
PROFILED_STEPS = 5
BATCH_SIZE_ENV = "WHATIF_EXAMPLE_BATCH_SIZE"


def synthetic_loader(inputs: torch.Tensor, num_classes: int, batch_size: int, seed: int = 0) -> DataLoader:
    """A shuffling DataLoader over ``inputs`` with random labels."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_classes, (len(inputs),), generator=generator)
    return DataLoader(
        TensorDataset(inputs, labels), batch_size=batch_size, shuffle=True, drop_last=True, generator=generator
    )


def with_batch_size(loader: DataLoader, batch_size: int | None) -> DataLoader:
    """The example's loader over the same data at another batch size (None: as it is), shuffled
    as the examples shuffle; the batch-size what-ifs are checked against such runs."""
    if batch_size is None or batch_size == loader.batch_size:
        return loader
    generator = torch.Generator().manual_seed(0)
    return DataLoader(loader.dataset, batch_size=batch_size, shuffle=True, drop_last=True, generator=generator)


def shard(loader: DataLoader, rank: int, size: int) -> DataLoader:
    """The same loader over data-parallel rank ``rank``'s ``1/size`` of the data set, batches of
    the same size (every data-parallel run, and what one worker compares them with)."""
    if size == 1:
        return loader
    sampler = DistributedSampler(loader.dataset, num_replicas=size, rank=rank, shuffle=True, seed=0, drop_last=True)
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler, drop_last=True)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: nn.Module, inputs, labels,
               mark: Callable[[str], None] | None = None) -> float:
    """One forward, backward and optimizer step; the loss.

    ``zero_grad()`` frees the gradients (torch 2's default, ``set_to_none=True``); it takes no
    argument because Horovod's ``DistributedOptimizer.zero_grad`` accepts none. ``mark``, when
    given, is called with each phase's name as it ends (the real runs time their phases)."""
    mark = mark or (lambda phase: None)
    optimizer.zero_grad()
    loss = loss_fn(model(inputs), labels)
    mark("forward")
    loss.backward()
    mark("backward")
    optimizer.step()
    mark("step")
    return loss.item()


def endless(loader: DataLoader):
    """Batches forever, a new epoch whenever the loader is exhausted."""
    while True:
        yield from loader


def capture_trace(model: nn.Module, loader: DataLoader, output: Path, profiled_steps: int = PROFILED_STEPS) -> None:
    """Warm ``model`` up, then profile ``profiled_steps`` training steps (SGD) into ``output``."""
    torch.set_num_threads(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    batches = endless(loader)
    model.train()
    for _ in range(WARMUP_STEPS):
        train_step(model, optimizer, loss_fn, *next(batches))
    output.parent.mkdir(parents=True, exist_ok=True)
    with profile(
        activities=[ProfilerActivity.CPU],
        record_shapes=True,
        with_stack=False,
        schedule=schedule(wait=0, warmup=1, active=profiled_steps, repeat=1),
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(output)),
    ) as prof:
        for _ in range(1 + profiled_steps):
            train_step(model, optimizer, loss_fn, *next(batches))
            prof.step()


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of gradient one training step produces (one per parameter)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def main(description: str, default_output: Path, build: Callable[[], tuple[nn.Module, DataLoader]], argv=None) -> None:
    """The command line of an example: ``python examples/NAME.py [OUTPUT] [--steps N]``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("output", nargs="?", type=Path, default=default_output,
                        help=f"where to write the gzipped Chrome trace (default: {default_output})")
    parser.add_argument("--steps", type=int, default=PROFILED_STEPS,
                        help=f"number of profiled training steps (default: {PROFILED_STEPS})")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model, loader = build()
    capture_trace(model, loader, args.output, args.steps)
    print(f"wrote {args.output} ({args.output.stat().st_size} bytes); "
          f"{gradient_bytes(model) / 1e6:.1f} MB of gradients per step")


def train_captured(build: Callable[[], tuple[nn.Module, DataLoader]], batch_size: int) -> None:
    """The same training under the capture API, as ``whatif collect`` runs it: steps, warm-up
    and the bundle folder come from ``whatif collect`` (the defaults match the trace's), the
    batch size from ``WHATIF_EXAMPLE_BATCH_SIZE`` if set."""
    from whatif.collectors.capture import Capture

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, loader = build()
    batch_size = int(os.environ.get(BATCH_SIZE_ENV) or batch_size)
    loader = with_batch_size(loader, batch_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    with Capture(model=model, warmup=WARMUP_STEPS + 1, steps=PROFILED_STEPS, batch_size=batch_size) as capture:
        for inputs, labels in endless(loader):
            train_step(model, optimizer, loss_fn, inputs, labels)
            if not capture.step():
                break


def run_example(description: str, default_output: Path, build, batch_size: int) -> None:
    """An example's entry point: under ``whatif collect`` (which sets WHATIF_CAPTURE_OUT) it
    trains under the capture API, otherwise it is :func:`main`."""
    if os.environ.get("WHATIF_CAPTURE_OUT"):
        train_captured(build, batch_size)
    else:
        main(description, default_output, build)
