"""A grid's configurations run one after the other, on this machine's cores, or on a Dask or Ray cluster.

``whatif predict`` simulates each configuration of a scenario's grid from the same inputs (the
worker graph, its gradients and iterations, made once before), and no configuration depends on
another, so they can run anywhere and in any order. :func:`run_sweep` maps a function over them
and returns the results in the grid's order whichever way they ran: a prediction is the same
wherever it was made (``tests/test_sweep.py`` holds each way equal to the serial one).

* ``Sweep()`` (``jobs=1``): in this process, one after the other, as the library always did.
* ``Sweep(jobs=N)``: N processes of this machine (at most one per configuration). They are
  forked where the platform can, so the shared inputs are inherited instead of copied (with
  the collector's objects frozen first: its passes in a child would write to every inherited
  page, and so copy it); a result is pickled back (``whatif predict`` without ``--timeline``
  asks for the rows alone; a cluster's schedule, where kept, is 2 to 10 MB on the ResNet-50 trace).
* ``Sweep(executor="dask", address=...)``: the workers of an existing Dask cluster
  (``distributed``, the ``whatif[dask]`` extra), which must have the same ``whatif``
  installed. The shared inputs are sent to each worker once (``Client.scatter``).
* ``Sweep(executor="ray", address=...)``: the workers of an existing Ray cluster (the
  ``whatif[ray]`` extra; ``HOST:6379``, ``ray://HOST:10001`` or ``auto``), one CPU a
  configuration, with the same ``whatif`` installed. The shared inputs go to the object store
  once (``ray.put``); a connection the sweep opened is closed after it. A configuration's error
  comes back as itself, not as Ray's wrapping with the worker's traceback; the others are left
  to end with the sweep's Ray job rather than cancelled (see :func:`_on_ray`).

Run elsewhere than in this process, a configuration's warnings (``collectors/diagnostics.py``)
are collected where it ran and recorded here once all have run, in the grid's order
(``--strict`` then fails after the sweep rather than at the first warning, with the same
message). A progress bar (tqdm) counts the configurations on stderr when ``progress`` is set
(the command sets it when stderr is a terminal); it appears only once the sweep has run about
two seconds, and is cleared at the end.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import socket
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from whatif.collectors.diagnostics import Diagnostics, collecting, report

EXECUTORS = ("local", "dask", "ray")
#: A sweep shorter than this shows no progress bar (tqdm's ``delay``)
PROGRESS_DELAY_S = 2.0


class SweepError(Exception):
    """A sweep that cannot run as asked (no Dask or Ray installed, no cluster to reach)."""


@dataclass(frozen=True)
class Sweep:
    """How to run a grid: ``jobs`` processes of this machine (``executor="local"``), or the
    workers of the Dask or Ray cluster at ``address`` (``executor="dask"`` or ``"ray"``);
    ``progress``: a bar on stderr."""

    jobs: int = 1
    executor: str = "local"
    address: Optional[str] = None
    progress: bool = False

    def __post_init__(self):
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor {self.executor!r}: not one of {', '.join(EXECUTORS)}")
        if self.jobs < 1:
            raise ValueError(f"jobs {self.jobs}: at least 1")


def available_cores() -> int:
    """The cores this process may run on (its affinity, where the platform tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def runs_elsewhere(sweep: Sweep, items: int) -> bool:
    """Whether :func:`run_sweep` runs ``items`` items in other processes or on a cluster's workers."""
    return sweep.executor != "local" or min(sweep.jobs, items) > 1


def run_sweep(function: Callable[[Any, Any], Any], shared: Any, items: Sequence, sweep: Sweep = Sweep(),
              what: str = "configuration", pack: Optional[Callable[[Any, Any], Any]] = None,
              unpack: Optional[Callable[[Any, Any], Any]] = None) -> list:
    """``[function(shared, item) for item in items]``, run as ``sweep`` says. ``function`` is a
    module-level function (the processes find it by name); ``shared`` goes to each process or
    worker once. ``what`` names an item on the progress bar. A result made elsewhere is sent
    back as ``pack(shared, result)`` and is ``unpack(shared, sent)`` here (module-level
    functions too), where given: what ``shared`` holds on both sides need not travel."""
    items = list(items)

    def progress_bar():  # made once the processes are started: none is forked with tqdm's thread
        return _progress_bar(len(items), what, sweep.progress)

    if sweep.executor == "dask":
        outcomes = _on_dask(function, shared, items, sweep.address, progress_bar, pack)
    elif sweep.executor == "ray":
        outcomes = _on_ray(function, shared, items, sweep.address, progress_bar, pack)
    elif runs_elsewhere(sweep, len(items)):
        outcomes = _on_processes(function, shared, items, min(sweep.jobs, len(items)), progress_bar, pack)
    else:
        outcomes = []
        with progress_bar() as bar:
            for item in items:  # warnings recorded as they come, strict ones raised at once
                outcomes.append((function(shared, item), []))
                bar.update()
        unpack = None
    results = []
    for result, warnings in outcomes:
        for text in warnings:
            report(text)
        results.append(unpack(shared, result) if unpack is not None else result)
    return results


def _collected(function, shared, item) -> tuple[Any, list]:
    """``function(shared, item)`` and the warnings it recorded."""
    diagnostics = Diagnostics()
    with collecting(diagnostics):
        return function(shared, item), diagnostics.messages


def _sent_back(function, shared, item, pack=None) -> tuple[Any, list]:
    """:func:`_collected` where it runs in another process or on a cluster's worker, its result as
    ``pack`` makes it: an error it raises is one that survives the trip back."""
    try:
        result, warnings = _collected(function, shared, item)
        return (pack(shared, result) if pack is not None else result), warnings
    except Exception as err:
        raise _picklable(err) from None


# -- this machine's processes ------------------------------------------------------------------

_SHARED: dict = {}  # in a worker process: the function and its shared inputs


def _install(function, shared, pack) -> None:
    _SHARED.update(function=function, shared=shared, pack=pack)


def _in_worker(item) -> tuple[Any, list]:
    return _sent_back(_SHARED["function"], _SHARED["shared"], item, _SHARED["pack"])


def _on_processes(function, shared, items: list, jobs: int, progress_bar, pack=None) -> list:
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    frozen = method == "fork" and gc.isenabled()
    if frozen:  # the collector's passes in the children would write to, and so copy, every inherited page
        gc.freeze()
    try:
        return _on_pool(function, shared, items, jobs, progress_bar, pack, method)
    finally:
        if frozen:
            gc.unfreeze()


def _on_pool(function, shared, items: list, jobs: int, progress_bar, pack, method: str) -> list:
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context(method),
                             initializer=_install, initargs=(function, shared, pack)) as pool:
        futures = [pool.submit(_in_worker, item) for item in items]
        try:
            with progress_bar() as bar:
                for future in as_completed(futures):
                    future.result()  # the first failure is raised at once
                    bar.update()
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        return [future.result() for future in futures]


