"""Capturing a trace bundle from a training loop: the profiler trace plus what hooks saw.

A user adds a few lines to their loop::

    from whatif.collectors.capture import Capture

    with Capture("convnet.bundle", model=model, warmup=3, steps=5, batch_size=32) as capture:
        for inputs, labels in loader:
            train_step(model, optimizer, inputs, labels)
            if not capture.step():      # False once the bundle is written
                break

and gets a bundle (:mod:`whatif.collectors.bundle` documents the format): the PyTorch profiler
trace of ``steps`` steps after ``warmup`` steps (CPU activities, CUDA ones too when a GPU is
there, input shapes recorded, ``ProfilerStep#N`` around each step; the last warm-up step is the
profiler's own), and, for those steps, from hooks:

- each leaf module's forward interval, from a forward pre-hook to a forward hook, and its
  backward interval: from the first of the autograd nodes its forward created to start to the
  last of them, or of its parameters' gradient accumulations, to finish. The forward hook finds
  those nodes by walking back from the outputs' ``grad_fn`` to the inputs' and keeps their
  sequence numbers; the trace stamps every node's ``autograd::engine::evaluate_function`` range
  with the same number, so the backward times are read from the trace itself, on its clock.
  Nothing is hooked on the nodes: a Python hook there costs about 10 us a call, and
  ``register_full_backward_hook`` adds autograd nodes of its own to the trace and fails on
  in-place operations such as ``ReLU(inplace=True)`` after a hooked module. This is how
  Daydream maps kernels to layers.
- each parameter's name, shape, dtype, and when its gradient became ready
  (``Tensor.register_post_accumulate_grad_hook``): exactly what data-parallel training sends.

The hooks cost about 10 to 20 us of CPU time per leaf module and step (forward pre- and
post-hook, the walk, and the gradient hooks), which the trace shows as time between operators.

Clocks. The profiler stamps events with a TSC clock that it converts to ``CLOCK_REALTIME``
nanoseconds (the same clock as ``time.time_ns()``) and writes as microseconds after the trace's
``baseTimeNanoseconds``. Hooks therefore stamp with ``time.time_ns()`` and are mapped with that
base (the backward intervals need none: they come from the trace). To check the mapping, every profiled step opens with a ``whatif.capture.clock`` range,
stamped by ``time.time_ns()`` just before and just after it is entered: its trace timestamp
must lie between the two. Over all steps this bounds how far the two clocks disagree; the
manifest's ``clock`` records the bound (a few microseconds, the cost of entering a range), and
the mapping is shifted to its middle if the base alone would fall outside it.

``whatif collect -- python SCRIPT.py`` runs a script that uses :class:`Capture` with the output
folder, steps and warm-up in environment variables, which override the script's own arguments.
torch is imported only when a capture starts, so ``whatif collect`` itself runs without it.

On a GPU every step ends by waiting for the GPU (``torch.cuda.synchronize``): its wall-clock
time then covers its kernels, and the profiler loses none of the last step's. A training loop
that reads its loss (``loss.item()``) every step already waits as long.
"""

from __future__ import annotations

import os
import platform
import re
import resource
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

from .bundle import (MIN_WARMUP_FOR_OVERHEAD, TRACE_FILE, Bundle, BundleError, check_writable, is_bundle, read_bundle,
                     short_warmup, write_bundle)
from .diagnostics import warn
from .host import cpu_model
from .kineto import TraceError
from .load import load_trace


#: glibc's malloc without its moving mmap threshold and without trimming, as environment
#: variables for a process about to start. With glibc's defaults whether a step's large tensors
#: page-fault in again depends on what else the heap holds: the wide MLP's plain steps took 134 ms
#: in a capture's process (whose imports had shaped the heap) and 105 ms in a plain run of the
#: same loop, and 102 and 102 ms with these settings; DLRM-large in leveled profiling took 100 ms
#: plainly and 55 ms after a profiler had run. ``whatif validate --steady-allocator`` captures
#: and runs with them, so that both measure the same work.
STEADY_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**32 - 1)}
OUT_ENV = "WHATIF_CAPTURE_OUT"
STEPS_ENV = "WHATIF_CAPTURE_STEPS"
WARMUP_ENV = "WHATIF_CAPTURE_WARMUP"
CLOCK_MARKER = "whatif.capture.clock"
_EVALUATE = "autograd::engine::evaluate_function: "
_Tensor = type(None)  # torch.Tensor, once a capture has imported torch
_MAX_NODES_PER_CALL = 256  # a leaf module's forward creates a handful of autograd nodes


