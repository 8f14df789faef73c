"""Where whatif keeps what it caches, and which trace files the graph cache holds a graph of,
told without importing anything beyond Python's own.

``whatif.cli`` starts reading a command's trace on a thread while the command's modules import
(``collectors/tracefile.py``). Where the graph cache (``whatif/graph_cache.py``) holds the
trace's graph, those bytes are thrown away unread, and inflating them (35 MB from the 1.2 MB
ResNet-50 trace: 50 ms of a core, and the lock the imports need while the bytes are joined)
slows the command it was meant to speed up. So the cache leaves a mark beside its entries for
each trace file it keeps or serves (:func:`mark_held`), named by the file's device, inode, size
and modification and change times, and the command line reads ahead only a trace without one
(:func:`is_held`). A mark is a hint: a graph cached by other code (after an upgrade) is made
again from a trace that was not read ahead, which is the only cost of a wrong one.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Optional, Union

MARK_PREFIX = "held-"
MARK_SUFFIX = ".mark"


def cache_dir() -> Path:
    """Where whatif caches: $WHATIF_CACHE_DIR, else $XDG_CACHE_HOME/whatif or ~/.cache/whatif (the
    fitted operator models here, the graphs of ``whatif/graph_cache.py`` in ``graphs``)."""
    if os.environ.get("WHATIF_CACHE_DIR"):
        return Path(os.environ["WHATIF_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "whatif"


def graph_folder() -> Path:
    """Where the graph cache keeps its entries."""
    return cache_dir() / "graphs"


def graph_cache_enabled() -> bool:
    """Whether the graph cache is on (``WHATIF_GRAPH_CACHE=0`` turns it off)."""
    return os.environ.get("WHATIF_GRAPH_CACHE", "1").strip().lower() not in ("0", "no", "off", "false")


def _mark(path: Union[str, Path]) -> Optional[Path]:
    """The mark of the trace file ``path`` as it is now; None for what is not a file."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    name = f"{MARK_PREFIX}{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}-{st.st_ctime_ns}{MARK_SUFFIX}"
    return graph_folder() / name


def mark_held(path: Union[str, Path]) -> None:
    """Leave (or renew) the mark that the graph cache holds a graph of the file ``path``; nothing
    where it cannot be written."""
    mark = _mark(path)
    if mark is None:
        return
    try:
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.touch()
    except OSError:
        pass


def is_held(path: Union[str, Path]) -> bool:
    """Whether the graph cache is on and marked a graph of the file ``path``, as it is now."""
    if not graph_cache_enabled():
        return False
    mark = _mark(path)
    return mark is not None and mark.exists()
