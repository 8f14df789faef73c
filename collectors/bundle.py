"""Trace bundles: a profiler trace together with what module and gradient hooks saw while it ran.

A Kineto trace alone says which operators ran, not which layer or parameter they belong to:
gradient sizes must be guessed from ``AccumulateGrad`` shapes and layers from operator names.
:class:`whatif.collectors.capture.Capture` records them exactly while the profiler runs and
writes one folder, a *bundle* (format ``whatif-trace-bundle``, version 1)::

    NAME.bundle/
      bundle.json               the manifest: format, version, files, steps, clock, environment
      trace.pt.trace.json.gz    the PyTorch profiler trace (gzipped Kineto Chrome JSON)
      parameters.json           every parameter, and when its gradient became ready in each step
      layers.json               every leaf module, and its forward and backward time in each step

``bundle.json``::

    {"format": "whatif-trace-bundle", "version": 1, "created": "2026-11-21T18:13:46Z",
     "files": {"trace": "trace.pt.trace.json.gz", "parameters": "parameters.json",
               "layers": "layers.json"},
     "steps": ["ProfilerStep#4", ...],           # the profiled steps, named as in the trace
     "warmup_steps": 4,                          # steps run before them
     "step_wall_ms": {"unprofiled": [...],       # wall time of warm-up steps 2 .. warmup-1,
                      "profiled": [...],         #   run without profiler or hooks; and of the profiled ones
                      "processes": [...]},       # optional: the median unprofiled step of each process
                                                 #   that captured the same job (this one's included)
     "step_page_faults": {...},                  # the process's minor page faults in the same steps
     "clock": {...},                             # how hook times were put on the trace's clock
     "environment": {"device": "cpu", "torch": "2.13.0+cpu", "torch_threads": 1,
                     "hostname": ..., "cpu_model": ..., "batch_size": 32, "pid": ..., ...}}

``parameters.json`` lists each parameter (``name`` as in ``model.named_parameters()``, ``layer``,
``shape``, ``numel``, ``dtype``, ``element_size``, ``requires_grad``) and a table ``ready`` of
rows ``[step, parameter, ts_us, tid]``: the moment its post-accumulate-grad hook ran, on thread
``tid``. A parameter accumulated more than once in a step (gradient accumulation) has a row
each time; the last is when that step's gradient was final. ``layers.json`` lists each leaf
module (``name``, ``type``, ``parameters``) and a table ``intervals`` of rows
``[step, layer, pass, start_us, end_us, tid]``, ``pass`` being ``forward`` or ``backward``, one
row per call of the module: forward from its forward pre-hook to its forward hook, backward from
the first of the autograd nodes that call created to start to the last of them, or of the
module's gradient accumulations, to finish (the nodes' ranges in the trace).

Every ``*_us`` time is in microseconds on the trace's own clock: directly comparable with the
``ts`` of the trace's events (not with the offsets from the first event that
:class:`~whatif.collectors.kineto.KinetoTrace` keeps; subtract its ``origin_us``). The manifest's
``clock`` says how the hooks' clock was mapped onto it and how well the two agree (it bounds
the forward intervals and gradient-ready times; backward intervals are read from the trace).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Union

import pandas as pd

from .kineto import KinetoTrace, TraceError, read_kineto

FORMAT = "whatif-trace-bundle"
VERSION = 1
MANIFEST = "bundle.json"
TRACE_FILE = "trace.pt.trace.json.gz"
PARAMETERS_FILE = "parameters.json"
LAYERS_FILE = "layers.json"

#: the least warm-up that times a step without the profiler (step 1 of 0, 1, 2: the first is cold,
#: the last is the profiler's own warm-up), which the profiler-overhead correction needs
MIN_WARMUP_FOR_OVERHEAD = 3


def short_warmup(warmup: int) -> str:
    """What a capture's warm-up below :data:`MIN_WARMUP_FOR_OVERHEAD` costs, in one phrase."""
    return (f"a warm-up of {warmup} steps times no step without the profiler (steps 2 to warm-up - 1 are), so "
            "predictions from this bundle cannot remove the profiler's overhead and will be slower than the plain "
            f"run; use --warmup {MIN_WARMUP_FOR_OVERHEAD} or more")


