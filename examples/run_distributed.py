"""Time an example model's training steps on one worker, under Horovod, PyTorch DDP or a parallel family (Gloo).

These runs are the ground truth that predictions are checked against: the same model, batch and
training step as the single-worker trace (``examples/profiled_training.py``), over
``world_size`` CPU workers with ``--threads`` intra-op threads each. Data-parallel ranks each
get their own batch of the same size (a shard of the data set); ranks that split the model
(tensor, pipeline) share theirs.

- ``single``: one process, no communication.
- ``horovod``: ``hvd.init()``, the initial parameters and optimizer state broadcast from rank 0,
  and ``hvd.DistributedOptimizer`` with Horovod's own defaults for tensor fusion and the cycle
  time (or what HOROVOD_FUSION_THRESHOLD / HOROVOD_CYCLE_TIME say). Launch with
  ``horovodrun --gloo -np N -H localhost:N python examples/run_distributed.py ...``.
- ``ddp``: ``DistributedDataParallel`` over the Gloo backend with its default 25 MB buckets,
  rendezvous by env:// (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), as ``torchrun`` sets them.
- ``fsdp``, ``tp`` (``--sequence-parallel``), ``pp`` (``--microbatches``, ``--schedule``),
  ``ep`` (``--model moe``) and ``fsdp+tp`` (``--tensor``): FSDP2, DTensor tensor parallelism,
  ``torch.distributed.pipelining``, expert parallelism by all-to-all, and FSDP2 over tensor
  parallelism, launched like DDP (``examples/parallel.py`` says how each is set up).

An iteration is the time from one step's end to the next one's: loading the batch, forward,
backward and the optimizer step, whose end is synchronous with the communication (DDP's
backward waits for its last bucket, Horovod's ``step()`` for its last all-reduce) and with the
compute (``loss.item()``); a pipeline step is the schedule's run (every microbatch forward
and backward, the phase ``schedule``) and the optimizer step. Every worker records its iteration
times after ``--warmup`` steps; rank 0 gathers them and writes the JSON report: the run's
settings (the parallel families' degrees and options under ``parallelism``), ``median_ms``
(rank 0's median iteration) and per worker its rank, host, median, every iteration time, where
its steps went (page faults, each phase's wall and training-thread CPU time, the other threads'
CPU time), its coordinates in the parallel layout, its loss in every step from the first
(warm-up included; NaN on pipeline stages without the loss), the bytes of parameters it holds
and a hash of them after the last step (the same on every worker when the gradients were
averaged; each rank's own shard under FSDP, TP, PP and EP).

Usage::

    python examples/run_distributed.py --model transformer --framework single --steps 30 --json out.json
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2 RANK=0 python examples/run_distributed.py --framework ddp ...
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

import parallel
from profiled_training import endless, gradient_bytes, shard, train_step, with_batch_size

MODELS = ("convnet", "vgg", "wide_mlp", "transformer", "moe")
FRAMEWORKS = ("single", "horovod", "ddp") + parallel.FAMILIES
# Horovod 0.28.1's defaults when the environment sets nothing (horovod/common/operations.cc).
HOROVOD_DEFAULT_FUSION_THRESHOLD_BYTES = 128 * 1024 * 1024
HOROVOD_DEFAULT_CYCLE_TIME_MS = 1.0


class DataParallelWorker:
    """What the data-parallel workers share: every rank its own data, the plain training step."""

    @property
    def data_rank(self) -> int:
        return self.rank

    @property
    def data_size(self) -> int:
        return self.size

    @property
    def coordinates(self) -> dict:
        return {"data": self.rank, "tensor": 0, "pipeline": 0}

    def step(self, model, optimizer, loss_fn, inputs, labels, mark) -> float:
        return train_step(model, optimizer, loss_fn, inputs, labels, mark=mark)


class SingleWorker(DataParallelWorker):
    """One process: nothing to wrap, nothing to send."""

    rank, size = 0, 1

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        return model, optimizer

    def gather(self, value) -> list:
        return [value]

    def settings(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class HorovodWorker(DataParallelWorker):
    """A Horovod worker: all-reduces gradients in ``optimizer.step()`` through its background thread."""

    def __init__(self) -> None:
        try:
            import horovod.torch as hvd
        except ImportError as error:
            raise SystemExit(f"horovod is not installed ({error}); install it with `make horovod`") from error
        self.hvd = hvd
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        self.hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        return model, self.hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    def gather(self, value) -> list:
        return self.hvd.allgather_object(value)

    def settings(self) -> dict:
        fusion = os.environ.get("HOROVOD_FUSION_THRESHOLD")
        cycle = os.environ.get("HOROVOD_CYCLE_TIME")
        return {"horovod": {
            "version": importlib.import_module("horovod").__version__,
            "controller": "gloo" if self.hvd.gloo_enabled() else "mpi",
            "fusion_threshold_bytes": int(fusion) if fusion else HOROVOD_DEFAULT_FUSION_THRESHOLD_BYTES,
            "cycle_time_ms": float(cycle) if cycle else HOROVOD_DEFAULT_CYCLE_TIME_MS,
        }}

    def close(self) -> None:
        self.hvd.shutdown()


class DDPWorker(DataParallelWorker):
    """A PyTorch DDP worker on the Gloo backend: all-reduces gradient buckets during backward."""

    def __init__(self) -> None:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if name not in os.environ]
        if missing:
            raise SystemExit(f"--framework ddp needs {', '.join(missing)} in the environment (or launch it with torchrun)")
        self.dist = torch.distributed
        self.dist.init_process_group("gloo", init_method="env://")
        self.rank, self.size = self.dist.get_rank(), self.dist.get_world_size()

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        # The constructor broadcasts rank 0's parameters and buffers to every worker.
        return nn.parallel.DistributedDataParallel(model), optimizer

    def gather(self, value) -> list:
        values = [None] * self.size
        self.dist.all_gather_object(values, value)
        return values

    def settings(self) -> dict:
        return {"ddp": {"backend": "gloo", "bucket_cap_mb": 25}}

    def close(self) -> None:
        # Every rank leaves together. Tearing Gloo down still aborted a worker now and then
        # ("terminate called without an active exception", one of 30 runs in a grid) after the
        # job was done, so the process group is not torn down: main() ends DDP workers with
        # os._exit once the report is written, and the exit closes the connections.
        self.dist.barrier()


WORKERS = {"single": SingleWorker, "horovod": HorovodWorker, "ddp": DDPWorker}


def start_worker(framework: str, options: parallel.ParallelOptions):
    """This process's worker of ``framework`` (a parallel family's with ``options``)."""
    if framework in parallel.WORKERS:
        return parallel.WORKERS[framework](options)
    return WORKERS[framework]()


def build_model(name: str) -> tuple[nn.Module, DataLoader]:
    """The model and data loader of ``examples/NAME.py``."""
    if name not in MODELS:
        raise SystemExit(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    torch.manual_seed(0)
    return importlib.import_module(name).build()


class PhaseClock:
    """Where a worker's steps go: each phase's wall time and its CPU time on the training
    thread, and the CPU time the process's other threads (the framework's communication) took
    per step. On a worker pinned to one core, a phase's wall time beyond its own CPU time is
    what those threads and waiting took from it, which the simulator's CPU contention models.
    The phases are those the step marks: forward, backward and step, or a pipeline's schedule
    and step."""

    def __init__(self) -> None:
        self.wall_ms: dict = {}  # phase -> its times, in the order the phases came
        self.cpu_ms: dict = {}
        self.restart()

    def restart(self) -> None:
        """A step begins: its first phase is timed from now."""
        self.last_wall, self.last_cpu = time.perf_counter(), time.thread_time()

    def mark(self, phase: str) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        self.wall_ms.setdefault(phase, []).append((wall - self.last_wall) * 1e3)
        self.cpu_ms.setdefault(phase, []).append((cpu - self.last_cpu) * 1e3)
        self.last_wall, self.last_cpu = wall, cpu

    def medians(self) -> dict:
        return {
            "phase_wall_ms": {phase: statistics.median(v) for phase, v in self.wall_ms.items()},
            "phase_cpu_ms": {phase: statistics.median(v) for phase, v in self.cpu_ms.items()},
        }


def time_iterations(worker, model, optimizer, loader: DataLoader, warmup: int, steps: int) -> tuple[list[float], dict]:
    """Run ``warmup`` then ``steps`` training steps (``worker.step``); each timed step's wall
    time in milliseconds, and: the process's minor page faults per timed step (a capture records
    its own, and ``whatif validate`` holds the two side by side), the phases' medians
    (``PhaseClock``), the CPU time per timed step of the threads other than the training thread,
    and every step's loss."""
    loss_fn = nn.CrossEntropyLoss()
    batches = endless(loader)
    model.train()
    losses = [worker.step(model, optimizer, loss_fn, *next(batches), lambda phase: None) for _ in range(warmup)]
    times_ms = []
    clock = PhaseClock()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    process_cpu, thread_cpu = time.process_time(), time.thread_time()
    thread_usage = resource.getrusage(resource.RUSAGE_THREAD)
    end = time.perf_counter()
    for _ in range(steps):
        start = end
        clock.restart()
        losses.append(worker.step(model, optimizer, loss_fn, *next(batches), clock.mark))
        end = time.perf_counter()
        times_ms.append((end - start) * 1e3)
    # the two clocks are read one after the other: a few microseconds apart, never below zero
    other_threads_cpu = max((time.process_time() - process_cpu) - (time.thread_time() - thread_cpu), 0.0)
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return times_ms, {
        **_thread_usage(thread_usage, usage, steps),
        "page_faults_per_step": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps,
        **clock.medians(),
        "other_threads_cpu_ms_per_step": other_threads_cpu / steps * 1e3,
        "losses": losses,
    }


