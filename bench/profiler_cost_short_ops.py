"""How much of the profiler's cost on short operators stays under the per-task cap, over rounds.

``sim/passes/profiler_overhead.py`` takes the difference between a bundle's profiled and plain
steps out of the trace's CPU tasks, up to :data:`PROFILER_COST_CAP_US` per task, and shrinks
every task by one factor past that (time the profiled steps lost to something else, such as page
faults). On a small MLP of many short operators, the profiler's worst case, the whole difference
should fit under the cap. Whether it does in one capture depends on how quiet the box is while
the plain and profiled steps run, which is why this is a bench and not a test: each round
captures the MLP anew (one thread) and prints what the correction found.

    .venv/bin/python bench/profiler_cost_short_ops.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from whatif.collectors.bundle import read_bundle
from whatif.sim.passes.profiler_overhead import PROFILER_COST_CAP_US, ProfilerOverhead, remove_profiler_overhead
from whatif.study import TraceStudy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from short_mlp import capture_mlp  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    under = 0
    with tempfile.TemporaryDirectory() as work:
        for round_ in range(args.rounds):
            bundle = capture_mlp(Path(work) / f"mlp{round_}.bundle")
            study = TraceStudy.from_trace(bundle)
            corrected = remove_profiler_overhead(study.graph, study.iterations, read_bundle(bundle).unprofiled_step_ms)
            found = corrected.last_note(ProfilerOverhead)
            fits = 0 < found.per_task_us < PROFILER_COST_CAP_US and found.stretch == 1.0
            under += fits
            print(f"round {round_ + 1}: profiled {found.profiled_ms:.3f} ms, plain {found.unprofiled_ms:.3f} ms, "
                  f"{found.per_task_us:.1f} us per CPU task, stretch {found.stretch:.3f}: "
                  + ("under the cap" if fits else "past the cap"))
    print(f"{under} of {args.rounds} rounds under the {PROFILER_COST_CAP_US:g} us cap (load {os.getloadavg()[0]:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
