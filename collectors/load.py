"""One way in for a trace: a Kineto trace file, or a capture bundle folder with its trace.

``kineto.py`` reads trace files and knows nothing of bundles; ``bundle.py`` reads a bundle's
manifest and tables and its trace through ``kineto.py``. :func:`load_trace` picks between them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

from .bundle import is_bundle, read_bundled_trace
from .kineto import KinetoTrace, read_kineto


def load_trace(path: Union[str, Path]) -> KinetoTrace:
    """Read a Kineto trace (plain or gzipped JSON), or a capture bundle folder
    (:mod:`whatif.collectors.bundle`): its trace as a :class:`~.bundle.BundledTrace`, with the
    bundle as ``bundle``.

    Raises :class:`~.kineto.TraceError` with a one-line reason for anything that is not a
    usable trace or bundle.
    """
    path = Path(path)
    if path.is_dir() and is_bundle(path):
        return read_bundled_trace(path)
    return read_kineto(path)