READY_COLUMNS = ["step", "parameter", "ts_us", "tid"]
INTERVAL_COLUMNS = ["step", "layer", "pass", "start_us", "end_us", "tid"]


class BundleError(TraceError):
    """A bundle folder that cannot be used; the message names the folder and the problem."""


@dataclass
class Bundle:
    """A bundle read back: the manifest, and its tables as frames (times on the trace's clock)."""

    path: Path
    manifest: dict
    parameters: pd.DataFrame  # name, layer, shape, numel, dtype, element_size, requires_grad
    ready: pd.DataFrame  # READY_COLUMNS
    layers: pd.DataFrame  # name, type, parameters
    intervals: pd.DataFrame  # INTERVAL_COLUMNS
    environment: dict = field(default_factory=dict)

    @property
    def trace_path(self) -> Path:
        return self.path / self.manifest["files"]["trace"]

    @property
    def steps(self) -> list[str]:
        return list(self.manifest.get("steps", []))

    @property
    def pid(self):
        return self.environment.get("pid")

    @property
    def unprofiled_step_ms(self) -> list[float]:
        """Wall-clock times of warm-up steps run without profiler or hooks (empty for bundles
        written before they were recorded, or with too few warm-up steps)."""
        times = (self.manifest.get("step_wall_ms") or {}).get("unprofiled") or []
        return [float(t) for t in times if isinstance(t, (int, float)) and t > 0]

    @property
    def process_unprofiled_ms(self) -> list[float]:
        """The median plain step of every process that captured the same job, this one's
        included, where the capture ran several (the lab does, ``lab/validate.py``): whole
        processes run at different speeds, and a prediction's interval holds them
        (``whatif/pipeline.py``). Empty where one process captured it."""
        times = (self.manifest.get("step_wall_ms") or {}).get("processes") or []
        return [float(t) for t in times if isinstance(t, (int, float)) and math.isfinite(t) and t > 0]

    @property
    def unprofiled_page_faults(self) -> list[int]:
        """Minor page faults of the same steps (empty for bundles written before they were recorded)."""
        faults = (self.manifest.get("step_page_faults") or {}).get("unprofiled") or []
        return [int(f) for f in faults if isinstance(f, (int, float)) and f >= 0]


@dataclass
class BundledTrace(KinetoTrace):
    """A bundle's Kineto trace, with the bundle it came in."""

    bundle: Bundle = field(kw_only=True)


def is_bundle(path: Union[str, Path]) -> bool:
    """Whether ``path`` is a bundle folder (it holds a ``bundle.json``)."""
    return (Path(path) / MANIFEST).is_file()


def read_bundled_trace(path: Union[str, Path]) -> BundledTrace:
    """Read a bundle and its trace."""
    bundle = read_bundle(path)
    trace = read_kineto(bundle.trace_path)
    return BundledTrace(**{f.name: getattr(trace, f.name) for f in fields(trace)}, bundle=bundle)


