"""Leveled profiling in the training process: one run of ``steps`` training steps at one level.

:class:`LeveledProfile` is XSP's measurement at one level of the stack (Li et al., "XSP:
Across-Stack Profiling and Analysis of Machine Learning Models on GPUs", IPDPS 2020; the levels
are in :mod:`whatif.collectors.xsp.levels`): at the model level it only times the steps; at the
layer level it times every leaf module's forward and backward with module and autograd hooks
(:class:`_LayerTimer`); at the operator and kernel levels it runs the torch profiler and, when
layers are profiled too, marks each leaf module's forward with a ``whatif.layer`` range and
notes the sequence numbers of the autograd nodes it created (:class:`_LayerAnnotator`), so that
the view can hang operators under layers. The record it writes is read by
:mod:`whatif.collectors.xsp.view`.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional, Sequence, Union

from ..capture import count_setting
from ..host import cpu_model
from .levels import (
    LAYER_RANGE,
    LEVEL_ENV,
    LEVELS_ENV,
    OUT_ENV,
    PROFILER_LEVELS,
    ROUND_ENV,
    RUN_FORMAT,
    STEPS_ENV,
    VERSION,
    WARMUP_ENV,
    ProfileError,
    parse_levels,
)


class LeveledProfile:
    """Measures ``steps`` training steps of ``model`` after ``warmup`` steps at one ``level``.

    Use it as a context manager around the training loop and call :meth:`step` at the end of
    every step, from the first: it returns True while steps remain and False once the level's
    record is written (the loop may stop then). ``out`` is the folder the record goes to, shared
    by the runs of all levels; the model and layer levels may leave it out and read
    :attr:`record` instead. Under ``whatif profile`` the environment's ``WHATIF_PROFILE_LEVEL``,
    ``WHATIF_PROFILE_OUT``, ``WHATIF_PROFILE_STEPS``, ``WHATIF_PROFILE_WARMUP`` and
    ``WHATIF_PROFILE_ROUND`` override ``level``, ``out``, ``steps``, ``warmup`` and ``round_index``;
    ``levels`` (or ``WHATIF_PROFILE_LEVELS``) are all the levels profiled, so that an operator
    run knows whether to attribute to layers. A level measured again in a later round
    writes ``LEVEL.ROUND.json``; the view pools the rounds' steps. On a GPU every step ends
    with ``torch.cuda.synchronize()``, at every level, so that a step's time holds its GPU work.
    """

    def __init__(
        self,
        out: Union[str, Path, None] = None,
        *,
        model,
        level: str = "model",
        levels: Optional[Sequence[str]] = None,
        steps: int = 10,
        warmup: int = 3,
        name: Optional[str] = None,
        round_index: int = 0,
    ):
        (self.level,) = parse_levels([os.environ.get(LEVEL_ENV) or level])
        self.levels = parse_levels(os.environ.get(LEVELS_ENV) or levels or [self.level])
        out = os.environ.get(OUT_ENV) or out
        self.out = Path(out) if out is not None else None
        if self.out is None and self.level in PROFILER_LEVELS:
            raise ProfileError(f"the {self.level} level writes a trace: give LeveledProfile(out=...) or run under `whatif profile`")
        self.steps = count_setting(STEPS_ENV, "steps", steps, minimum=1)
        self.warmup = count_setting(WARMUP_ENV, "warmup", warmup, minimum=1)
        self.round = count_setting(ROUND_ENV, "round", round_index, minimum=0)
        self._stem = self.level if self.round == 0 else f"{self.level}.{self.round}"
        self.model = model
        self.name = name or type(model).__name__
        self.record: Optional[dict] = None  # once the level is measured (or found impossible)
        self._step_ns: list[int] = []  # wall-clock time of each step
        self._step_cpu_ns: list[int] = []  # CPU time of the process in each step
        self._last_ns: Optional[int] = None  # when the step running now began; None outside the `with`
        self._last_cpu_ns = 0
        self._hooks = None
        self._profiler = None
        self._cuda = False

    def __enter__(self) -> "LeveledProfile":
        import torch

        self._torch = torch
        self._cuda = any(p.is_cuda for p in self.model.parameters())
        if self.level == "kernel" and not torch.cuda.is_available():
            self._write(self._header(run=False) | {"reason": "no GPU: torch.cuda.is_available() is False"})
            return self
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
        leaves = [(name or type(m).__name__, m) for name, m in self.model.named_modules() if not any(m.children())]
        if self.level == "layer":
            self._hooks = _LayerTimer(leaves, torch)
        elif self.level in PROFILER_LEVELS and "layer" in self.levels:
            self._hooks = _LayerAnnotator(leaves, torch)
        if self.level in PROFILER_LEVELS:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.level == "kernel":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(
                activities=activities,
                record_shapes=True,
                schedule=torch.profiler.schedule(wait=self.warmup - 1, warmup=1, active=self.steps, repeat=1),
            )
            self._profiler.__enter__()
        self._last_ns, self._last_cpu_ns = time.perf_counter_ns(), time.process_time_ns()
        return self

    def step(self) -> bool:
        """End the current training step. True while steps remain; False once the record is
        written (and on every call after that)."""
        if self.record is not None:
            return False
        if self._last_ns is None:
            raise ProfileError("LeveledProfile.step() called outside its `with` block")
        if self._cuda:
            self._torch.cuda.synchronize()
        self._step_ns.append(time.perf_counter_ns() - self._last_ns)
        self._step_cpu_ns.append(time.process_time_ns() - self._last_cpu_ns)
        if self._hooks is not None:
            self._hooks.end_step()
        if self._profiler is not None:
            self._profiler.step()
        if len(self._step_ns) == self.warmup + self.steps:
            self._finish()
            return False
        self._last_ns, self._last_cpu_ns = time.perf_counter_ns(), time.process_time_ns()
        return True

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.record is None and self._last_ns is not None:
            self._stop()
            if exc_type is None:
                raise ProfileError(
                    f"the training loop ended after {len(self._step_ns)} steps; the {self.level} level needs "
                    f"{self.warmup} warm-up and {self.steps} measured steps (call profile.step() once per step)"
                )
        return False

    def _stop(self) -> None:
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
        if self._hooks is not None:
            self._hooks.detach()

    def _finish(self) -> None:
        self._stop()
        record = self._header(run=True) | {
            "step_ms": [ns / 1e6 for ns in self._step_ns],
            "step_cpu_ms": [ns / 1e6 for ns in self._step_cpu_ns],
        }
        if isinstance(self._hooks, _LayerTimer):
            record["layers"] = [row for row in self._hooks.rows if row[0] >= self.warmup]
        if self._profiler is not None:
            trace = self.out / f"{self._stem}.pt.trace.json.gz"
            self._profiler.export_chrome_trace(str(trace))
            record["trace"] = trace.name
            if self._hooks is not None:
                record["layer_sequence_nr"] = self._hooks.sequence_nr
        self._write(record)

    def _header(self, run: bool) -> dict:
        torch = self._torch
        return {
            "format": RUN_FORMAT,
            "version": VERSION,
            "level": self.level,
            "levels": list(self.levels),
            "model": self.name,
            "round": self.round,
            "run": run,
            "warmup_steps": self.warmup,
            "steps": self.steps,
            "environment": {
                "device": "cuda" if self._cuda else "cpu",
                "device_name": torch.cuda.get_device_name() if self._cuda else cpu_model(),
                "torch": torch.__version__,
                "torch_threads": torch.get_num_threads(),
                "python": platform.python_version(),
                "hostname": socket.gethostname(),
            },
        }

    def _write(self, record: dict) -> None:
        self.record = record
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / f"{self._stem}.json").write_text(json.dumps(record, indent=1) + "\n")


def _created_nodes(outputs: list, inputs: set, claimed: set) -> list:
    """The autograd nodes one forward call created: reachable from its output tensors before a
    node of its inputs, of an earlier call or a gradient accumulation (which the trace cannot
    tie to a layer: it carries no sequence number). ``claimed`` holds the ids of the nodes
    earlier calls of the step created, and this adds the new ones': ids, not the nodes, so that
    the hooks keep no part of the graph, or the tensors it saved, alive past its backward."""
    todo = [t.grad_fn for t in outputs if t.grad_fn is not None]
    nodes, seen = [], set()
    while todo:
        node = todo.pop()
        if node is None or node in inputs or id(node) in claimed or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            continue
        nodes.append(node)
        todo.extend(n for n, _ in node.next_functions)
    claimed.update(map(id, nodes))
    return nodes


class _LeafHooks:
    """Forward pre-hooks and hooks on every leaf module; subclasses say what they do."""

    def __init__(self, leaves: list, torch):
        self.leaves = leaves
        self.tensor_type = torch.Tensor
        self.claimed: set = set()
        self.open: dict = {}  # module -> stack of (what the pre-hook started, its inputs' nodes)
        self.handles = []
        for name, module in leaves:
            self.handles.append(module.register_forward_pre_hook(self._pre(name)))
            self.handles.append(module.register_forward_hook(self._post(name)))

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def end_step(self) -> None:
        """Forget the step's autograd nodes (their ids may be reused by the next step's)."""
        self.claimed.clear()
        self.open.clear()

    def tensors(self, value) -> list:
        """The tensors in a module's arguments or output, however nested in tuples, lists and
        dicts (a loop, not torch's pytree: this runs twice per module call, and the pytree's
        5 us would be most of the hooks' cost)."""
        found, todo = [], [value]
        while todo:
            item = todo.pop()
            if isinstance(item, self.tensor_type):
                found.append(item)
            elif isinstance(item, (tuple, list)):
                todo.extend(item)
            elif isinstance(item, dict):
                todo.extend(item.values())
        return found

    def _pre(self, name: str):
        def pre(module, args) -> None:
            inputs = {t.grad_fn for t in self.tensors(args) if t.grad_fn is not None}
            self.open.setdefault(module, []).append((self.begin(name), inputs))

        return pre

    def _post(self, name: str):
        def post(module, args, output) -> None:
            started, inputs = self.open[module].pop()
            self.end(name, started, _created_nodes(self.tensors(output), inputs, self.claimed))

        return post


class _LayerTimer(_LeafHooks):
    """The layer level: each leaf module's forward and backward time per step. ``rows`` holds
    [step, layer, pass, total_us, calls] for every step."""

    def __init__(self, leaves: list, torch):
        super().__init__(leaves, torch)
        self.rows: list[list] = []
        self.step = 0
        self.totals: dict = defaultdict(lambda: [0, 0])  # (layer, pass) -> [ns, calls] this step

    def begin(self, name: str) -> int:
        return time.perf_counter_ns()

    def end(self, name: str, started: int, nodes: list) -> None:
        total = self.totals[(name, "forward")]
        total[0] += time.perf_counter_ns() - started
        total[1] += 1
        if nodes:
            self.totals[(name, "backward")][1] += 1
            for node in nodes:
                self._time_backward(node, self.totals[(name, "backward")])

    @staticmethod
    def _time_backward(node, total: list) -> None:
        began = [0]

        def pre(grad_outputs) -> None:
            began[0] = time.perf_counter_ns()

        def post(grad_inputs, grad_outputs) -> None:
            total[0] += time.perf_counter_ns() - began[0]

        node.register_prehook(pre)
        node.register_hook(post)

    def end_step(self) -> None:
        self.rows += [[self.step, layer, phase, ns / 1e3, calls] for (layer, phase), (ns, calls) in self.totals.items()]
        self.totals.clear()
        self.step += 1
        super().end_step()


class _LayerAnnotator(_LeafHooks):
    """At the profiler levels: a ``whatif.layer: NAME`` range around each leaf module's forward,
    and the sequence numbers of the autograd nodes it created, which the trace stamps on their
    backward ranges."""

    def __init__(self, leaves: list, torch):
        super().__init__(leaves, torch)
        self.record_function = torch.autograd.profiler.record_function
        self.sequence_nr: dict[str, list[int]] = defaultdict(list)

    def begin(self, name: str):
        scope = self.record_function(LAYER_RANGE + name)
        scope.__enter__()
        return scope

    def end(self, name: str, scope, nodes: list) -> None:
        scope.__exit__(None, None, None)
        self.sequence_nr[name].extend(node._sequence_nr() for node in nodes)