class CaptureError(Exception):
    """A capture that cannot go on; the message is one line saying why."""


class Capture:
    """Profiles ``steps`` training steps of ``model`` after ``warmup`` steps and writes a bundle.

    Use it as a context manager around the training loop and call :meth:`step` once at the end
    of every training step, from the first: it returns True while steps remain and False once
    the bundle is written (the loop may stop then). ``out`` is the bundle folder; an earlier
    bundle there is replaced, anything else is refused. Under ``whatif collect`` the
    environment's ``WHATIF_CAPTURE_OUT``, ``WHATIF_CAPTURE_STEPS`` and ``WHATIF_CAPTURE_WARMUP``
    override ``out``, ``steps`` and ``warmup``. ``batch_size`` is recorded in the environment.
    ``layers=False`` leaves out the module hooks, whose Python calls add 10 to 20 microseconds
    per module to every profiled step, for a trace as close to an unhooked run as possible.

    The warm-up steps before the profiler's own warm-up step run with neither the profiler nor
    the hooks, and their wall-clock times are kept in the manifest (``step_wall_ms``) beside
    those of the profiled steps: the least intrusive measurement of the same iteration (XSP's
    model level), from which the profiler's overhead in the trace can be removed
    (``sim/passes/profiler_overhead.py``).
    """

    def __init__(
        self,
        out: Union[str, Path, None] = None,
        *,
        model,
        steps: int = 5,
        warmup: int = 3,
        batch_size: Optional[int] = None,
        layers: bool = True,
    ):
        out = os.environ.get(OUT_ENV) or out
        if out is None:
            raise CaptureError("no bundle folder: give Capture(out=...) or run the script under `whatif collect`")
        self.out = Path(out)
        self.steps = count_setting(STEPS_ENV, "steps", steps, minimum=1)
        self.warmup = count_setting(WARMUP_ENV, "warmup", warmup, minimum=0)
        if self.warmup < MIN_WARMUP_FOR_OVERHEAD and not os.environ.get(WARMUP_ENV):  # whatif collect warned
            print(f"whatif: warning: {short_warmup(self.warmup)}", file=sys.stderr, flush=True)
        self.model = model
        self.batch_size = batch_size
        self.layers = layers
        self.bundle: Optional[Path] = None  # the folder, once written
        self._profiler = None
        self._cuda = False
        self._index = 0  # step() calls so far: the number of the step running now
        self._step: Optional[str] = None  # the ProfilerStep being recorded, None outside them
        self._handles: list = []
        self._claimed: set = set()  # autograd nodes already attributed to a module this step
        self._open: dict = {}  # module -> stack of its unfinished forward calls
        self._forward: list[list] = []  # [step, layer, start_ns, end_ns, tid]
        self._calls: list[list] = []  # [step, layer, sequence numbers of the autograd nodes it created]
        self._ready: list[list] = []  # [step, parameter, ns, tid]
        self._markers: list[tuple[int, int]] = []  # time_ns() before and after each clock marker
        self._step_ends_ns: list[int] = []  # perf_counter_ns() at __enter__ and at every step()
        self._step_end_faults: list[int] = []  # the process's minor page faults at the same moments

    def __enter__(self) -> "Capture":
        import torch

        try:
            check_writable(self.out)
        except BundleError as err:
            raise CaptureError(str(err)) from None
        global _Tensor
        self._torch, _Tensor = torch, torch.Tensor
        self._cuda = torch.cuda.is_available()
        self._describe_model()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(
            activities=activities,
            record_shapes=True,
            with_stack=False,
            schedule=torch.profiler.schedule(
                wait=max(self.warmup - 1, 0), warmup=min(self.warmup, 1), active=self.steps, repeat=1
            ),
        )
        profiler.__enter__()
        self._profiler = profiler
        self._begin_step()
        self._mark_step_end()
        return self

    def step(self) -> bool:
        """End the current training step. True while steps remain; False once the bundle is
        written (and on every call after that)."""
        if self.bundle is not None:
            return False
        if self._profiler is None:
            raise CaptureError("Capture.step() called outside its `with` block")
        if self._cuda:
            self._torch.cuda.synchronize()
        self._mark_step_end()
        self._index += 1
        last = self._index == self.warmup + self.steps
        self._step = None
        self._profiler.step()
        if last:
            self._finish()
            return False
        self._begin_step()
        return True

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.bundle is None and self._profiler is not None:
            self._step = None
            self._profiler.__exit__(None, None, None)
            self._profiler = None
            self._remove_hooks()
            if exc_type is None:
                raise CaptureError(
                    f"the training loop ended after {self._index} steps; the capture needs "
                    f"{self.warmup} warm-up and {self.steps} profiled steps (call capture.step() once per step)"
                )
        return False

    # -- steps and the clock markers ----------------------------------------------------------

    def _mark_step_end(self) -> None:
        self._step_ends_ns.append(time.perf_counter_ns())
        self._step_end_faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)

    def _begin_step(self) -> None:
        if self._index == max(self.warmup - 1, 0):  # the profiler's warm-up step, or the first profiled
            self._add_hooks()
        if not self.warmup <= self._index < self.warmup + self.steps:
            return
        self._claimed.clear()
        self._step = f"ProfilerStep#{self._profiler.step_num}"
        marker = self._torch.autograd.profiler.record_function(CLOCK_MARKER)
        before = time.time_ns()
        marker.__enter__()
        after = time.time_ns()
        marker.__exit__(None, None, None)
        self._markers.append((before, after))

    def _finish(self) -> None:
        self._profiler.__exit__(None, None, None)
        self._remove_hooks()
        with tempfile.TemporaryDirectory(prefix="whatif-capture-") as tmp:
            trace_file = Path(tmp) / TRACE_FILE
            self._profiler.export_chrome_trace(str(trace_file))
            self._profiler = None
            try:
                trace = load_trace(trace_file)
            except TraceError as err:
                raise CaptureError(f"the profiler wrote an unusable trace: {err.problem}") from None
            to_trace_us, clock = _align_clocks(trace, self._markers)
            ready = [[step, param, to_trace_us(ns), tid] for step, param, ns, tid in self._ready]
            intervals = [
                [step, layer, "forward", to_trace_us(start), to_trace_us(end), tid]
                for step, layer, start, end, tid in self._forward
            ] + _backward_intervals(trace, self._calls, self._layers, ready)
            try:
                self.bundle = write_bundle(
                    self.out,
                    self._manifest(clock),
                    trace_file,
                    self._parameters,
                    ready,
                    self._layers,
                    sorted(intervals, key=lambda row: row[3]),
                )
            except BundleError as err:
                raise CaptureError(str(err)) from None

    def _manifest(self, clock: dict) -> dict:
        return {
            "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "steps": [f"ProfilerStep#{i}" for i in range(self.warmup, self.warmup + self.steps)],
            "warmup_steps": self.warmup,
            "step_wall_ms": self._per_step(self._step_ends_ns, 1e-6),
            "step_page_faults": self._per_step(self._step_end_faults, 1),
            "clock": clock,
            "environment": _environment(self._torch, self.model, self.batch_size),
        }

    def _per_step(self, marks: list, unit: float) -> dict:
        """What every step took between two marks (wall-clock ms; minor page faults): ``unprofiled``
        for the steps without profiler or hooks (the first step left out: it pays for allocations
        and lazy initialisation), ``profiled`` for the profiled ones. A step ends when ``step()``
        is called (after a CUDA synchronize).

        The page faults tell whether the step's large tensors land in memory the allocator
        returned to the kernel (each 4 kB page is faulted in and zeroed again every step) or in
        memory it kept: whether the steps measured the same work as a run of the same loop
        in another process (``whatif validate`` compares them)."""
        per = [(b - a) * unit for a, b in zip(marks, marks[1:])]
        return {"unprofiled": per[1 : max(self.warmup - 1, 0)], "profiled": per[self.warmup :]}

    # -- hooks ---------------------------------------------------------------------------------

    def _describe_model(self) -> None:
        params = dict(self.model.named_parameters())
        owner = {}
        for name, module in self.model.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                owner[id(p)] = name or type(module).__name__
        self._parameters = [
            {
                "name": name,
                "layer": owner.get(id(p), ""),
                "shape": list(p.shape),
                "numel": p.numel(),
                "dtype": str(p.dtype).removeprefix("torch."),
                "element_size": p.element_size(),
                "requires_grad": p.requires_grad,
            }
            for name, p in params.items()
        ]
        self._leaves = [(name or type(m).__name__, m) for name, m in self.model.named_modules() if not any(m.children())]
        names = {id(p): n for n, p in params.items()}
        self._layers = [
            {"name": name, "type": type(m).__name__, "parameters": [names[id(p)] for p in m.parameters(recurse=False) if id(p) in names]}
            for name, m in self._leaves
        ]

    def _add_hooks(self) -> None:
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._gradient_hook(name)))
        for name, module in self._leaves if self.layers else ():
            self._handles.append(module.register_forward_pre_hook(self._forward_pre_hook(name)))
            self._handles.append(module.register_forward_hook(self._forward_hook(name)))

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._open.clear()
        self._claimed.clear()

    def _gradient_hook(self, name: str):
        def ready(_param) -> None:
            if self._step is not None:
                self._ready.append([self._step, name, time.time_ns(), threading.get_native_id()])

        return ready

    def _forward_pre_hook(self, name: str):
        def pre(module, args) -> None:
            if self._step is None:
                return
            start = time.time_ns()
            inputs = {t.grad_fn for t in _tensors(args) if t.grad_fn is not None}
            self._open.setdefault(module, []).append((start, inputs))

        return pre

    def _forward_hook(self, name: str):
        def post(module, args, output) -> None:
            end = time.time_ns()
            stack = self._open.get(module)
            if self._step is None or not stack:
                return
            start, inputs = stack.pop()
            self._forward.append([self._step, name, start, end, threading.get_native_id()])
            roots = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
            if roots:
                self._calls.append([self._step, name, self._autograd_nodes(roots, inputs)])

        return post

    def _autograd_nodes(self, roots: list, inputs: set) -> list[int]:
        """The sequence numbers of the autograd nodes one forward call created: those reachable
        from its outputs before any node of its inputs, of an earlier call, or of another
        tensor's gradient accumulation. The trace stamps each node's backward with its number."""
        nodes, todo, stop = [], list(roots), inputs | self._claimed
        seen = set()
        while todo and len(nodes) < _MAX_NODES_PER_CALL:
            node = todo.pop()
            if node is None or node in stop or node in seen:
                continue
            seen.add(node)
            if getattr(node, "variable", None) is not None:
                continue  # a gradient accumulation, found by its parameter's hook
            nodes.append(node)
            todo.extend(n for n, _ in node.next_functions)
        self._claimed.update(nodes)
        return [node._sequence_nr() for node in nodes]