def read_bundle(path: Union[str, Path]) -> Bundle:
    """Read a bundle's manifest and tables (not its trace: :func:`read_bundled_trace` reads both)."""
    path = Path(path)
    manifest = _read_json(path, MANIFEST)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(path, f"{MANIFEST} is not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise BundleError(path, f"bundle version {manifest.get('version')!r}; this whatif reads version {VERSION}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(files.get(k), str) for k in ("trace", "parameters", "layers")):
        raise BundleError(path, f"{MANIFEST} does not name its trace, parameters and layers files")
    if not (path / files["trace"]).is_file():
        raise BundleError(path, f"the trace {files['trace']} named in {MANIFEST} is missing")
    parameters = _read_json(path, files["parameters"])
    layers = _read_json(path, files["layers"])
    try:
        return Bundle(
            path=path,
            manifest=manifest,
            parameters=pd.DataFrame(parameters["parameters"]),
            ready=_table(parameters["ready"], READY_COLUMNS),
            layers=pd.DataFrame(layers["layers"]),
            intervals=_table(layers["intervals"], INTERVAL_COLUMNS),
            environment=dict(manifest.get("environment") or {}),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise BundleError(path, f"parameters or layers table is malformed ({err})") from None


def write_bundle(
    path: Union[str, Path],
    manifest: dict,
    trace_file: Path,
    parameters: list[dict],
    ready: list[list],
    layers: list[dict],
    intervals: list[list],
) -> Path:
    """Write a complete bundle at ``path``, replacing a bundle already there.

    Everything is written to a sibling folder first and renamed into place, so an interrupted
    capture never leaves a half-written bundle, and a folder that is not a bundle is never
    replaced (:func:`check_writable`)."""
    path = Path(path)
    check_writable(path)
    staging = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        shutil.copyfile(trace_file, staging / TRACE_FILE)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            **manifest,
            "files": {"trace": TRACE_FILE, "parameters": PARAMETERS_FILE, "layers": LAYERS_FILE},
        }
        _write_json(staging / PARAMETERS_FILE, {"parameters": parameters, "ready": {"columns": READY_COLUMNS, "rows": ready}})
        _write_json(staging / LAYERS_FILE, {"layers": layers, "intervals": {"columns": INTERVAL_COLUMNS, "rows": intervals}})
        _write_json(staging / MANIFEST, manifest)
        check_writable(path)
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            path.rename(old)
        staging.rename(path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path


def check_writable(path: Union[str, Path]) -> None:
    """Raise :class:`BundleError` unless a bundle may be written at ``path``: nothing there, an
    empty folder, or an earlier bundle (which is replaced)."""
    path = Path(path)
    if not path.exists() or is_bundle(path):
        return
    if not path.is_dir():
        raise BundleError(path, "exists and is not a folder; refusing to replace it with a bundle")
    if any(path.iterdir()):
        raise BundleError(path, f"exists and is not a bundle (no {MANIFEST}); refusing to overwrite it")


def _read_json(folder: Path, name: str):
    target = folder / name
    try:
        return json.loads(target.read_text())
    except FileNotFoundError:
        if not folder.exists():
            raise BundleError(folder, "no such bundle") from None
        raise BundleError(folder, f"{name} is missing") from None
    except (OSError, UnicodeDecodeError) as err:
        raise BundleError(folder, f"{name} cannot be read ({getattr(err, 'strerror', None) or err})") from None
    except json.JSONDecodeError:
        raise BundleError(folder, f"{name} is not valid JSON") from None
    except RecursionError:
        raise BundleError(folder, f"{name}: JSON nested deeper than Python's recursion limit") from None


def _table(doc: dict, columns: list[str]) -> pd.DataFrame:
    if list(doc["columns"]) != columns:
        raise ValueError(f"columns {doc['columns']}, expected {columns}")
    return pd.DataFrame(doc["rows"], columns=columns)


def record_processes(path: Union[str, Path], process_unprofiled_ms: list[float]) -> None:
    """Note in the bundle at ``path`` the median plain step of every process that captured the
    same job (``Bundle.process_unprofiled_ms``), its own included; the manifest is replaced in
    one rename."""
    path = Path(path)
    manifest = _read_json(path, MANIFEST)
    manifest.setdefault("step_wall_ms", {})["processes"] = [float(t) for t in process_unprofiled_ms]
    staging = path / f".{MANIFEST}.tmp-{os.getpid()}"
    _write_json(staging, manifest)
    staging.replace(path / MANIFEST)


def _write_json(path: Path, doc) -> None:
    path.write_text(_dumps(doc) + "\n")


def _dumps(doc, indent: str = "") -> str:
    """JSON with one key, table row or list entry a line: readable, and diffs stay small."""
    inner = indent + " "
    if _is_scalar(doc) or _is_row(doc) or (isinstance(doc, dict) and len(indent) > 1 and all(map(_is_row, doc.values()))):
        return json.dumps(doc, separators=(", ", ": "))
    if isinstance(doc, dict):
        items = [f"{inner}{json.dumps(str(k))}: {_dumps(v, inner)}" for k, v in doc.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    return "[\n" + ",\n".join(inner + _dumps(v, inner) for v in doc) + "\n" + indent + "]"


def _is_scalar(value) -> bool:
    return not isinstance(value, (dict, list))


def _is_row(value) -> bool:
    """A scalar or a list of scalars: written on one line."""
    return _is_scalar(value) or (isinstance(value, list) and all(map(_is_scalar, value)))
