"""Executing a dependency graph in a SimPy simulation.

Each resource (CPU thread, GPU stream, link) is a SimPy process that runs its tasks one at a
time. A task starts when its resource is free and every predecessor has ended, plus the edge's
lag: ``start = max(resource free, release, max(end(pred) + lag))``.

Two engines compute that schedule:

* ``simulate`` (the default) lets a resource run straight through every task whose predecessors
  have already been computed, without yielding to SimPy; it only suspends when a predecessor on
  another resource is still unknown, and is woken when that one is computed. With a fixed task
  order per resource the end times depend only on the predecessors' end times, so computing
  them ahead of the simulation clock gives exactly the same answer with one SimPy event per
  cross-resource wait instead of one per task.
* ``simulate_event_per_task`` advances the SimPy clock through every task start and end, the
  textbook discrete-event model; it is the reference the fast engine is tested against.

A resource given a :class:`Policy` does not have a fixed order: whenever it is free it asks the
policy to choose among the tasks that are ready at that moment (Daydream's Schedule primitive).
Such a resource always runs on the SimPy clock, in both engines, because which tasks are ready
depends on the time; there a task is ready only once its predecessors have ended (a negative
lag cannot pull it before them).
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import time
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import numpy as np
import simpy

from whatif.collectors.gcpause import gc_paused

from .graph import GraphError, TaskGraph


class Policy:
    """Chooses which of the ready tasks a resource runs next.

    ``choose`` gets the ids of the ready tasks (in the resource's original order) and the
    current simulated time; subclasses look up whatever they rank by (a priority column, a
    layer index) in the graph they were built with.

    A policy may also run several ready tasks as one (``choose_batch``: Horovod fusing tensors
    into one all-reduce), price that batch (``batch_duration_us``), and start work only at
    certain instants (``start_at``: Horovod's background thread wakes once per cycle).
    """

    def choose(self, ready: list[int], now_us: float) -> int:
        return ready[0]

    def choose_batch(self, ready: list[int], now_us: float) -> list[int]:
        return [self.choose(ready, now_us)]

    def ranked(self, ready: list[int], now_us: float) -> list[int]:
        """The ready tasks in the order ``choose`` would pick them one after another."""
        left, out = list(ready), []
        while left:
            out.append(self.choose(left, now_us))
            left.remove(out[-1])
        return out

    def batch_duration_us(self, batch: list[int], durations_us: list[float]) -> float:
        return float(sum(durations_us))

    def start_at(self, now_us: float) -> float:
        return now_us

    def finished(self, batch: list[int], start_us: float, end_us: float) -> None:
        """Told when a batch has been scheduled, for policies that keep state (cycles)."""

    def execute(self, env: simpy.Environment, batch: list[int], now_us: float) -> Optional[simpy.Event]:
        """Run the batch as a SimPy process of its own (a collective on shared links) instead of
        for a fixed duration; the batch ends when the returned event fires. None: use
        ``batch_duration_us``."""
        return None


@dataclass
class Schedule:
    """When every task of a graph ran in the simulation."""

    graph: TaskGraph
    start_us: np.ndarray
    end_us: np.ndarray
    simpy_events: int
    wall_s: float

    @property
    def makespan_us(self) -> float:
        if not len(self.end_us):
            return 0.0
        return float(np.max(self.end_us) - np.min(self.start_us))

    @property
    def tasks_per_second(self) -> float:
        return len(self.start_us) / self.wall_s if self.wall_s > 0 else float("inf")


class Structure:
    """What a graph's simulation is built from besides its durations and releases: each
    resource's tasks in order, the resources' names and every task's predecessors, as plain
    Python lists, which the inner loops index fastest.

    They are the costly part to build, and graphs whose tasks and edges are the same from run to
    run (a grid's cluster configurations, which differ only in durations) can share them: a
    caller that knows it keeps one (:func:`compile_structure`) and passes it to
    :func:`simulate`; the last few built are kept too, found by a digest of the arrays they are
    built from. ``release``, where given, is every task's release time (us) as a list, read
    from the array ``release_of``, which the graphs simulated with this structure share
    (:meth:`with_release`)."""

    def __init__(self, sequences: list, resource_of_sequence: list, preds: list, release: Optional[list] = None,
                 release_of: Optional[np.ndarray] = None):
        self.sequences, self.resource_of_sequence, self.preds = sequences, resource_of_sequence, preds
        self.release, self.release_of = release, release_of

    def with_release(self, release_us: np.ndarray) -> "Structure":
        """This structure for graphs that share their release times, the array ``release_us``
        (a grid's cluster graph, whose configurations differ in durations alone): each
        simulation of a graph whose column is that array reads them from here instead of
        converting the column again."""
        release = np.asarray(release_us, dtype=np.float64).tolist()
        if len(release) != len(self.preds):
            raise ValueError(f"{len(release)} release times for a structure of {len(self.preds)} tasks")
        return Structure(self.sequences, self.resource_of_sequence, self.preds, release, release_us)

    def releases_of(self, column: np.ndarray) -> Optional[list]:
        """The release times as a list where ``column`` (a graph's) is the array they were read
        from (the same memory, the same length); else None."""
        if self.release is None or len(column) != len(self.release) or not np.may_share_memory(column, self.release_of):
            return None
        return self.release


@gc_paused()  # lists of a task's predecessors, no cycles: the collector would only walk them
def compile_structure(graph: TaskGraph) -> Structure:
    """``graph``'s :class:`Structure`: one of the last few built where its arrays match (a
    digest of them finds it), else built anew."""
    tasks = graph.tasks
    n = len(tasks)
    src, dst, lag = (graph.edges[c].to_numpy() for c in ("src", "dst", "lag_us"))
    if n > _COMPILED_MAX_TASKS:  # every worker replicated: not kept, for memory
        return Structure(*_sequences(graph), _predecessors(n, src, dst, lag))
    codes = tasks["resource"].cat.codes.to_numpy()
    labels = "\0".join(map(str, tasks["resource"].cat.categories))
    sequences, resource_of_sequence = _cached(_digest(codes, tasks["order_key"].to_numpy(), labels),
                                              lambda: _sequences(graph))
    preds = _cached(_digest(n, src, dst, lag), lambda: _predecessors(n, src, dst, lag))
    return Structure(sequences, resource_of_sequence, preds)


def _sequences(graph: TaskGraph) -> tuple[list, list]:
    """Each resource's task ids in its order, and the resource's name."""
    sequences = graph.resource_order()
    resource = graph.tasks["resource"]
    return sequences, [str(resource.iat[int(seq[0])]) for seq in sequences]


def _predecessors(n: int, src: np.ndarray, dst: np.ndarray, lag: np.ndarray) -> list:
    """For every task, its ``(predecessor, lag)`` pairs."""
    preds: list = [()] * n
    if len(dst):
        order = np.argsort(dst, kind="stable")
        dst = dst[order]
        pairs = list(zip(src[order].tolist(), lag[order].tolist()))
        firsts = np.flatnonzero(np.r_[True, dst[1:] != dst[:-1]])
        lasts = np.r_[firsts[1:], len(dst)]
        for t, a, b in zip(dst[firsts].tolist(), firsts.tolist(), lasts.tolist()):
            preds[t] = pairs[a:b]
    return preds


_COMPILED: "OrderedDict[bytes, object]" = OrderedDict()
_COMPILED_KEPT = 4
_COMPILED_MAX_TASKS = 1_000_000


def _digest(*parts) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        if isinstance(part, np.ndarray):
            part = np.ascontiguousarray(part)
            h.update(f"{part.dtype}{part.shape}".encode())
            h.update(part.data)
        else:
            h.update(repr(part).encode())
        h.update(b"|")
    return h.digest()


def _cached(key: bytes, build):
    """What ``build()`` returns, kept under ``key`` among the last few; never modified by the
    engine, so runs share it."""
    if key in _COMPILED:
        _COMPILED.move_to_end(key)
        return _COMPILED[key]
    value = _COMPILED[key] = build()
    while len(_COMPILED) > _COMPILED_KEPT:
        _COMPILED.popitem(last=False)
    return value


class _Waiters:
    """Who waits for a task to be computed: a SimPy event (resources of a fixed order) and the
    policy resources' tasks that wait on it (``(_Watch, task)``)."""

    __slots__ = ("event", "watches")

    def __init__(self):
        self.event: Optional[simpy.Event] = None
        self.watches: list = []

    def wake(self) -> None:
        if self.event is not None:
            self.event.succeed()
        for watch, t in self.watches:
            watch.dirty.append(t)
            if watch.poke is not None and not watch.poke.triggered:
                watch.poke.succeed()


class _Watch:
    """A policy resource's tasks whose predecessors were computed since it last looked
    (``dirty``), and the event that wakes it while it sleeps (``poke``)."""

    def __init__(self, dirty: list):
        self.dirty = dirty
        self.poke: Optional[simpy.Event] = None


class _Run:
    """One simulation: shared state of the resource processes."""

    def __init__(self, graph: TaskGraph, policies: Optional[dict], event_per_task: bool,
                 structure: Optional[Structure] = None):
        self.graph = graph
        self.c = structure if structure is not None else compile_structure(graph)
        tasks = graph.tasks
        n = len(tasks)
        self.duration = tasks["duration_us"].to_numpy(dtype=np.float64).tolist()
        column = tasks["release_us"].to_numpy(dtype=np.float64)
        shared = self.c.releases_of(column)
        self.release = shared if shared is not None else column.tolist()
        self.env = simpy.Environment()
        self.start: list = [None] * n
        self.end: list = [None] * n
        self.waiting: dict = {}  # task -> its _Waiters, until it is computed
        self.events = 0
        self.event_per_task = event_per_task
        policies = policies or {}
        unknown = set(policies) - set(self.c.resource_of_sequence)
        if unknown:
            raise GraphError(f"policy given for resources that have no tasks: {sorted(unknown)}")
        for seq, resource in zip(self.c.sequences, self.c.resource_of_sequence):
            ids = seq.tolist()
            if resource in policies:
                self.env.process(self._run_with_policy(ids, policies[resource]))
            elif event_per_task:
                self.env.process(self._run_event_per_task(ids))
            else:
                self.env.process(self._run_in_order(ids))

    def _done_event(self, task: int) -> simpy.Event:
        w = self._waiters(task)
        if w.event is None:
            w.event = self.env.event()
            self.events += 1
        return w.event

    def _waiters(self, task: int) -> "_Waiters":
        w = self.waiting.get(task)
        if w is None:
            w = self.waiting[task] = _Waiters()
        return w

    def _finish(self, task: int, start: float, end: float) -> None:
        self.start[task] = start
        self.end[task] = end
        w = self.waiting.pop(task, None)
        if w is not None:
            w.wake()

    def _run_in_order(self, ids: list):
        start, end, release, duration, preds = self.start, self.end, self.release, self.duration, self.c.preds
        waiting = self.waiting
        free = 0.0  # simulated time starts at the trace's first event
        for t in ids:
            ready = release[t]
            own = preds[t]
            if own:  # most tasks have none but the one before on their resource: no iterator made
                for d, lag in own:
                    e = end[d]
                    if e is None:
                        yield self._done_event(d)
                        e = end[d]
                    e += lag
                    if e > ready:
                        ready = e
            s = free if free > ready else ready
            free = s + duration[t]
            start[t] = s  # _finish, inlined: the innermost loop of the engine
            end[t] = free
            if t in waiting:  # a test, not a call, for the many tasks nobody waits on
                waiting.pop(t).wake()

    def _run_event_per_task(self, ids: list):
        env, end, release, duration, preds = self.env, self.end, self.release, self.duration, self.c.preds
        free = 0.0  # simulated time starts at the trace's first event
        for t in ids:
            ready = release[t]
            for d, lag in preds[t]:
                if end[d] is None:
                    yield self._done_event(d)
                e = end[d] + lag
                if e > ready:
                    ready = e
            s = free if free > ready else ready
            if s > env.now:
                self.events += 1
                yield env.timeout(s - env.now)
            free = s + duration[t]
            if free > env.now:
                self.events += 1
                yield env.timeout(free - env.now)
            self._finish(t, s, free)

    def _run_with_policy(self, ids: list, policy: Policy):
        """A resource whose policy picks among its ready tasks at each decision. A task is ready
        once every predecessor has ended by now on the SimPy clock (the fast engine may know a
        later end already; using it would let negative lags act early), that is from
        ``max(release, end(pred) + lag, end(pred))`` on, fixed once its predecessors are known.
        Each task is resolved once: while a predecessor is unknown it waits on that predecessor
        (``_finish`` hands it back), then on a heap of ready times; the decisions look at the
        ready tasks alone, not at every pending one."""
        env, end, release, duration, preds = self.env, self.end, self.release, self.duration, self.c.preds
        position = {t: i for i, t in enumerate(ids)}
        watch = _Watch(list(ids))
        blocked: dict = {}  # task -> index of its first predecessor not computed yet
        later: list = []  # heap of (ready time, position) of the resolved tasks not ready yet
        ready: list = []  # positions of the ready tasks, in the resource's order
        left = len(ids)
        free = 0.0  # simulated time starts at the trace's first event
        while left:
            now = max(free, env.now)
            if now > env.now:
                self.events += 1
                yield env.timeout(now - env.now)
            self.events += 1
            yield env.timeout(0)  # let every task that ends at this instant be computed first
            dirty, watch.dirty = watch.dirty, []
            for t in dirty:
                k = blocked.pop(t, 0)
                own = preds[t]
                r, last = release[t], -np.inf
                while k < len(own):
                    d, lag = own[k]
                    e = end[d]
                    if e is None:
                        break
                    if e > last:
                        last = e
                    if e + lag > r:
                        r = e + lag
                    k += 1
                if k < len(own):
                    blocked[t] = k
                    self._waiters(own[k][0]).watches.append((watch, t))
                else:
                    heapq.heappush(later, (r if r > last else last, position[t]))
            while later and later[0][0] <= now:
                bisect.insort(ready, heapq.heappop(later)[1])
            if not ready:
                wake = []
                if blocked:
                    watch.poke = env.event()
                    wake.append(watch.poke)
                if later:
                    self.events += 1
                    wake.append(env.timeout(later[0][0] - env.now))
                if not wake:
                    return  # blocked for good: reported as unscheduled tasks
                self.events += 1
                yield env.any_of(wake)
                watch.poke = None
                continue
            start_at = policy.start_at(now)
            if start_at > now:
                free = start_at  # wait for the policy's next opportunity, then look again
                continue
            batch = policy.choose_batch([ids[p] for p in ready], now)
            running = policy.execute(env, batch, now)
            if running is not None:
                self.events += 1
                yield running
                free = env.now
            else:
                free = now + policy.batch_duration_us(batch, [duration[t] for t in batch])
            policy.finished(batch, now, free)
            if self.event_per_task and free > env.now:
                self.events += 1
                yield env.timeout(free - env.now)
            for t in batch:
                del ready[bisect.bisect_left(ready, position[t])]
                left -= 1
                self._finish(t, now, free)

    def run(self) -> Schedule:
        t0 = time.perf_counter()
        self.env.run()
        wall = time.perf_counter() - t0
        start, end = (np.fromiter(times, dtype=np.float64, count=len(times)) for times in (self.start, self.end))
        # a task never computed is None, which becomes NaN; a NaN computed (a NaN duration) is not stuck
        stuck = [i for i, e in enumerate(self.end) if e is None] if np.isnan(end).any() else []
        if stuck:
            names = self.graph.tasks["name"].iloc[stuck[:3]].astype(str).tolist()
            raise GraphError(
                f"the graph cannot be scheduled: {len(stuck)} tasks wait on each other in a cycle "
                f"(for example {names})"
            )
        return Schedule(
            graph=self.graph,
            start_us=start,
            end_us=end,
            simpy_events=self.events,
            wall_s=wall,
        )


def simulate(graph: TaskGraph, policies: Optional[dict] = None, structure: Optional[Structure] = None) -> Schedule:
    """Schedule ``graph``; ``policies`` maps resource names to :class:`Policy` objects;
    ``structure``, where given, is ``graph``'s (:func:`compile_structure`, of this graph or of
    one with the same tasks, resources, orders and edges, and the same release times where it
    carries them: :meth:`Structure.with_release`)."""
    # the collector's walks of the run's lists cost half of it (a tenth with a policy's SimPy
    # events, whose cycles wait for the collector until the run is over); with every worker
    # replicated and a policy, it collects as it goes, for memory
    collecting = policies and len(graph.tasks) > _COMPILED_MAX_TASKS
    with nullcontext() if collecting else gc_paused():
        return _Run(graph, policies, event_per_task=False, structure=structure).run()


def simulate_event_per_task(graph: TaskGraph, policies: Optional[dict] = None) -> Schedule:
    """The reference engine: one SimPy event for every task start and end."""
    return _Run(graph, policies, event_per_task=True).run()
