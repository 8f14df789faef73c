"""A small MLP of many short operators captured on one thread: the profiler's worst case.

The profiler costs a few microseconds per operator, so on operators this short it is a large
share of the step. ``tests/test_profiler_overhead.py`` and ``bench/profiler_cost_short_ops.py``
capture it (a long-operator variant too) to check what ``sim/passes/profiler_overhead.py`` takes
out of a trace.
"""

from __future__ import annotations

from pathlib import Path

import torch

from whatif.collectors.capture import Capture


def capture_mlp(out: Path, width: int = 32, depth: int = 8, batch: int = 8, warmup: int = 8, steps: int = 5) -> Path:
    """A bundle at ``out`` of ``depth`` Linear+ReLU layers of ``width``, trained with SGD on one
    thread (the caller's thread count is restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(depth)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(batch, width), torch.randn(batch, width)
        with Capture(out, model=model, warmup=warmup, steps=steps) as capture:
            while True:
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                if not capture.step():
                    break
        return out
    finally:
        torch.set_num_threads(threads)
