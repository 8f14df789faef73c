"""The traces the tests run on: where they are, their names, and one load of each per session.

The real GPU traces are in ``../shared/traces`` beside the repository (see its SOURCES.md); they
are never copied into the repository. ``WHATIF_SHARED_TRACES`` points the suite elsewhere. A test
names a trace by its path under the shared folder (``"hta-misc/a100_event_sync.json.gz"``) or as
:data:`BUNDLED`, the CPU trace in ``data/``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from whatif import Request, TraceStudy, WhatIf, predict
from whatif.collectors.kineto import KinetoTrace

REPO = Path(__file__).resolve().parents[1]
BUNDLED = "bundled/convnet_cpu"
BUNDLED_TRACE = REPO / "data" / "convnet_cpu.pt.trace.json.gz"
SHARED_TRACES = Path(os.environ.get("WHATIF_SHARED_TRACES") or REPO.parent / "shared" / "traces")
EXECUTION_TRACE = "param-dlrm-8rank/execution_trace_rank0.json.gz"
NO_SHARED = (
    f"the shared GPU traces are not at {SHARED_TRACES} "
    "(check out ../shared beside the repository, or set WHATIF_SHARED_TRACES)"
)

RESNET50 = "kineto-resnet50-v100/resnet50_bs32_workers0.pt.trace.json.gz"  # 2021 schema
RESNET50_WORKERS4 = "kineto-resnet50-v100/resnet50_bs32_workers4.pt.trace.json.gz"
V100_1GPU = "hta-ddp-resnet50/v100_1gpu_rank0.json.gz"  # current schema, GPU-bound
A100_DDP2 = "hta-ddp-resnet50/a100_ddp2_rank0.json.gz"
EVENT_SYNC = "hta-misc/a100_event_sync.json.gz"
EVENT_SYNC_MULTISTREAM = "hta-misc/a100_event_sync_multistream.json.gz"
RECSYS = "hta-misc/a100_rank3_of8_recsys.json.gz"
COMPILED_DDP = "hta-misc/v100_ddp2_compiled_rank1.json.gz"
DLRM_RANK0 = "param-dlrm-8rank/worker0.json.gz"
RESNET18 = "param-resnet18-2080ti/resnet18_bs128.json.gz"


def predicted(study: TraceStudy, what_if: WhatIf):
    """The schedule of ``what_if`` on a cached study's trace, and its report beside the replay
    (``replay_ms``, ``speedup``): the pipeline, the profiler's overhead kept as the replay keeps it."""
    prediction = predict(Request(study, what_if=what_if, remove_profiler_overhead=False))
    return prediction.schedule, prediction.speedup_report()


def shared_kineto_traces() -> list[str]:
    """Every Kineto trace under the shared folder (not the execution trace), relative to it."""
    if not SHARED_TRACES.is_dir():
        return []
    found = sorted(p.relative_to(SHARED_TRACES).as_posix() for p in SHARED_TRACES.glob("*/*.json.gz"))
    return [name for name in found if name != EXECUTION_TRACE]


class Traces:
    """Resolves trace names to files and keeps each trace's study for the whole session.

    A cached :class:`TraceStudy` is shared by every test: tests transform copies of its graph
    (``WhatIf.apply`` copies; ``graph.copy()`` elsewhere), never the cached one.
    """

    def __init__(self, shared_root: Path):
        self.shared_root = shared_root
        self._studies: dict[str, TraceStudy] = {}

    def path(self, name: str) -> Path:
        """The file of a trace; skips the calling test when the shared traces are absent."""
        if name == BUNDLED:
            return BUNDLED_TRACE
        if not self.shared_root.is_dir():
            pytest.skip(NO_SHARED)
        path = self.shared_root / name
        assert path.is_file(), f"{path} is listed in SOURCES.md but missing"
        return path

    def study(self, name: str) -> TraceStudy:
        if name not in self._studies:
            self._studies[name] = TraceStudy.from_trace(self.path(name))
        return self._studies[name]

    def trace(self, name: str) -> KinetoTrace:
        return self.study(name).trace
