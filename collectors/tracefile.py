"""A trace file's bytes: read, and decompressed where it is gzipped, within limits that refuse a
gzip bomb; and, for a command whose trace is known before its modules are imported, read ahead.

This module imports nothing beyond Python's own, so that ``whatif.cli`` can start reading the
trace of ``whatif replay`` on a thread (:func:`read_ahead`) while the command's modules import
(numpy, pandas: half a second). Reading and inflating let go of the interpreter's lock, so on
a machine with a core to spare the file is ready, or nearly, when ``collectors/kineto.py`` asks
for it (:func:`read_bytes`).
"""

from __future__ import annotations

import os
import threading
import zlib
from pathlib import Path
from typing import Union


class TraceError(Exception):
    """A trace file that cannot be used; the message names the file and the problem."""

    def __init__(self, path: Union[str, Path], problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


def _read_now(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise TraceError(path, "no such file") from None
    except IsADirectoryError:
        raise TraceError(path, "is a folder, neither a trace file nor a trace bundle (no bundle.json)") from None
    except OSError as err:
        raise TraceError(path, f"cannot be read ({err.strerror})") from None
    if raw[:2] == b"\x1f\x8b":
        raw = _gunzip(path, raw)
    return raw


#: The most a gzipped trace may expand to, in MB, and how many times its compressed size; the
#: environment variables of the same names raise them. Real traces expand 8 to 30-fold (the
#: shared ones: 0.1 to 54 MB); a gzip bomb expands a thousandfold.
MAX_TRACE_MB = 4096
MAX_GZIP_RATIO = 200
_GZIP_RATIO_FROM_MB = 64  # the ratio is not held against a trace that expands to less than this


def _limit(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise TraceError(f"${name}", f"{os.environ[name]!r} is not a number") from None


def _gunzip(path: Path, raw: bytes) -> bytes:
    """The gzip data decompressed (every member), refusing beyond :data:`MAX_TRACE_MB` or
    :data:`MAX_GZIP_RATIO` times its size before it has taken the memory."""
    max_mb = _limit("WHATIF_MAX_TRACE_MB", MAX_TRACE_MB)
    max_ratio = _limit("WHATIF_MAX_GZIP_RATIO", MAX_GZIP_RATIO)
    limit = int(min(max_mb * 1e6, max(len(raw) * max_ratio, _GZIP_RATIO_FROM_MB * 1e6)))
    out, data = [], raw
    size = 0
    try:
        while data:
            unzip = zlib.decompressobj(wbits=31)
            while data:
                chunk = unzip.decompress(data, limit + 1 - size)
                size += len(chunk)
                out.append(chunk)
                if size > limit:
                    why = (f"more than {max_ratio:g} times its {len(raw) / 1e6:.1f} MB (WHATIF_MAX_GZIP_RATIO"
                           if limit < max_mb * 1e6 else f"more than {max_mb:g} MB (WHATIF_MAX_TRACE_MB")
                    raise TraceError(path, f"gzip data expands to {why} raises the limit); refusing to read it")
                data = unzip.unconsumed_tail
                if unzip.eof:
                    break
            if not unzip.eof:
                raise EOFError
            data = unzip.unused_data.lstrip(b"\0")  # gzip.decompress allows zeros after a member
            if data and data[:2] != b"\x1f\x8b":
                raise zlib.error
    except (EOFError, zlib.error):
        raise TraceError(path, "truncated or corrupt gzip data") from None
    return b"".join(out)


_ahead: dict = {}  # path (as str(Path(p))) -> (the thread reading it, [its bytes or its error])


def read_ahead(path: Union[str, Path]) -> None:
    """Start reading (and decompressing) the trace file ``path`` on a thread, for the next
    :func:`read_bytes` of the same path to take; a problem it meets is raised there."""
    key = str(Path(path))
    if key in _ahead:
        return
    result: list = []

    def read() -> None:
        try:
            result.append(_read_now(Path(key)))
        except BaseException as err:  # handed to the reader, raised there
            result.append(err)

    thread = threading.Thread(target=read, name="whatif-read-ahead", daemon=True)
    _ahead[key] = (thread, result)
    thread.start()


def read_bytes(path: Path) -> bytes:
    """The bytes of the trace file ``path``, decompressed where it is gzipped: those
    :func:`read_ahead` read, once, where it was asked to; else read now. Raises
    :class:`TraceError` with a one-line reason for a file that cannot be read."""
    ahead = _ahead.pop(str(Path(path)), None)
    if ahead is None:
        return _read_now(path)
    thread, result = ahead
    thread.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def discard_read_ahead(path: Union[str, Path]) -> None:
    """Let go of the bytes read ahead of ``path`` where nothing will take them (its graph came
    from the cache), once the thread has ended (it has, or nearly, by the time the cache is
    asked): no thread is left running when a sweep forks its processes."""
    ahead = _ahead.pop(str(Path(path)), None)
    if ahead is not None:
        ahead[0].join()