def _backward_intervals(trace, calls: list, layers: list[dict], ready: list[list]) -> list[list]:
    """Each forward call's backward interval, read from the trace: from the first of its
    autograd nodes to start to the last of them, or of its parameters' gradient accumulations,
    to finish (the ``autograd::engine::evaluate_function`` ranges, which include hooks)."""
    ev = trace.events
    names = ev["name"].astype(str)
    start = (ev["ts_us"] + trace.origin_us).to_numpy()
    end = start + ev["dur_us"].to_numpy()
    thread = ev["thread"].astype(str).to_numpy()
    evaluate = np.flatnonzero(names.str.startswith(_EVALUATE).to_numpy())
    by_sequence: dict[int, list[int]] = {}
    for row, seq in zip(evaluate.tolist(), ev["sequence_nr"].to_numpy()[evaluate].tolist()):
        by_sequence.setdefault(seq, []).append(row)
    accumulations = evaluate[(names.to_numpy()[evaluate] == _EVALUATE + "torch::autograd::AccumulateGrad")]
    profiler_steps = np.flatnonzero(names.str.startswith("ProfilerStep#").to_numpy())
    steps = {names.iat[r]: (start[r], end[r]) for r in profiler_steps.tolist()}
    ready_at = {(step, param): ts for step, param, ts, _ in ready}  # the last accumulation wins
    params_of = {layer["name"]: layer["parameters"] for layer in layers}
    intervals = []
    for step, layer, sequence in calls:
        low, high = steps.get(step, (-np.inf, np.inf))
        rows = [r for seq in sequence for r in by_sequence.get(seq, ()) if low <= start[r] <= high]
        for param in params_of.get(layer, ()):
            t = ready_at.get((step, param))
            if t is not None:
                rows += accumulations[(start[accumulations] <= t) & (end[accumulations] >= t)].tolist()
        if rows:
            first = min(rows, key=lambda r: start[r])
            tid = thread[first].rpartition("/")[2]
            intervals.append(
                [step, layer, "backward", round(float(start[first]), 3), round(float(max(end[rows])), 3),
                 int(tid) if tid.isdigit() else tid]
            )
    return intervals


