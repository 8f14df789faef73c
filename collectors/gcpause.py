"""Python's cyclic garbage collector, paused while a trace is read, its graph built and simulated.

Reading a 200k-event trace makes millions of objects that live on (the decoded events, the
tuples and lists of the columns being built), and every few hundred allocations the collector
walks the young ones, and now and then every one: a third of the reading's time on the largest
shared trace. None of this work makes reference cycles, so nothing is left for the collector to
free; it runs again, as before, once the work is done.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def gc_paused():
    """The collector off for the ``with`` block (or the decorated function), then on again if
    it was on before; nested uses leave it to the outermost."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
