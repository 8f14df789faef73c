"""The dependency graph of one training process, and Daydream's transformation primitives on it.

A task is a span of time on one resource: a CPU thread or a GPU stream. Tasks on a resource run
one at a time in their ``order_key`` order. An edge ``src -> dst`` with lag ``L`` says that
``dst`` cannot start before ``end(src) + L``; lags carry the latencies the trace shows between
causally linked tasks (a kernel starting some microseconds after its launch call returned, a
CPU thread resuming after a GPU synchronisation). A task with no edges still waits for the task
before it on its resource; the first task of a resource is released at ``release_us``.

The primitives follow Daydream (Zhu et al., ATC'20): select tasks, scale their durations, insert
a task between two others, remove tasks while keeping the graph connected, and let a pluggable
policy choose among ready tasks (see ``sim.engine``).
"""

from __future__ import annotations

import bisect
import enum
import re
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import numpy as np
import pandas as pd

from .workload import Workload, empty_operators


class TaskKind(enum.IntEnum):
    CPU = 0  # self time of an operator, annotation or Python frame
    RUNTIME = 1  # a CUDA runtime / driver call
    GAP = 2  # CPU time on a thread that no event names
    WAIT = 3  # a thread idle until another thread signals it
    KERNEL = 4
    MEMCPY = 5
    MEMSET = 6
    COMM = 7  # a communication kernel (NCCL) or a simulated transfer
    INSERTED = 8


GPU_TASK_KINDS = (TaskKind.KERNEL, TaskKind.MEMCPY, TaskKind.MEMSET, TaskKind.COMM)
# the time a CPU thread spends: operators, the gaps between them, runtime calls
CPU_WORK_KINDS = (int(TaskKind.CPU), int(TaskKind.GAP), int(TaskKind.RUNTIME))


class EdgeKind(enum.IntEnum):
    LAUNCH = 0  # CPU launch call -> GPU task (correlation id)
    GPU_SEQ = 1  # consecutive tasks on a GPU stream
    SYNC = 2  # GPU task -> CPU call that waited for it
    STREAM_WAIT = 3  # cudaEventRecord on one stream -> cudaStreamWaitEvent on another
    THREAD = 4  # CPU thread -> CPU thread it woke up
    USER = 5  # added by a transformation
    BYPASS = 6  # replaces a removed task
    QUEUE = 7  # GPU task -> launch call that waited for a free slot in the full launch queue


class GraphError(Exception):
    """A graph that cannot be built, transformed or scheduled as asked."""


def names_matching(column: pd.Series, test: Callable[[str], object]) -> np.ndarray:
    """Per row of a column of names, whether ``test`` (a compiled pattern's ``search`` or
    ``match``) accepts it; a categorical column's names are each tested once, and a missing
    name is no match."""
    if hasattr(column, "cat"):
        hit = np.array([bool(test(str(c))) for c in column.cat.categories] + [False])
        return hit[column.cat.codes.to_numpy()]  # code -1 (missing) maps to False
    return np.array([bool(test(str(v))) for v in column.tolist()], dtype=bool)


