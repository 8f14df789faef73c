"""A worker that times Gloo all-reduces of several sizes, for calibrating the lab's network.

Started by the lab as every worker of a job (``python -m whatif.collectors.allreduce_probe
SIZE_BYTES ...``); rank 0 writes ``{"sizes_bytes": [...], "seconds": [...]}`` (the median of
several repetitions of each size) to ``$WHATIF_LAB_OUT/allreduce.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time


def main(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    sizes = [int(float(a)) for a in argv]
    seconds = []
    for size in sizes:
        tensor = torch.ones(max(size // 4, 1))
        dist.all_reduce(tensor)  # warm the connections for this size
        repeats = []
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            repeats.append(time.perf_counter() - start)
        seconds.append(statistics.median(repeats))
    if dist.get_rank() == 0:
        out = os.environ["WHATIF_LAB_OUT"]
        with open(os.path.join(out, "allreduce.json"), "w") as f:
            json.dump({"sizes_bytes": sizes, "seconds": seconds, "world_size": dist.get_world_size()}, f)
    dist.barrier()  # leave together: tearing Gloo down under a peer can abort it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
