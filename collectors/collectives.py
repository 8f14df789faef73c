"""The collectives a rank ran: its NCCL kernels, with the op, message and group each belongs to.

A trace says what a collective kernel did in up to four places, read here in this order:

1. the kernel's own arguments (torch 2.1 on: ``Collective name``, ``In msg nelems``, ``Out msg
   nelems``, ``dtype``, ``Process Group Name``, ``Process Group Ranks``, and from torch 2.5 the
   group's sequence number ``Seq``);
2. the ``record_param_comms`` operator that launched it (the same arguments, on the CPU);
3. the ``nccl:<op>`` annotation c10d wraps the launch in, whose recorded input is the message
   (``Input Dims`` and ``Input type``: the 2023 DLRM traces have only this);
4. the kernel's name (``ncclKernel_AllReduce_RING_LL_Sum_float``, ``ncclDevKernel_SendRecv``):
   the op, but not the message, and a ``SendRecv`` kernel may be an all-to-all or a send/recv.
   The name also says which algorithm and protocol NCCL chose (``RING``, ``LL``), except for
   point-to-point work (all-to-all, send/recv), whose kernels carry a nominal ``RING_SIMPLE``.

The launch is found by the kernel's correlation id, and the operator and the annotation are the
innermost ones around the launch call on its thread. Ops are named as ``topology`` prices them
(``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``, ``reduce``, ``all_to_all``,
``send_recv``); ``nbytes`` means what it means there (nccl-tests' "size"): the whole buffer of
an all-reduce, broadcast or reduce, the gathered buffer of an all-gather, the scattered one of a
reduce-scatter, a rank's send buffer for an all-to-all, what a rank sends for a send/recv.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd

from .kineto import EventKind, KinetoTrace, element_bytes

COLUMNS = ["event", "stream", "start_us", "end_us", "name", "op", "nbytes", "algorithm", "protocol", "group", "group_ranks", "seq"]

#: c10d's and NCCL's names of a collective, lower-cased, without underscores: the op topology prices
_OPS = {
    "allreduce": "all_reduce", "allreducecoalesced": "all_reduce",
    "allgather": "all_gather", "allgatherbase": "all_gather", "allgatherintotensor": "all_gather",
    "allgatherintotensorcoalesced": "all_gather", "allgathercoalesced": "all_gather",
    "reducescatter": "reduce_scatter", "reducescatterbase": "reduce_scatter",
    "reducescattertensor": "reduce_scatter", "reducescattertensorcoalesced": "reduce_scatter",
    "alltoall": "all_to_all", "alltoallbase": "all_to_all", "alltoallsingle": "all_to_all",
    "broadcast": "broadcast", "reduce": "reduce",
    "send": "send_recv", "recv": "send_recv", "sendrecv": "send_recv", "gather": "gather", "scatter": "scatter",
    "barrier": "barrier",
}
_KERNEL_OP = re.compile(r"nccl(?:Dev)?Kernel_([A-Za-z]+)", re.IGNORECASE)
#: NCCL names a kernel for the algorithm and protocol it runs: ncclKernel_AllReduce_RING_LL_Sum_float
#: (NCCL 2.x to 2.18), ncclDevKernel_AllReduce_Sum_f32_RING_LL (2.19 on)
_KERNEL_CHOICE = re.compile(r"_(RING|TREE|COLLNET_DIRECT|COLLNET_CHAIN|NVLS_TREE|NVLS|PAT)_(LL128|LL|SIMPLE)(?:_|\(|$)")
_POINT_TO_POINT = ("all_to_all", "send_recv")


def op_name(name: str) -> str:
    """The op of a c10d or NCCL collective name (``allreduce``, ``_allgather_base``,
    ``nccl:all_to_all``, ``AllReduce``); "" where it names none."""
    key = re.sub(r"[^a-z]", "", name.lower().removeprefix("nccl:"))
    return _OPS.get(key, "")


def find_collectives(trace: KinetoTrace) -> pd.DataFrame:
    """One row per NCCL kernel of ``trace``, in start order: ``event`` (its row in
    ``trace.events``), ``stream`` (its GPU thread label), ``start_us``, ``end_us``, ``name``, ``op``
    ("" where nothing names one), ``nbytes`` (NaN where no record gives the message),
    ``algorithm`` and ``protocol`` (NCCL's choice, lower-cased as ``topology`` names it: ``ring``,
    ``ll``; "" where the kernel's name does not say, or for point-to-point work), ``group``
    (the process group's name, "" where unrecorded), ``group_ranks`` (its global ranks as text, ""
    where unrecorded) and ``seq`` (its sequence number in the group, -1 where unrecorded)."""
    ev = trace.events
    names = ev["name"].astype(str).to_numpy()
    kinds = ev["kind"].to_numpy()
    kernels = np.flatnonzero((kinds == int(EventKind.KERNEL)) & np.char.startswith(np.char.lower(names.astype(str)), "nccl"))
    kernels = kernels[np.argsort(ev["ts_us"].to_numpy()[kernels], kind="stable")]
    if not len(kernels):
        return pd.DataFrame({c: [] for c in COLUMNS})
    around = _Enclosing(trace)
    rows = []
    for k in kernels.tolist():
        launch = around.launch(int(ev["correlation"].iat[k]))
        comms = around.innermost(launch, around.comms)
        note = around.innermost(launch, around.annotations)
        record = k if str(ev["collective_name"].iat[k]) else comms
        op = ""
        if record >= 0:
            op = op_name(str(ev["collective_name"].iat[record]))
        if not op and note >= 0:
            op = op_name(names[note])
        if not op:
            match = _KERNEL_OP.match(names[k])
            op = op_name(match.group(1)) if match else ""
        rows.append({
            "event": k,
            "stream": str(ev["thread"].iat[k]),
            "start_us": float(ev["ts_us"].iat[k]),
            "end_us": float(ev["ts_us"].iat[k] + ev["dur_us"].iat[k]),
            "name": names[k],
            "op": op,
            "nbytes": _message_bytes(trace, op, record, note),
            **_choice(names[k], op),
            "group": _first_text(ev["process_group"], (k, comms)),
            "group_ranks": _first_text(ev["group_ranks"], (k, comms)),
            "seq": _first_number(ev["collective_seq"].to_numpy(), (k, comms)),
        })
    return pd.DataFrame(rows, columns=COLUMNS)


def _choice(kernel: str, op: str) -> dict:
    match = _KERNEL_CHOICE.search(kernel)
    if match is None or op in _POINT_TO_POINT:
        return {"algorithm": "", "protocol": ""}
    return {"algorithm": match.group(1).lower(), "protocol": match.group(2).lower()}


class _Enclosing:
    """The launch call of a correlation id, and the ``record_param_comms`` operators and
    ``nccl:*`` annotations around a launch call on its thread."""

    def __init__(self, trace: KinetoTrace):
        ev = trace.events
        self.ev = ev
        kinds = ev["kind"].to_numpy()
        names = ev["name"].astype(str).to_numpy()
        runtime = np.flatnonzero(kinds == int(EventKind.RUNTIME))
        by_corr = pd.Series(runtime, index=ev["correlation"].to_numpy()[runtime])
        self.by_corr = by_corr[~by_corr.index.duplicated() & (by_corr.index >= 0)]
        self.comms = np.flatnonzero((kinds == int(EventKind.CPU_OP)) & (names == "record_param_comms"))
        self.annotations = np.flatnonzero((kinds == int(EventKind.ANNOTATION)) & np.char.startswith(names.astype(str), "nccl:"))
        self.ts = ev["ts_us"].to_numpy()
        self.end = self.ts + ev["dur_us"].to_numpy()
        self.thread = ev["thread"].cat.codes.to_numpy()

    def launch(self, correlation: int) -> int:
        return int(self.by_corr.get(correlation, -1)) if correlation >= 0 else -1

    def innermost(self, call: int, candidates: np.ndarray) -> int:
        """The latest-starting candidate on the call's thread that covers the call; -1: none."""
        if call < 0 or not len(candidates):
            return -1
        covers = (
            (self.thread[candidates] == self.thread[call])
            & (self.ts[candidates] <= self.ts[call])
            & (self.end[candidates] >= self.end[call])
        )
        hits = candidates[covers]
        return int(hits[np.argmax(self.ts[hits])]) if len(hits) else -1


def _message_bytes(trace: KinetoTrace, op: str, record: int, note: int) -> float:
    """The collective's size as ``topology`` means it: from c10d's element counts where
    recorded, else from the ``nccl:*`` annotation's input (its tensors' elements)."""
    ev = trace.events
    if record >= 0 and ev["message_elements"].iat[record] >= 0:
        size = element_bytes(str(ev["message_dtype"].iat[record]))
        elements_in = float(ev["message_elements"].iat[record])
        elements_out = float(ev["out_elements"].iat[record])
        if op == "all_gather" and elements_out >= 0:
            return elements_out * size
        return elements_in * size
    if note >= 0 and note in trace.input_dims:
        try:
            dims = json.loads(bytes(trace.input_dims[note]))
            types = json.loads(bytes(trace.input_types.get(note, b"[]")) or b"[]")
        except (json.JSONDecodeError, TypeError):
            return np.nan
        total = 0.0
        for i, shape in enumerate(dims if isinstance(dims, list) else []):
            if isinstance(shape, list) and shape and all(isinstance(d, int) for d in shape):
                dtype = types[i] if isinstance(types, list) and i < len(types) else "float"
                total += float(np.prod(shape)) * element_bytes(dtype)
        return total if total > 0 else np.nan
    return np.nan


def _first_text(column: pd.Series, rows: tuple) -> str:
    for r in rows:
        if r >= 0 and str(column.iat[r]):
            return str(column.iat[r])
    return ""


def _first_number(column: np.ndarray, rows: tuple) -> int:
    for r in rows:
        if r >= 0 and column[r] >= 0:
            return int(column[r])
    return -1