@dataclass
class TaskGraph:
    """Tasks and edges as two pandas frames of numbers (names are categoricals).

    ``tasks`` columns: name, kind, resource, duration_us, release_us, order_key,
    measured_start_us, measured_end_us, context (the enclosing operators and annotations,
    outermost first, joined by `` > ``), operator (outermost operator), layer (innermost module
    or user annotation), event (the row of the trace event the task belongs to, -1 for gaps and
    inserted tasks; for a CPU task, its row in ``ops``). ``edges`` columns: src, dst, lag_us, kind.

    ``ops`` (the traced operators: shapes, arguments, message sizes) and ``workload`` (the job's
    record: parameters, gradient-ready times, environment) are what passes read instead of the
    trace (``sim/workload.py``); no pass changes them, so copies share them. ``notes`` are the
    records of the passes applied, in order (each has a ``describe()``).
    """

    tasks: pd.DataFrame
    edges: pd.DataFrame
    ops: pd.DataFrame = field(default_factory=empty_operators)
    workload: Workload = field(default_factory=Workload)
    notes: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tasks)

    def copy(self) -> "TaskGraph":
        return TaskGraph(self.tasks.copy(), self.edges.copy(), self.ops, self.workload, list(self.notes))

    def last_note(self, kind: type):
        """The record of the last pass of type ``kind`` applied to the graph (None: none was)."""
        return next((note for note in reversed(self.notes) if isinstance(note, kind)), None)

    # -- selection -----------------------------------------------------------------------------

    def select(
        self,
        pattern: Optional[str] = None,
        kinds: Optional[Sequence[TaskKind]] = None,
        where: Optional[Callable[[pd.DataFrame], Union[pd.Series, np.ndarray]]] = None,
    ) -> np.ndarray:
        """Indices of the tasks that match all given conditions.

        ``pattern`` is a regular expression searched in a task's name and in the names of the
        operators and annotations that enclose it (its context); ``where`` is a vectorised
        predicate on the task table.
        """
        mask = np.ones(len(self.tasks), dtype=bool)
        if pattern is not None:
            mask &= self.match(pattern)
        if kinds is not None:
            mask &= self.tasks["kind"].isin([int(k) for k in kinds]).to_numpy()
        if where is not None:
            mask &= np.asarray(where(self.tasks), dtype=bool)
        return np.flatnonzero(mask)

    def match(self, pattern: str) -> np.ndarray:
        try:
            regex = re.compile(pattern)
        except re.error as err:
            raise GraphError(f"pattern {pattern!r} is not a valid regular expression ({err})") from None
        return names_matching(self.tasks["name"], regex.search) | names_matching(self.tasks["context"], regex.search)

    def launch_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """Each launch edge's CPU call and the GPU task it launched (two arrays of task ids, in
        the edge table's order)."""
        launch = self.edges["kind"].to_numpy() == int(EdgeKind.LAUNCH)
        return self.edges["src"].to_numpy()[launch], self.edges["dst"].to_numpy()[launch]

    # -- transformation primitives -------------------------------------------------------------

    def scale(self, task_ids: np.ndarray, factor) -> None:
        """Multiply the durations of ``task_ids`` by ``factor`` (0.5 = twice as fast), one for
        all of them or one per task."""
        factors = np.asarray(factor, dtype=float)
        if not (np.isfinite(factors).all() and (factors >= 0).all()):
            raise GraphError(f"scale factor must be a non-negative number, got {factor}")
        col = self.tasks.columns.get_loc("duration_us")
        self.tasks.iloc[np.asarray(task_ids, dtype=np.int64), col] *= factors

    def lengthen(self, extra_us: np.ndarray) -> None:
        """Add ``extra_us`` (one non-negative duration per task) to the tasks' durations: the
        host time a library adds where the trace's tasks run it."""
        extra = np.asarray(extra_us, dtype=float)
        if extra.shape != (len(self.tasks),) or not (np.isfinite(extra).all() and (extra >= 0).all()):
            raise GraphError(f"lengthen: expected {len(self.tasks)} durations >= 0, got shape {extra.shape}")
        col = self.tasks.columns.get_loc("duration_us")
        self.tasks.iloc[:, col] = self.tasks["duration_us"].to_numpy(dtype=float) + extra

    def insert(
        self,
        after: int,
        before: Optional[int],
        name: str,
        duration_us: float,
        resource: Optional[str] = None,
        kind: TaskKind = TaskKind.INSERTED,
    ) -> int:
        """Insert a new task that starts after task ``after`` ends and that ``before`` waits for.

        The new task runs on ``resource`` (default: the resource of ``after``), placed in that
        resource's order just behind ``after`` when they share it. Returns the new task's id.
        """
        row = self.inserted_row(after, name, duration_us, resource, kind)
        new_id = len(self.tasks)
        self.tasks = concat_tasks([self.tasks, pd.DataFrame([row], index=[new_id])])
        new_edges = [(after, new_id, 0.0, int(EdgeKind.USER))]
        if before is not None:
            new_edges.append((new_id, int(before), 0.0, int(EdgeKind.USER)))
        self.add_edges(new_edges)
        return new_id

    def inserted_row(self, after: int, name: str, duration_us: float, resource: Optional[str] = None,
                     kind: TaskKind = TaskKind.INSERTED) -> dict:
        """The task-table row :meth:`insert` adds, its order key placing it just behind
        ``after``, without adding it: for a caller that adds it with other rows in one go (the
        table is rebuilt once), as the next task id, and its edge from ``after`` itself."""
        if duration_us < 0 or not np.isfinite(duration_us):
            raise GraphError(f"inserted task {name!r} needs a non-negative duration, got {duration_us}")
        t = self.tasks
        resource = resource if resource is not None else str(t["resource"].iat[after])
        on_resource = t["resource"] == resource
        if str(t["resource"].iat[after]) == resource:
            later = t.loc[on_resource & (t["order_key"] > t["order_key"].iat[after]), "order_key"]
            nxt = later.min() if len(later) else t["order_key"].iat[after] + 1.0
            key = (t["order_key"].iat[after] + nxt) / 2.0
        else:
            key = float(t.loc[on_resource, "order_key"].max()) + 1.0 if on_resource.any() else 0.0
        return _inserted_row(name, kind, resource, duration_us, key,
                             t["context"].iat[after], t["operator"].iat[after], t["layer"].iat[after])

    def insert_many(self, inserts: Sequence[tuple], edges: Sequence[Sequence[tuple]] = ()) -> list[int]:
        """``insert(after, None, name, duration_us, kind=kind)`` for each ``(after, name,
        duration_us, kind)`` of ``inserts`` in turn (``after`` may be a task inserted before it
        in the list), each followed by its ``edges`` (of the same index, if any), with the same
        tasks, keys and edges, in the same order, as those calls make: the table rebuilt once
        instead of once per task. Returns the new tasks' ids."""
        t = self.tasks
        resource = t["resource"]
        keys = t["order_key"].to_numpy(dtype=float)
        context, operator, layer = t["context"].to_numpy(), t["operator"].to_numpy(), t["layer"].to_numpy()
        on: dict = {}  # resource -> the sorted order keys of its tasks, the new ones among them
        rows, new_edges, ids = [], [], []
        base = len(t)

        for i, (after, name, duration_us, kind) in enumerate(inserts):
            if duration_us < 0 or not np.isfinite(duration_us):
                raise GraphError(f"inserted task {name!r} needs a non-negative duration, got {duration_us}")
            where = str(resource.iat[after]) if after < base else rows[after - base]["resource"]
            if where not in on:
                on[where] = sorted(keys[label_mask(resource, where.__eq__)].tolist())
            key_after = keys[after] if after < base else rows[after - base]["order_key"]
            listed = on[where]
            j = bisect.bisect_right(listed, key_after)
            nxt = listed[j] if j < len(listed) else key_after + 1.0
            key = (key_after + nxt) / 2.0
            bisect.insort(listed, key)
            new_id = base + i
            of_after = (context[after], operator[after], layer[after]) if after < base else \
                (rows[after - base]["context"], rows[after - base]["operator"], rows[after - base]["layer"])
            rows.append(_inserted_row(name, kind, where, duration_us, key, *of_after))
            new_edges.append((after, new_id, 0.0, int(EdgeKind.USER)))
            new_edges += list(edges[i]) if i < len(edges) else []
            ids.append(new_id)
        if rows:
            self.tasks = concat_tasks([t, pd.DataFrame(rows, index=ids)])
            self.add_edges(new_edges)
        return ids

    def add_edges(self, edges: Sequence[tuple]) -> None:
        frame = pd.DataFrame(edges, columns=["src", "dst", "lag_us", "kind"])
        self.edges = pd.concat([self.edges, frame.astype(self.edges.dtypes.to_dict())], ignore_index=True)

    def remove(self, task_ids: np.ndarray) -> None:
        """Remove tasks, connecting each removed task's predecessors to its successors.

        A removed task's place on its resource counts as an edge from the task before it and to
        the task after it, so a kernel whose launch call is removed still waits for whatever ran
        before that call. A bypass edge's lag is the sum of the lags along the removed path (the
        longest such sum where there are several), as if the removed tasks took no time; lags out
        of a removed task count from its start, so they are never negative.

        Bypass edges that another bypass edge implies are not made: of two sources on one CPU
        thread or GPU stream, the later one ends no earlier than the first (a resource runs its
        tasks one after another, in order), so an edge from the first with no more lag than the
        later one's can never decide its destination's start. Without this, removing a chain
        joined to many outside tasks joins every one of them to every successor: ``fused-optimizer``
        on the ResNet-50 V100 trace, whose optimizer kernels each hold a launch-queue edge from an
        earlier kernel and to a later launch, made 592,643 bypass edges (607,840 dependencies
        against 26,289); 6,782 carry the same schedule (21,979 in all), in a quarter of the time.
        """
        removed = np.zeros(len(self.tasks), dtype=bool)
        removed[np.asarray(task_ids, dtype=np.int64)] = True
        if not removed.any():
            return
        src = self.edges["src"].to_numpy().tolist()
        dst = self.edges["dst"].to_numpy().tolist()
        lag = self.edges["lag_us"].to_numpy().tolist()
        for seq in self.resource_order():
            for i in np.flatnonzero(removed[seq]).tolist():
                if i > 0:
                    src.append(int(seq[i - 1])); dst.append(int(seq[i])); lag.append(0.0)
                if i + 1 < len(seq):
                    src.append(int(seq[i])); dst.append(int(seq[i + 1])); lag.append(0.0)
        ordered = _fixed_order_positions(self)
        into: dict[int, list] = {}
        out: dict[int, list] = {}
        for s_, d_, l_ in zip(src, dst, lag):
            if removed[d_]:
                into.setdefault(d_, []).append((s_, l_))
            if removed[s_]:
                out.setdefault(s_, []).append((d_, l_))
        # longest lag from each outside task to each removed task, in topological order of the
        # removed tasks (Kahn's algorithm on the removed subgraph)
        pending = {r: sum(1 for s_, _ in into.get(r, ()) if removed[s_]) for r in np.flatnonzero(removed).tolist()}
        ready = [r for r, n in pending.items() if n == 0]
        reach: dict[int, dict] = {}
        bypass: dict[tuple, float] = {}
        while ready:
            r = ready.pop()
            sources = reach.pop(r, {})
            for s_, l_ in into.get(r, ()):
                if not removed[s_] and sources.get(s_, -np.inf) < l_:
                    sources[s_] = l_
            sources = _undominated(sources, ordered)
            for d_, l_ in out.get(r, ()):
                # a removed task takes no time, and nothing starts before its cause started: a
                # negative lag out of it (a kernel starting before its launch call returned) is 0
                l_ = max(l_, 0.0)
                if removed[d_]:
                    target = reach.setdefault(d_, {})
                    for s_, acc in sources.items():
                        if target.get(s_, -np.inf) < acc + l_:
                            target[s_] = acc + l_
                    pending[d_] -= 1
                    if pending[d_] == 0:
                        ready.append(d_)
                else:
                    for s_, acc in sources.items():
                        if bypass.get((s_, d_), -np.inf) < acc + l_:
                            bypass[(s_, d_)] = acc + l_
        if any(n > 0 for n in pending.values()):
            raise GraphError("the tasks to remove depend on each other in a cycle")
        kept_edges = self.edges[~(removed[self.edges["src"].to_numpy()] | removed[self.edges["dst"].to_numpy()])]
        into_kept: dict[int, dict] = {}
        for (s_, d_), l_ in bypass.items():
            into_kept.setdefault(d_, {})[s_] = l_
        new_edges = pd.DataFrame(
            [(s_, d_, l_, int(EdgeKind.BYPASS)) for d_, sources in into_kept.items()
             for s_, l_ in _undominated(sources, ordered).items()],
            columns=["src", "dst", "lag_us", "kind"],
        ).astype(self.edges.dtypes.to_dict())
        # a resource whose first tasks go keeps its start: the first survivor inherits the release
        release = self.tasks["release_us"].to_numpy().copy()
        for seq in self.resource_order():
            if removed[seq[0]]:
                survivors = seq[~removed[seq]]
                if len(survivors):
                    release[survivors[0]] = max(release[survivors[0]], release[seq[0]])
        self.tasks["release_us"] = release
        keep = np.flatnonzero(~removed)
        remap = np.full(len(self.tasks), -1, dtype=np.int64)
        remap[keep] = np.arange(len(keep))
        edges = pd.concat([kept_edges, new_edges], ignore_index=True)
        edges["src"] = remap[edges["src"].to_numpy()]
        edges["dst"] = remap[edges["dst"].to_numpy()]
        self.tasks = self.tasks.iloc[keep].reset_index(drop=True)
        self.edges = edges.reset_index(drop=True)

    # -- views ---------------------------------------------------------------------------------

    def resource_order(self) -> list[np.ndarray]:
        """Task ids of each resource, in the order the resource runs them."""
        t = self.tasks
        codes = t["resource"].cat.codes.to_numpy()
        order = np.lexsort((np.arange(len(t)), t["order_key"].to_numpy(), codes))
        sorted_codes = codes[order]
        bounds = np.flatnonzero(np.diff(sorted_codes)) + 1
        return [seq for seq in np.split(order, bounds) if len(seq)]


