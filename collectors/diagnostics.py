"""What the tool could not use, counted in one place: the warnings of a run.

Reading a trace, building its graph and applying what-ifs may meet input the tool cannot use as
it is: kernels with a negative duration, launches whose correlation id is duplicated, a
``--scale`` pattern that matches nothing. Each such class is reported once, with its count, as
``FILE: what was done (why)``: ``trace.json: dropped 79 kernels with negative duration``. Where
the answer would be wrong, the reader raises an error instead; a warning is for what it could
leave out and still answer.

:func:`warn` records a warning in the run's :class:`Diagnostics` (the one :func:`collecting`
made current, else a default one that hands each warning to Python's :mod:`warnings`). The
``whatif`` command makes one per run, prints each warning on stderr as it comes, and with
``--strict`` turns the first into an error (:class:`StrictError`) before any more work is done.
"""

from __future__ import annotations

import contextlib
import warnings as _warnings
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional


class InputWarning(UserWarning):
    """A warning about input the tool could not use (Python API callers see these)."""


class StrictError(Exception):
    """A warning made an error by ``--strict``: ``str`` is the warning's text."""


@dataclass
class Diagnostics:
    """The warnings of one run, each text once, in the order they came.

    ``strict``: the first warning raises :class:`StrictError`. ``sink``: called with each new
    warning's text as it is recorded (the command line prints it on stderr).
    """

    strict: bool = False
    sink: Optional[Callable[[str], None]] = None
    messages: list = field(default_factory=list)

    def warn(self, text: str) -> None:
        if text in self.messages:
            return
        self.messages.append(text)
        if self.strict:
            raise StrictError(f"{text}; --strict makes this an error")
        if self.sink is not None:
            self.sink(text)


class _PythonWarnings(Diagnostics):
    """Where no run collects: each warning goes to Python's ``warnings`` module."""

    def warn(self, text: str) -> None:
        _warnings.warn(text, InputWarning, stacklevel=3)


_CURRENT: ContextVar[Diagnostics] = ContextVar("whatif_diagnostics", default=_PythonWarnings())


def warn(where, count: int, what: str) -> None:
    """Record one warning of a class: ``where`` (a file, or an option) and ``what`` was done,
    its count in it (``warn(path, n, f"dropped {plural(n, 'kernel')} with negative duration")``).
    Nothing is recorded for a count of 0."""
    if count:
        report(f"{where}: {what}")


def report(text: str) -> None:
    """Record a warning already written as ``FILE: what`` (e.g. one a library raised)."""
    _CURRENT.get().warn(text)


def plural(count: int, one: str, many: Optional[str] = None) -> str:
    """``"1 kernel"``, ``"79 kernels"``."""
    return f"{count} {one if count == 1 else (many or one + 's')}"


@contextlib.contextmanager
def collecting(diagnostics: Diagnostics) -> Iterator[Diagnostics]:
    """Make ``diagnostics`` the one :func:`warn` records into while the block runs."""
    token = _CURRENT.set(diagnostics)
    try:
        yield diagnostics
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Record, besides passing on, every warning the block makes: the list it yields holds
    their texts once the block is done (the graph cache keeps them, to say them again)."""
    outer = _CURRENT.get()
    texts: list = []

    class _Recording(Diagnostics):
        def warn(self, text: str) -> None:
            if text not in texts:
                texts.append(text)
            outer.warn(text)

    with collecting(_Recording()):
        yield texts
