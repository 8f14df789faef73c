"""The machine at hand, as whatif's records name it: its CPU's model name.

A capture bundle's environment (:mod:`whatif.collectors.capture`), a leveled profile's run
records (:mod:`whatif.collectors.xsp`) and an operator models file
(:mod:`whatif.sim.perfmodels.device`) name the device they were measured on; this module reads
it, once for all of them. It imports nothing but the standard library, so the simulator can use
it without the capture API.
"""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (``model name`` in ``/proc/cpuinfo``), else what :mod:`platform` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
