"""Which collective kernel of one rank is which collective of another: matching a job's ranks.

Each rank's collectives (``collectors/collectives.py``) are grouped by process group (c10d's
``Process Group Name``), else by the NCCL stream they ran on, and paired across the group's
members by their sequence number in the group (``Seq``, torch 2.5 on) where every kernel has a
distinct one, else by their order on each rank: NCCL runs a communicator's collectives in the
order every member issued them. The op must agree at every position, and the message too for the
ops whose message every member shares; anything else means traces of different jobs, or of
different steps, and is refused in one line.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from .graph import GraphError

#: Ops whose message is the same on every member, so a difference means different jobs.
SYMMETRIC_OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter")


def match_collectives(tables: dict[int, pd.DataFrame], paths: dict[int, str]) -> pd.DataFrame:
    """Which kernel of each rank is which collective of the job.

    ``tables`` maps each rank to its :func:`~whatif.collectors.collectives.find_collectives`
    table with a ``task`` column. Returns one row per rank of each collective: collective (id,
    in the order of the group's collectives), rank, task, start_us, end_us (the rank's clock),
    op, nbytes, name, group, seq. Raises :class:`GraphError` with a one-line reason where the
    ranks' collectives do not pair up.
    """
    ranks = sorted(tables)
    if all(len(t) == 0 for t in tables.values()):
        raise GraphError(
            f"no NCCL collective kernels in the traces of ranks {ranks[0]}..{ranks[-1]}: nothing joins them "
            "(CPU collectives, gloo, are not joined yet)"
        )
    frames = []
    for rank in ranks:
        t = tables[rank].copy()
        t["rank"] = rank
        t["stream_key"] = "stream " + t["stream"].str.rsplit("stream ", n=1).str[-1]
        frames.append(t)
    rows = pd.concat(frames, ignore_index=True)
    rows = _group_keys(rows)
    out = []
    next_id = 0
    for group, in_group in rows.groupby("group_key", sort=False):
        expected = _members(in_group, ranks)
        present = sorted(in_group["rank"].unique().tolist())
        lacking = [r for r in expected if r not in present]
        if lacking:
            first = present[0]
            raise GraphError(
                f"{paths[lacking[0]]}: rank {lacking[0]} ran no collective on {_describe(group)}, which "
                f"rank {first} ran {int((in_group['rank'] == first).sum())} times: the traces are not of one job"
            )
        keyed = _sequence(in_group)
        reference = expected[0]
        ref = keyed[keyed["rank"] == reference].set_index("seq_key")
        for rank in expected[1:]:
            mine = keyed[keyed["rank"] == rank].set_index("seq_key")
            _check_same(group, reference, ref, rank, mine, paths)
        order = ref.sort_values("start_us").index.tolist()
        ids = {key: next_id + i for i, key in enumerate(order)}
        next_id += len(order)
        keyed = keyed[keyed["rank"].isin(expected)].copy()
        keyed["collective"] = keyed["seq_key"].map(ids)
        keyed["seq"] = keyed["seq_key"]
        keyed["group"] = group
        out.append(keyed)
    matched = pd.concat(out, ignore_index=True)
    return matched[["collective", "rank", "task", "start_us", "end_us", "op", "nbytes", "algorithm", "protocol", "name", "group", "seq"]].sort_values(
        ["collective", "rank"], ignore_index=True
    )


def _group_keys(rows: pd.DataFrame) -> pd.DataFrame:
    """Each kernel's group: its process group's name, else its NCCL stream, else, where the
    ranks' streams are numbered differently but each rank has one, that one stream."""
    rows["group_key"] = np.where(rows["group"] != "", "group " + rows["group"], rows["stream_key"])
    unnamed = rows["group"] == ""
    if unnamed.any():
        streams = rows[unnamed].groupby("rank")["stream_key"].unique()
        same = all(set(s) == set(streams.iloc[0]) for s in streams)
        if not same and all(len(s) == 1 for s in streams):
            rows.loc[unnamed, "group_key"] = "the NCCL stream"
    return rows


def _members(in_group: pd.DataFrame, ranks: list) -> list:
    recorded = [r for r in in_group["group_ranks"].unique().tolist() if r]
    if recorded:
        try:
            listed = json.loads(recorded[0])
        except json.JSONDecodeError:
            listed = None
        if isinstance(listed, list) and listed and all(isinstance(r, int) for r in listed):
            return sorted(r for r in listed if r in ranks) or ranks
    return ranks


def _sequence(in_group: pd.DataFrame) -> pd.DataFrame:
    """The key that pairs a group's collectives: the recorded sequence numbers where every
    kernel of the group has a distinct one on its rank, else the order on each rank."""
    keyed = in_group.sort_values(["rank", "start_us"], kind="stable").copy()
    numbered = (keyed["seq"] >= 0).all() and not keyed.duplicated(["rank", "seq"]).any()
    keyed["seq_key"] = keyed["seq"] if numbered else keyed.groupby("rank").cumcount()
    return keyed


def _check_same(group, ref_rank, ref, rank, mine, paths) -> None:
    where = f"{paths[rank]}: rank {rank}"
    if len(mine) != len(ref) or set(mine.index) != set(ref.index):
        raise GraphError(
            f"{where} ran {len(mine)} collectives on {_describe(group)} and rank {ref_rank} ran {len(ref)}"
            + ("" if len(mine) != len(ref) else ", with other sequence numbers")
            + ": the traces are not of one job, or cover different steps"
        )
    for key in ref.index:
        a, b = ref.loc[key], mine.loc[key]
        symmetric = a["op"] in SYMMETRIC_OPS
        sizes_differ = symmetric and np.isfinite(a["nbytes"]) and np.isfinite(b["nbytes"]) and a["nbytes"] != b["nbytes"]
        if a["op"] != b["op"] or sizes_differ:
            raise GraphError(
                f"{where}'s collective #{key} on {_describe(group)} is {_what(b)} where rank {ref_rank}'s is "
                f"{_what(a)}: the traces are not of one job"
            )


def _describe(group: str) -> str:
    return group if group.startswith(("group", "the")) else f"NCCL {group}"


def _what(row) -> str:
    size = f" of {row['nbytes']:.0f} bytes" if np.isfinite(row["nbytes"]) else ""
    return f"{row['op'] or row['name'][:40]}{size}"