def cpu_work(tasks: pd.DataFrame) -> np.ndarray:
    """Ids of the tasks that take time on a CPU thread (any worker's, in a cluster graph):
    operators, the gaps between them, runtime calls."""
    resource = tasks["resource"].astype(str).to_numpy().astype(str)
    on_cpu = np.char.startswith(resource, "cpu ") | (np.char.find(resource, ": cpu ") >= 0)
    busy = tasks["duration_us"].to_numpy(dtype=float) > 0
    return np.flatnonzero(np.isin(tasks["kind"].to_numpy(), CPU_WORK_KINDS) & on_cpu & busy)


def _inserted_row(name: str, kind: TaskKind, resource: str, duration_us: float, order_key: float,
                  context, operator, layer) -> dict:
    """The task-table row of a task ``insert`` makes: no measured times, no event of the trace;
    its context, operator and layer those of the task it follows."""
    return {"name": name, "kind": int(kind), "resource": resource, "duration_us": float(duration_us),
            "release_us": -np.inf, "order_key": order_key, "measured_start_us": np.nan, "measured_end_us": np.nan,
            "context": context, "operator": operator, "layer": layer, "event": -1}


def label_mask(column: pd.Series, test: Callable[[str], bool]) -> np.ndarray:
    """``column.astype(str).map(test)`` as a boolean array, ``test`` called once per distinct
    value (a categorical's categories) rather than once per row; a missing value is tested as
    the "nan" ``astype(str)`` writes."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        codes, labels = column.cat.codes.to_numpy(), column.cat.categories
    else:
        codes, labels = pd.factorize(column)
    return np.array([bool(test(str(v))) for v in labels] + [bool(test(str(np.nan)))], dtype=bool)[codes]


def concat_tasks(frames: Sequence[pd.DataFrame], categorical: Optional[Sequence[str]] = None) -> pd.DataFrame:
    """Task tables one after another, re-indexed from 0; the ``categorical`` columns (default:
    the first frame's categorical ones) are categorical, their categories the sorted union of
    every frame's values (as converting to strings and back would make them), found from the
    categories and codes alone rather than by re-reading every row's string."""
    if categorical is None:
        first = frames[0]
        categorical = [c for c in first.columns if isinstance(first[c].dtype, pd.CategoricalDtype)]
    combined = pd.concat([f.drop(columns=[c for c in categorical if c in f.columns]) for f in frames],
                         ignore_index=True)
    for c in categorical:
        parts = [_categories_and_codes(f[c]) if c in f.columns else (pd.Index([]), np.full(len(f), -1))
                 for f in frames]
        distinct = {id(cats): cats for cats, _ in parts}  # frames cut from one table share its categories
        union = pd.Index(np.concatenate([np.asarray(cats, dtype=object) for cats in distinct.values()])).unique().sort_values()
        indexers = {key: union.get_indexer(cats) for key, cats in distinct.items() if len(cats)}
        codes = np.concatenate([np.where(own >= 0, indexers[id(cats)][own], -1) if len(cats) else own
                                for cats, own in parts])
        combined[c] = pd.Categorical.from_codes(codes, categories=union)
    columns = list(dict.fromkeys(c for f in frames for c in f.columns))
    return combined[columns]


def _categories_and_codes(column: pd.Series) -> tuple[pd.Index, np.ndarray]:
    if isinstance(column.dtype, pd.CategoricalDtype):
        return column.cat.categories, column.cat.codes.to_numpy().astype(np.int64)
    codes, uniques = pd.factorize(column, use_na_sentinel=True)
    return pd.Index(uniques, dtype=object), codes.astype(np.int64)


def empty_edges() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "src": np.zeros(0, dtype=np.int64),
            "dst": np.zeros(0, dtype=np.int64),
            "lag_us": np.zeros(0, dtype=np.float64),
            "kind": np.zeros(0, dtype=np.int8),
        }
    )


