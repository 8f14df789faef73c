"""The fitted models of one device: a roofline per kernel path, trees per family, and their file.

A family's model (:class:`FamilyModel`) is the DLRM performance model's heuristic roofline (Lin
et al., 2022; ``shared/seeds/002``) per kernel path, ``t = overhead + max(FLOPs / (peak *
e_compute), bytes / (bandwidth * e_memory)) + loops * per_loop`` (:class:`Roofline`), times the
exponential of the residual its gradient-boosted trees predict where they were kept;
:class:`PerfModels` holds one per family with the device's peak compute and bandwidth and the
samples held out of the fit, and predicts calls from their recorded shapes.

A models file is JSON (the trees as LightGBM's text format, no pickle) and names the device it
was measured on; loading one measured elsewhere warns (:class:`DeviceMismatchWarning`), and a
file that cannot be used is a :class:`PerfModelError` naming the file and the field.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import pandas as pd

from .device import device_mismatch
from .families import FAMILY_OF, FAMILY_OPS
from .work import read_call

FORMAT = "whatif-perfmodels"
VERSION = 6  # 6: convolutions split by PyTorch's backend, their memory time added; embeddings' distinct rows; 5: scalar arguments, rooflines per kernel path; 4: a roofline may add compute and memory (GEMM); 3: matmul folds one-sided batch dimensions


class PerfModelError(Exception):
    """A models file, or a sample, that cannot be used; the message names the file and field."""


class DeviceMismatchWarning(UserWarning):
    """The models were measured on another device than the one they are used for."""


_PARAMS = 11  # shape parameters the trees see (padded)


def tree_features(path_code: int, flops: float, bytes_: float, params: list) -> list[float]:
    """What the trees see: the operator's kernel path, its work, and its family's shape
    parameters (:func:`~whatif.sim.perfmodels.work.read_call`'s)."""
    padded = (list(params) + [0] * _PARAMS)[:_PARAMS]
    return [float(path_code), math.log2(flops + 1), math.log2(bytes_ + 1)] + [math.log2(float(v) + 1) for v in padded]


@dataclass
class Roofline:
    """``overhead + max(compute, memory) + loops x per_loop``: the roof, plus what each inner
    loop costs to start (a layer norm over rows of 32 spends as long starting rows as reading
    them). ``additive``: ``compute + memory`` instead of their max, for work that moves its
    operands before computing on them (:data:`~whatif.sim.perfmodels.families.ADDITIVE_FAMILIES`)."""

    overhead_us: float
    compute_efficiency: float
    memory_efficiency: float
    samples: int = 0
    per_loop_us: float = 0.0
    additive: bool = False

    def predict_us(self, flops: np.ndarray, bytes_: np.ndarray, loops: np.ndarray, peak_flops_per_us: float,
                   bytes_per_us: float) -> np.ndarray:
        compute = flops / (peak_flops_per_us * self.compute_efficiency)
        memory = bytes_ / (bytes_per_us * self.memory_efficiency)
        both = compute + memory if self.additive else np.maximum(compute, memory)
        return self.overhead_us + both + loops * self.per_loop_us


@dataclass
class FamilyModel:
    name: str
    pooled: Roofline
    ops: dict[str, Roofline] = field(default_factory=dict)  # by kernel path (:func:`kernel_path`)
    op_codes: list[str] = field(default_factory=list)  # the trees' kernel-path feature: index in this list
    trees: Optional[str] = None  # LightGBM model_to_string() of the residual, None: roofline only
    _booster: object = field(default=None, repr=False, compare=False)

    @property
    def kind(self) -> str:
        return "roofline+gbt" if self.trees else "roofline"

    def booster(self):
        if self._booster is None and self.trees:
            import lightgbm

            self._booster = lightgbm.Booster(model_str=self.trees)
        return self._booster


@dataclass
class PerfModels:
    """Per-family models on one device, with the samples held out of their fit."""

    device: dict
    families: dict[str, FamilyModel]
    held_out: pd.DataFrame  # op, dims, types, args, duration_us, source
    sources: list = field(default_factory=list)
    created: str = ""

    @property
    def threads(self) -> int:
        """Torch's intra-op threads on the device measured: PyTorch picks convolution kernels by it."""
        return int(self.device.get("threads", 1))

    @property
    def peak_flops_per_us(self) -> float:
        return float(self.device["peak_gflops"]) * 1e3

    @property
    def bytes_per_us(self) -> float:
        return float(self.device["bandwidth_gbps"]) * 1e3

    def covers(self, op: str) -> bool:
        return FAMILY_OF.get(op) in self.families

    def predict_us(self, ops: Sequence[str], dims: Sequence, types: Sequence, args: Optional[Sequence] = None,
                   learned: bool = True) -> np.ndarray:
        """Predicted durations; NaN where the operator's family has no model or its shapes do not
        fit it. ``args``: per call its recorded scalar arguments (``Concrete Inputs``), if any."""
        args = list(args) if args is not None else [()] * len(ops)
        out = np.full(len(ops), np.nan)
        frame = pd.DataFrame({"op": list(ops), "family": [FAMILY_OF.get(o) for o in ops]})
        for family, rows in frame.groupby("family", sort=False):
            model = self.families.get(family)
            if model is None:
                continue
            idx = rows.index.to_numpy()
            done = [read_call(ops[i], dims[i], types[i], args[i], self.threads) for i in idx]
            flops, bytes_, loops = np.array([d[:3] for d in done], dtype=float).reshape(-1, 3).T
            keys = [d[4] for d in done]
            roof = np.empty(len(idx))
            for key, positions in pd.Series(range(len(idx)), index=keys).groupby(level=0):
                line = model.ops.get(key) or model.ops.get(key.split("/")[0], model.pooled)
                p = positions.to_numpy()
                roof[p] = line.predict_us(flops[p], bytes_[p], loops[p], self.peak_flops_per_us, self.bytes_per_us)
            if learned and model.trees:
                codes = [model.op_codes.index(k) if k in model.op_codes else -1 for k in keys]
                features = np.array([tree_features(c, *d[:2], d[3]) for c, d in zip(codes, done)])
                finite = np.isfinite(roof)
                if finite.any():
                    roof[finite] = roof[finite] * np.exp(model.booster().predict(features[finite]))
            out[idx] = roof
        return out

    # -- files ---------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "created": self.created,
            "device": self.device,
            "sources": list(self.sources),
            "families": {
                name: {
                    "kind": m.kind,
                    "pooled": _roofline_doc(m.pooled),
                    "ops": {op: _roofline_doc(r) for op, r in m.ops.items()},
                    "op_codes": list(m.op_codes),
                    "trees": m.trees,
                }
                for name, m in self.families.items()
            },
            "held_out": {
                "op": self.held_out["op"].tolist(),
                "dims": self.held_out["dims"].tolist(),
                "types": self.held_out["types"].tolist(),
                "args": self.held_out["args"].tolist(),
                "duration_us": [round(float(v), 3) for v in self.held_out["duration_us"]],
                "source": self.held_out["source"].tolist(),
            },
        }

    def save(self, path: Union[str, Path]) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        tmp.replace(path)