def _picklable(err: Exception) -> Exception:
    """``err`` where it survives being sent back to the caller, else a ``SweepError`` with its
    text (an exception whose constructor takes other arguments than its message cannot)."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return SweepError(f"{type(err).__name__}: {err}")


# -- a Dask or Ray cluster ---------------------------------------------------------------------

def _address(given: Optional[str], variable: str, needs: str, forms: str) -> str:
    """The cluster's address: ``given``, else the environment's ``variable``; a one-sentence
    error saying both where there is neither."""
    address = given or os.environ.get(variable)
    if not address:
        raise SweepError(f"{needs}: --address {forms} or {variable}")
    return address


def _on_dask(function, shared, items: list, address: Optional[str], progress_bar, pack=None) -> list:
    try:
        from distributed import Client
        from distributed import as_completed as dask_completed
    except ImportError:
        raise SweepError("--executor dask needs Dask's distributed scheduler: pip install 'whatif[dask]'") from None
    address = _address(address, "DASK_SCHEDULER_ADDRESS", "--executor dask needs the scheduler's address",
                       "tcp://HOST:8786")
    try:
        client = Client(address, timeout="10s", set_as_default=False)
    except OSError as err:
        raise SweepError(f"Dask scheduler {address}: cannot connect ({err})") from None
    with client:
        on_workers = client.scatter(shared, broadcast=True, hash=False)
        futures = [client.submit(_sent_back, function, on_workers, item, pack, pure=False) for item in items]
        try:
            with progress_bar() as bar:
                for future in dask_completed(futures, loop=client.loop):
                    future.result()
                    bar.update()
        except BaseException:
            client.cancel(futures)
            raise
        return client.gather(futures)


def _on_ray(function, shared, items: list, address: Optional[str], progress_bar, pack=None) -> list:
    try:
        import ray
    except ImportError:
        raise SweepError("--executor ray needs Ray: pip install 'whatif[ray]'") from None
    address = _address(address, "RAY_ADDRESS", "--executor ray needs the cluster's address",
                       "HOST:6379, ray://HOST:10001 or auto,")
    connected_here = not ray.is_initialized()
    if connected_here:
        _reachable(address)
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as err:
            raise SweepError(f"Ray cluster {address}: cannot connect ({str(err).splitlines()[0]})") from None
    try:
        remote = ray.remote(_sent_back).options(num_cpus=1, max_retries=0)
        on_workers = ray.put(shared)  # sent to each node once, read by its workers from shared memory
        refs = [remote.remote(function, on_workers, item, pack) for item in items]
        try:
            with progress_bar() as bar:
                pending = list(refs)
                while pending:
                    done, pending = ray.wait(pending, num_returns=1)
                    ray.get(done)  # the first failure is raised at once
                    bar.update()
            return ray.get(refs)
        except BaseException as err:
            # the configurations still running are not cancelled: Ray 2.60's ray.cancel races a
            # task's reply and can abort this process ("Tried to complete task that was not
            # pending", ray-project/ray#54846). Where the sweep connected, ray.shutdown() below
            # ends its job, and the cluster stops the job's workers; on a connection the caller
            # opened, they run to their end and their results are dropped with ``refs``.
            if not isinstance(err, ray.exceptions.RayTaskError):
                raise
            cause = getattr(err, "cause", None)  # the error itself, without the worker's traceback
            raise (cause if isinstance(cause, Exception) else SweepError(str(err).splitlines()[0])) from None
    finally:
        if connected_here:
            ray.shutdown()


def _reachable(address: str, timeout_s: float = 10.0) -> None:
    """A one-sentence error where a Ray address's host does not answer on its port within
    ``timeout_s``: Ray itself retries an unreachable cluster for minutes. ``auto`` (the cluster
    this machine runs) is left to Ray, which says at once where there is none."""
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    if colon and not host:
        raise SweepError(f"Ray cluster {address}: no host before the port")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise SweepError(f"Ray cluster {address}: cannot connect ({err})") from None


# -- progress ----------------------------------------------------------------------------------

class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def _progress_bar(total: int, what: str, shown: bool):
    if not shown:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit=f" {what}", desc="predicting", file=sys.stderr, delay=PROGRESS_DELAY_S,
                leave=False, dynamic_ncols=True)