def _thread_usage(before, after, steps: int) -> dict:
    """The training thread's user and system CPU time and its context switches per timed step
    (``getrusage(RUSAGE_THREAD)``): system time is the kernel's work in the thread's time, which
    on a kernel without IRQ time accounting includes the network's softirqs that ran while it
    was on the core; involuntary switches count the times another thread took its core."""
    return {
        "training_thread_user_ms_per_step": (after.ru_utime - before.ru_utime) / steps * 1e3,
        "training_thread_system_ms_per_step": (after.ru_stime - before.ru_stime) / steps * 1e3,
        "training_thread_voluntary_switches_per_step": (after.ru_nvcsw - before.ru_nvcsw) / steps,
        "training_thread_involuntary_switches_per_step": (after.ru_nivcsw - before.ru_nivcsw) / steps,
    }


def fingerprint(model: nn.Module) -> str:
    """SHA-1 of the parameters' bytes: equal on every worker iff they trained in lockstep."""
    digest = hashlib.sha1()
    for parameter in model.parameters():
        digest.update(local(parameter).detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def local(parameter: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this worker holds (a DTensor's local shard)."""
    return parameter.to_local() if hasattr(parameter, "to_local") else parameter


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameters this worker holds."""
    return sum(local(p).numel() * p.element_size() for p in model.parameters())


def run(model_name: str, framework: str, steps: int, warmup: int, threads: int, batch_size=None,
        options: parallel.ParallelOptions = parallel.ParallelOptions()) -> tuple[int, dict]:
    """Train ``model_name`` under ``framework``; this worker's rank and the run's report."""
    torch.set_num_threads(threads)
    worker = start_worker(framework, options)
    try:
        model, loader = build_model(model_name)
        loader = with_batch_size(loader, batch_size)
        whole_model_gradient_bytes = gradient_bytes(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        model_for_training, optimizer = worker.prepare(model, optimizer)
        trained = getattr(model_for_training, "module", model_for_training)  # DDP's wrapped model
        data = shard(loader, worker.data_rank, worker.data_size)
        times_ms, where = time_iterations(worker, model_for_training, optimizer, data, warmup, steps)
        mine = {"rank": worker.rank, "hostname": socket.gethostname(), "pid": os.getpid(),
                "coordinates": worker.coordinates, "median_ms": statistics.median(times_ms), "iteration_ms": times_ms,
                **where, "parameter_bytes": parameter_bytes(trained), "parameters_sha1": fingerprint(trained)}
        workers = worker.gather(mine)
        report = {
            "model": model_name,
            "framework": framework,
            "world_size": worker.size,
            "threads": threads,
            "batch_size": loader.batch_size,
            "gradient_bytes": whole_model_gradient_bytes,
            "warmup_steps": warmup,
            "steps": steps,
            "torch_version": torch.__version__,
            **worker.settings(),
            "median_ms": mine["median_ms"],
            "page_faults_per_step": mine["page_faults_per_step"],
            "workers": sorted(workers, key=lambda w: w["rank"]),
        }
        return worker.rank, report
    finally:
        worker.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--framework", choices=FRAMEWORKS, default="single")
    parser.add_argument("--steps", type=int, default=30, help="timed steps after warm-up (default: 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker (default: 1)")
    parser.add_argument("--batch-size", type=int, help="per-worker batch size (default: the example's)")
    parser.add_argument("--json", type=Path, help="where rank 0 writes the report (default: standard output)")
    defaults = parallel.ParallelOptions()
    parser.add_argument("--tensor", type=int, default=defaults.tensor,
                        help=f"fsdp+tp: tensor-parallel ranks, the rest data parallel (default: {defaults.tensor})")
    parser.add_argument("--sequence-parallel", action="store_true", help="tp, fsdp+tp: shard norms and residuals by sequence")
    parser.add_argument("--microbatches", type=int, default=defaults.microbatches,
                        help=f"pp: microbatches per batch (default: {defaults.microbatches})")
    parser.add_argument("--schedule", choices=parallel.SCHEDULES, default=defaults.schedule,
                        help=f"pp: the pipeline schedule (default: {defaults.schedule})")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.threads < 1 or (args.batch_size is not None and args.batch_size < 1):
        parser.error("--steps, --threads and --batch-size must be at least 1, --warmup at least 0")
    if args.tensor < 1 or args.microbatches < 1:
        parser.error("--tensor and --microbatches must be at least 1")
    options = parallel.ParallelOptions(args.tensor, args.sequence_parallel, args.microbatches, args.schedule)
    rank, report = run(args.model, args.framework, args.steps, args.warmup, args.threads, args.batch_size, options)
    if rank == 0:
        write_report(report, args)
    if args.framework not in ("single", "horovod"):  # see DDPWorker.close
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def write_report(report: dict, args: argparse.Namespace) -> None:
    text = json.dumps(report, indent=1)
    if args.json is None:
        print(text)
        return
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(text + "\n")
    print(f"{args.model} {args.framework} x{report['world_size']}: median {report['median_ms']:.1f} ms "
          f"over {args.steps} steps per worker, {report['gradient_bytes'] / 1e6:.1f} MB of gradients; "
          f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