def _roofline_doc(r: Roofline) -> dict:
    return {
        "overhead_us": r.overhead_us,
        "compute_efficiency": r.compute_efficiency,
        "memory_efficiency": r.memory_efficiency,
        "per_loop_us": r.per_loop_us,
        "additive": r.additive,
        "samples": r.samples,
    }


def load_models(path: Union[str, Path], check_device: bool = True) -> PerfModels:
    """Read a models file; raises :class:`PerfModelError` naming the file and the bad field, and
    warns with :class:`DeviceMismatchWarning` when it was measured on another device."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise PerfModelError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise PerfModelError(f"{path}: cannot be read ({getattr(err, 'strerror', None) or err})") from None
    except json.JSONDecodeError as err:
        raise PerfModelError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    except RecursionError:
        raise PerfModelError(f"{path}: JSON nested deeper than Python's recursion limit: no models file nests so deep") from None
    reader = _Reader(path)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise PerfModelError(f"{path}: field 'format' is not {FORMAT!r}: not a whatif performance models file")
    if doc.get("version") != VERSION:
        raise PerfModelError(f"{path}: field 'version' is {doc.get('version')!r}; this whatif reads version {VERSION}")
    device = reader.mapping(doc, "device")
    for key in ("type", "name"):
        reader.text(device, key, f"device.{key}")
    for key in ("peak_gflops", "bandwidth_gbps"):
        reader.positive(device, key, f"device.{key}")
    families = {}
    for name, fdoc in reader.mapping(doc, "families").items():
        where = f"families.{name}"
        if name not in FAMILY_OPS:
            raise PerfModelError(f"{path}: field '{where}' is not a known family ({', '.join(FAMILY_OPS)})")
        fdoc = reader.mapping({name: fdoc}, name, where)
        ops = {op: reader.roofline(r, f"{where}.ops.{op}") for op, r in reader.mapping(fdoc, "ops", f"{where}.ops").items()}
        trees = fdoc.get("trees")
        if trees is not None and not isinstance(trees, str):
            raise PerfModelError(f"{path}: field '{where}.trees' must be LightGBM's model text or null")
        codes = fdoc.get("op_codes", [])
        if not isinstance(codes, list) or not all(isinstance(c, str) for c in codes):
            raise PerfModelError(f"{path}: field '{where}.op_codes' must be a list of operator names")
        families[name] = FamilyModel(name, reader.roofline(fdoc.get("pooled"), f"{where}.pooled"), ops, codes, trees)
    held = reader.mapping(doc, "held_out")
    columns = {}
    for key in ("op", "dims", "types", "args", "duration_us", "source"):
        value = held.get(key)
        if not isinstance(value, list):
            raise PerfModelError(f"{path}: field 'held_out.{key}' must be a list")
        columns[key] = value
    if len({len(v) for v in columns.values()}) > 1:
        raise PerfModelError(f"{path}: the lists in field 'held_out' differ in length")
    models = PerfModels(device, families, pd.DataFrame(columns), list(doc.get("sources", [])), str(doc.get("created", "")))
    if check_device:
        mismatch = device_mismatch(models.device)
        if mismatch:
            warnings.warn(f"{path}: {mismatch}", DeviceMismatchWarning, stacklevel=2)
    return models


class _Reader:
    """Field checks that name the file and the field, for one-line errors."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, where: str, problem: str):
        raise PerfModelError(f"{self.path}: field '{where}' {problem}")

    def mapping(self, doc: dict, key: str, where: Optional[str] = None) -> dict:
        value = doc.get(key) if isinstance(doc, dict) else None
        if not isinstance(value, dict):
            self.fail(where or key, "is missing or not an object")
        return value

    def text(self, doc: dict, key: str, where: str) -> str:
        if not isinstance(doc.get(key), str):
            self.fail(where, "is missing or not a string")
        return doc[key]

    def positive(self, doc: dict, key: str, where: str) -> float:
        return self._number(doc, key, where, "a positive number", lambda value: value > 0)

    def non_negative(self, doc: dict, key: str, where: str) -> float:
        return self._number(doc, key, where, "a non-negative number", lambda value: value >= 0)

    def _number(self, doc: dict, key: str, where: str, wanted: str, fits) -> float:
        value = doc.get(key) if isinstance(doc, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not fits(value):
            self.fail(where, f"must be {wanted}, not {value!r}")
        return float(value)

    def roofline(self, doc, where: str) -> Roofline:
        if not isinstance(doc, dict):
            self.fail(where, "is missing or not an object")
        return Roofline(
            self.non_negative(doc, "overhead_us", f"{where}.overhead_us"),
            self.positive(doc, "compute_efficiency", f"{where}.compute_efficiency"),
            self.positive(doc, "memory_efficiency", f"{where}.memory_efficiency"),
            int(doc.get("samples", 0) or 0),
            self.non_negative(doc, "per_loop_us", f"{where}.per_loop_us"),
            self.flag(doc, "additive", f"{where}.additive"),
        )

    def flag(self, doc: dict, key: str, where: str) -> bool:
        if not isinstance(doc.get(key), bool):
            self.fail(where, f"must be true or false, not {doc.get(key)!r}")
        return doc[key]