def _fixed_order_positions(graph: "TaskGraph") -> tuple[np.ndarray, np.ndarray]:
    """For every task, its resource's code and its place in the resource's order, the code -1
    where the order is not known to hold when simulated: only CPU threads and GPU streams are
    taken, as a scheduling policy (``sim.engine``) may reorder a framework's queues."""
    codes = graph.tasks["resource"].cat.codes.to_numpy().astype(np.int64)
    names = graph.tasks["resource"].cat.categories
    fixed = np.asarray([str(n).startswith(("cpu ", "gpu ")) for n in names] + [False])
    code = np.where(fixed[codes], codes, -1)
    position = np.zeros(len(codes), dtype=np.int64)
    for seq in graph.resource_order():
        position[seq] = np.arange(len(seq))
    return code, position


def _undominated(sources: dict, ordered: tuple[np.ndarray, np.ndarray]) -> dict:
    """``sources`` (task: lag to one destination) without those another implies: a source
    earlier on the same fixed-order resource as one with at least its lag ends no later, so
    ``end + lag`` from it is never the larger."""
    if len(sources) < 2:
        return sources
    code, position = ordered
    kept: dict = {}
    best: dict = {}  # resource code: the largest lag of a later source on it so far
    for s_ in sorted(sources, key=lambda t: -position[t]):
        l_ = sources[s_]
        c = int(code[s_])
        if c < 0:
            kept[s_] = l_
        elif l_ > best.get(c, -np.inf):
            kept[s_] = l_
            best[c] = l_
    return kept
