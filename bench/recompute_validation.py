"""Activation recomputation's time, predicted against real runs on this machine.

The bundled transformer (``examples/transformer.py``: four encoder blocks) on one CPU core:

1. captured without recomputation (``whatif collect``, the glibc settings of
   ``collectors.capture.STEADY_ALLOCATOR``, as every real run here);
2. predicted on one worker with ``parallelism: {recompute: none}`` and ``{recompute: full}``
   (``sim/parallel/recompute.py``: each block's forward run again before its backward);
3. run for real, each block wrapped in ``torch.utils.checkpoint.checkpoint`` (non-reentrant,
   PyTorch's recommended form) for ``full``, plain for ``none``: ``--rounds`` rounds, each a
   process per variant in turn (none, full), ``--steps`` timed steps after ``--warmup``, the
   round's figure the median step; a variant's figure is the median over rounds.

Prints the predicted and measured steps of both, the error of each, and of the ratio full /
none (the cost of recomputation, which the what-if asks). A benchmark to rerun, not a test:

    .venv/bin/python bench/recompute_validation.py [--rounds 5] [--steps 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def _real(variant: str, warmup: int, steps: int) -> None:
    """One process's real run of ``variant`` (none or full): its median step in ms on stdout."""
    sys.path.insert(0, str(REPO / "examples"))
    import torch
    from profiled_training import endless, train_step
    from torch import nn
    from torch.utils.checkpoint import checkpoint
    from transformer import build

    class Checkpointed(nn.Module):
        def __init__(self, block: nn.Module) -> None:
            super().__init__()
            self.block = block

        def forward(self, x):
            return checkpoint(self.block, x, use_reentrant=False)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, loader = build()
    if variant == "full":
        model.blocks = nn.Sequential(*(Checkpointed(block) for block in model.blocks))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    batches = endless(loader)
    times = []
    for i in range(warmup + steps):
        inputs, labels = next(batches)
        start = time.perf_counter()
        train_step(model, optimizer, loss_fn, inputs, labels)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    print(json.dumps({"variant": variant, "median_ms": statistics.median(times), "steps_ms": times}))


def _env() -> dict:
    from whatif.collectors.capture import STEADY_ALLOCATOR

    return {**os.environ, **STEADY_ALLOCATOR}


def _predicted(bundle: Path) -> dict:
    from whatif.pipeline import predict
    from whatif.scenario import Scenario

    out = {}
    for variant in ("none", "full"):
        scenario = Scenario.from_dict({
            "trace": str(bundle), "framework": "ddp",
            "cluster": {"machines": 1, "gpus_per_machine": 1, "intra_node": "nvlink2", "inter_node": "10gbe"},
            "parallelism": {"recompute": variant}}, name="recompute_validation")
        out[variant] = float(predict(scenario.request()).results["iteration_ms"].iloc[0])
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, help="folder for the bundle and the results (default: a temporary one)")
    parser.add_argument("--real", choices=("none", "full"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.real:
        _real(args.real, args.warmup, args.steps)
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="whatif-recompute-"))
    out.mkdir(parents=True, exist_ok=True)
    bundle = out / "transformer.bundle"
    subprocess.run([str(Path(PYTHON).parent / "whatif"), "collect", "--out", str(bundle), "--", PYTHON,
                    str(REPO / "examples" / "transformer.py")], check=True, env=_env(), cwd=REPO,
                   stdout=subprocess.DEVNULL)
    predicted = _predicted(bundle)
    measured: dict = {"none": [], "full": []}
    for _ in range(args.rounds):
        for variant in ("none", "full"):
            done = subprocess.run([PYTHON, __file__, "--real", variant, "--steps", str(args.steps), "--warmup",
                                   str(args.warmup)], check=True, env=_env(), capture_output=True, text=True)
            measured[variant].append(json.loads(done.stdout.strip().splitlines()[-1])["median_ms"])
    real = {v: statistics.median(ms) for v, ms in measured.items()}
    print(f"bundle: {bundle}; {args.rounds} rounds of {args.steps} steps after {args.warmup}, medians")
    print(f"{'variant':<8} {'predicted ms':>13} {'measured ms':>12} {'error %':>8}   rounds ms")
    for v in ("none", "full"):
        print(f"{v:<8} {predicted[v]:>13.1f} {real[v]:>12.1f} {100 * (predicted[v] / real[v] - 1):>+8.1f}   "
              + ", ".join(f"{ms:.1f}" for ms in measured[v]))
    p_ratio, m_ratio = predicted["full"] / predicted["none"], real["full"] / real["none"]
    print(f"full / none: predicted {p_ratio:.3f}, measured {m_ratio:.3f} ({100 * (p_ratio / m_ratio - 1):+.1f} %)")
    (out / "results.json").write_text(json.dumps({"predicted": predicted, "measured": measured}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
