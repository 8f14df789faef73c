"""Inferring the waits of one GPU stream for another that a trace did not record.

A pass over one rank's graph (:func:`infer_stream_waits`), applied where a delay on one stream must
reach the streams that wait for it: the joined ranks of a job (``sim/multirank.py``).
"""

from __future__ import annotations

import numpy as np

from ..build import IDLE_GAP_US, TOLERANCE_US
from ..graph import EdgeKind, TaskGraph


def infer_stream_waits(graph: TaskGraph) -> TaskGraph:
    """``graph`` with the waits of one GPU stream for another that the trace did not record.

    ``cudaStreamWaitEvent`` makes a stream wait for another's work (the compute stream for the
    collective that brings its input, the NCCL stream for the gradients it reduces); Kineto
    says which event it waited for only in its ``cuda_sync`` records (torch 2.1 on, and not in
    every trace: the DLRM ones have none). Without them the wait is in the lag of the kernel's
    launch edge (7 ms on DLRM rank 1's compute stream, which started 2 us after a collective
    ended), where no change to the other stream can move it. So a GPU task that started more
    than ``IDLE_GAP_US`` after its launch allowed, within ``IDLE_GAP_US`` after a task on another
    stream of its GPU ended, waited for that task: the edge between them takes the measured
    latency, and the launch edge the typical one (the median launch lag). Replay is unchanged.
    """
    tasks, edges = graph.tasks, graph.edges
    launch = edges[edges["kind"] == int(EdgeKind.LAUNCH)]
    if not len(launch):
        return graph
    typical = float(np.median(launch["lag_us"].to_numpy()))
    waited = launch[launch["lag_us"] > typical + IDLE_GAP_US]
    if not len(waited):
        return graph
    resource = tasks["resource"].astype(str).to_numpy()
    device = np.array([label.split("/")[0] if label.startswith("gpu ") else "" for label in resource], dtype=object)
    end = tasks["measured_end_us"].to_numpy()
    start = end - tasks["duration_us"].to_numpy()
    gpu = np.flatnonzero(device != "")
    src, dst, lag, relaxed = [], [], [], []
    for row, task in zip(waited.index.tolist(), waited["dst"].tolist()):
        others = gpu[(device[gpu] == device[task]) & (resource[gpu] != resource[task])]
        ended = others[(end[others] <= start[task] + TOLERANCE_US) & (end[others] >= start[task] - IDLE_GAP_US)]
        if not len(ended):
            continue
        cause = int(ended[np.argmax(end[ended])])
        src.append(cause)
        dst.append(int(task))
        lag.append(float(start[task] - end[cause]))
        relaxed.append(row)
    if not src:
        return graph
    graph = graph.copy()
    graph.edges.loc[relaxed, "lag_us"] = typical
    graph.add_edges([(s_, d_, l_, int(EdgeKind.STREAM_WAIT)) for s_, d_, l_ in zip(src, dst, lag)])
    return graph