def _tensors(value) -> list:
    """The tensors in a module's arguments or output (tensors, and tuples, lists and dicts of them)."""
    if isinstance(value, _Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _align_clocks(trace, markers: list[tuple[int, int]]):
    """A function from ``time.time_ns()`` to the trace's microseconds, and the manifest's
    ``clock`` entry saying how it was found and how well the clocks agree."""
    rows = trace.events[trace.events["name"] == CLOCK_MARKER].sort_values("ts_us")
    marked = (rows["ts_us"].to_numpy() + trace.origin_us).tolist()
    base = trace.base_time_ns
    reference = base if base is not None else (markers[0][0] if markers else time.time_ns())
    pairs = list(zip(marked, markers))
    # the marker's trace time T lies between its before and after stamps: T - after <= shift <= T - before
    low = max((t - (after - reference) / 1000 for t, (_, after) in pairs), default=None)
    high = min((t - (before - reference) / 1000 for t, (before, _) in pairs), default=None)
    if low is None:
        shift, error = 0.0, None
    else:
        shift = 0.0 if base is not None and low <= 0 <= high else (low + high) / 2
        error = max(high - shift, shift - low, 0.0)

    def to_trace_us(ns: int) -> float:
        return round((ns - reference) / 1000 + shift, 3)

    clock = {
        "hooks": "time.time_ns() (CLOCK_REALTIME), read at the start of each hook",
        "mapping": "ts_us = (time_ns - reference_ns) / 1000 + shift_us",
        "reference_ns": reference,
        "reference": "the trace's baseTimeNanoseconds" if base is not None else "the first clock marker",
        "shift_us": round(shift, 3),
        "markers": len(pairs),
        "marker_bounds_us": None if low is None else [round(low, 3), round(high, 3)],
        "alignment_error_us": None if error is None else round(error, 3),
    }
    if len(marked) != len(markers):
        clock["note"] = f"{len(marked)} clock markers in the trace for {len(markers)} stamped"
    return to_trace_us, clock


def _environment(torch, model, batch_size: Optional[int]) -> dict:
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    env = {
        "device": str(device),
        "device_name": cpu_model(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "batch_size": batch_size,
        "pid": os.getpid(),
        "cuda": None,
    }
    if torch.cuda.is_available():
        env["cuda"] = {
            "version": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "devices": [
                {
                    "name": torch.cuda.get_device_name(i),
                    "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
                    "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
                }
                for i in range(torch.cuda.device_count())
            ],
        }
        if device.type == "cuda":
            env["device_name"] = torch.cuda.get_device_name(device)
    return env


def count_setting(env: str, what: str, given: int, minimum: int) -> int:
    """A whole-number setting of a capture run: the environment variable ``env`` overrides the
    script's own ``given`` value, so ``whatif collect --steps`` works on scripts that pass one."""
    raw = os.environ.get(env)
    value = given if raw is None or raw == "" else raw
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise CaptureError(f"{what} must be a whole number, not {value!r}" + (f" (from {env})" if raw else "")) from None
    if number < minimum:
        raise CaptureError(f"{what} must be at least {minimum}, not {number}" + (f" (from {env})" if raw else ""))
    return number


# -- whatif collect ----------------------------------------------------------------------------


def collect(
    command: Sequence[str], out: Optional[Path] = None, steps: Optional[int] = None, warmup: Optional[int] = None,
    env: Optional[dict] = None,
) -> Bundle:
    """Run ``command`` (a training script using :class:`Capture`) so that it writes its bundle
    at ``out`` (default: ``SCRIPT.bundle`` in the current folder), and read the bundle back.
    ``env`` adds variables to the script's environment.
    Raises :class:`CaptureError` for a missing script, an output folder that is not a bundle, a
    script that fails or writes no bundle."""
    command = list(command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CaptureError("no command to run: whatif collect [--out BUNDLE] -- python SCRIPT.py ARGS...")
    script = script_of(command)
    if script is not None and not Path(script).is_file():
        raise CaptureError(f"{script}: no such script")
    if command[0].endswith(".py"):
        command = [sys.executable] + command
    out = Path(out) if out is not None else Path(f"{Path(script).stem if script else 'capture'}.bundle")
    for what, value, minimum in (("--steps", steps, 1), ("--warmup", warmup, 0)):
        if value is not None and value < minimum:
            raise CaptureError(f"{what} must be at least {minimum}, not {value}")
    if warmup is not None:  # before the script runs: --strict refuses it
        warn(f"--warmup {warmup}", int(warmup < MIN_WARMUP_FOR_OVERHEAD), short_warmup(warmup))
    try:
        check_writable(out)
    except BundleError as err:
        raise CaptureError(str(err)) from None
    env = dict(os.environ, **(env or {}), **{OUT_ENV: str(out.resolve())})
    for name, value in ((STEPS_ENV, steps), (WARMUP_ENV, warmup)):
        if value is None:
            env.pop(name, None)
        else:
            env[name] = str(value)
    before = _stamp(out)
    try:
        status = subprocess.run(command, env=env).returncode
    except FileNotFoundError:
        raise CaptureError(f"{command[0]}: no such command") from None
    except PermissionError:
        raise CaptureError(f"{command[0]}: not executable") from None
    shown = shlex.join(command)
    if status < 0:
        raise CaptureError(f"`{shown}` was killed by signal {-status}; no bundle written")
    if status != 0:
        raise CaptureError(f"`{shown}` exited with status {status}; no bundle written")
    if _stamp(out) == before:
        raise CaptureError(
            f"`{shown}` wrote no bundle to {out}: does it use whatif.collectors.capture.Capture "
            "and call capture.step() every step?"
        )
    return read_bundle(out)


def script_of(command: list[str]) -> Optional[str]:
    """The Python script a command runs (``python [OPTIONS] SCRIPT.py``, or ``SCRIPT.py``), or None."""
    if command[0].endswith(".py"):
        return command[0]
    if not re.fullmatch(r"python[0-9.]*", Path(command[0]).name):
        return None
    for arg in command[1:]:
        if arg in ("-m", "-c", "-"):
            return None
        if not arg.startswith("-"):
            return arg
    return None


def _stamp(out: Path):
    """Which bundle is at ``out`` now (None: none), to tell whether the script wrote a new one."""
    try:
        stat = (out / "bundle.json").stat()
    except OSError:
        return None
    return (stat.st_ino, stat.st_mtime_ns) if is_bundle(out) else None
