"""Where a parallel family's step goes on each rank: ``torch.profiler`` around a few steps.

An exploration, run by hand on the lab's box: ``WORLD`` ranks (1 or 2) of
``examples/run_distributed.py``'s worker of ``FAMILY`` on loopback, each pinned to a core of
its own (``taskset``, as ``lab/cluster.py``'s ``pin`` pins a 1 x 2 setting), train the example
transformer for ``WARMUP`` steps, then ``STEPS`` steps under the profiler (CPU activities,
shapes recorded), and each rank writes ``OUT/rankR.json`` (a Chrome trace) and prints its steps'
wall and main-thread CPU by phase:

    flock /work/wt/lab.lock nice -n -20 .venv/bin/python -m whatif.lab.probes.parallel_profile \\
        tp 2 OUT [--sequence-parallel] [--schedule 1f1b]

World 1 runs the family on a one-rank mesh: its libraries' dispatch with no communication.
Across the emulated machines, ``lab/cluster.py``'s ``run_job`` starts each rank with
``PARALLEL_PROFILE_WORKER=1`` in its environment and the same arguments (its logs hold the lines).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

WARMUP, STEPS = 3, 3
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def worker(family: str, out: Path, extra: list) -> None:
    sys.path.insert(0, str(EXAMPLES))
    import torch
    from torch import nn

    import parallel
    from profiled_training import endless, shard
    from run_distributed import build_model, start_worker

    torch.set_num_threads(1)
    options = parallel.ParallelOptions(sequence_parallel="--sequence-parallel" in extra,
                                       schedule=extra[extra.index("--schedule") + 1] if "--schedule" in extra else "1f1b")
    w = start_worker(family, options)
    model, loader = build_model("transformer")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer = w.prepare(model, optimizer)
    batches = endless(shard(loader, w.data_rank, w.data_size))
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(WARMUP):
        w.step(model, optimizer, loss_fn, *next(batches), lambda phase: None)
    phases: dict = {}
    last = [time.perf_counter(), time.thread_time()]

    def mark(phase: str) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        phases.setdefault(phase, []).append(((wall - last[0]) * 1e3, (cpu - last[1]) * 1e3))
        last[:] = [wall, cpu]

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(STEPS):
            last[:] = [time.perf_counter(), time.thread_time()]
            with torch.profiler.record_function("ProfilerStep#probe"):
                w.step(model, optimizer, loss_fn, *next(batches), mark)
    prof.export_chrome_trace(str(out / f"rank{w.rank}.json"))
    shown = {p: (round(statistics.median(v[0] for v in vs), 1), round(statistics.median(v[1] for v in vs), 1))
             for p, vs in phases.items()}
    print(f"rank {w.rank}: (wall, cpu) ms by phase {shown}", flush=True)
    w.close()


def launch(family: str, world: int, out: Path, extra: list) -> int:
    from whatif.lab.cluster import carry_priority

    carry_priority()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29537", WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
               PARALLEL_PROFILE_WORKER="1")
    procs = [subprocess.Popen(["taskset", "-c", str(rank), sys.executable, "-m", __spec__.name, family, str(world),
                               str(out), *extra], env=dict(env, RANK=str(rank))) for rank in range(world)]
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    family_, world_, out_, *extra_ = sys.argv[1:]
    if os.environ.get("PARALLEL_PROFILE_WORKER"):
        worker(family_, Path(out_), extra_)
    else:
        sys.exit(launch(family_, int(world_), Path(out_), extra_))
