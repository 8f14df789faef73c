"""The 8-rank DLRM step: replayed from all eight traces, and predicted from rank 0's alone.

``../shared/traces/param-dlrm-8rank`` holds one training step (``ProfilerStep#10``) of each of
the 8 ranks of a DLRM job on one node (see SOURCES.md). This prints:

1. the replay of the eight traces joined at their collectives (``sim/multirank.py``): each
   rank's measured and predicted step, and how long its collectives waited for the last rank;
   target: every rank within 1 %;
2. the eight collectives: op and message (from the ``nccl:*`` annotations), NCCL's algorithm and
   protocol (from the kernels' names), the transfer the traces measured after the last rank
   arrived, and the transfer NCCL's model gives on the cluster below;
3. the 8-rank step predicted from rank 0's trace alone: rank 0's graph replicated, its
   collectives priced by the model, and the other ranks' arrival skew modelled as said below;
   target: within 10 % of the slowest rank's measured step;
4. the slowest rank's measured step and the prediction's, cut at the collectives
   (``report.ranks.step_segments``): the time to each collective, its wait, its transfer, and
   the tail after the last: where the two differ;
5. the entry into the step, as all eight traces show it (below).

The cluster, as far as the traces tell it: ``distributedInfo`` says 8 ranks and the NCCL
backend; ``deviceProperties`` lists 8 Tesla V100-SXM2-32GB (compute capability 7.0, 80 SMs) in
every trace; the kernels ran on devices 0 to 7 of one host (consecutive process ids, one clock);
the kernel names (``ncclKernel_..._RING_LL``) are NCCL 2.18 or older and say ring/LL for the
all-reduces. Eight V100 SXM2 on one board are an NVLink hybrid cube-mesh (DGX-1V, HGX-1, AWS
p3.16xlarge: every SXM2 baseboard of eight), so the cluster is ``machine: dgx_v100`` (no
NVSwitch, six NVLink 2.0 links per GPU). Unknown: the NCCL release (the model's default is
used), which board exactly (the NICs do not matter on one node), NCCL's settings (channels: the
all-reduce kernels' grid of 12 blocks agrees with the 12 channels the model picks), and the
CPUs, which this step's host-bound time depends on but the model does not price.

The skew of the other ranks is what rank 0's trace cannot hold. Each of rank 0's collective
kernels lasts its wait for the last rank plus the transfer; less the model's transfer, that is
how late the last rank came. The prediction lets the other ranks arrive that late at every
collective (each collective's rendezvous waits that long after the replicas: see
``Job.with_collectives``). Once a collective has completed on every rank, what follows starts
from one moment everywhere, so the ranks' steps differ mostly by when they entered the step:
the slowest rank is the one that entered first. How early that was, rank 0's trace cannot say
(it begins after it); taking the ranks as exchangeable, with entries spread symmetrically about
their mean, the first rank entered on average as long before any rank as the last came after
it, which for rank 0 is its wait at the step's first collective: one replica enters that much
earlier (``Job.entering``), and its step is the prediction. The same with rank 0 as the first to
enter, and with no skew at all (identical ranks: a lower bound), are printed beside it.

Where the prediction misses (4): in one part, the slowest rank's wait at the first collective,
that is, how early it entered the step; every other part (the time to each collective, the
other waits, the transfers, the tail) agrees within 0.06 ms. The entry (5): the ranks entered
the profiled step 7.5 ms apart and left it 0.9 ms apart, each 0.8 to 1.7 ms after the step's
last collective completed. On ranks 1 and 3 the previous step's last kernels (launched before
the traces began, the same 64 kernels that end this step after its last all-reduce) still ran
after those two had entered; they follow that step's last all-reduce, which completes on every
rank at once, so every rank leaving as in this step would have entered by 2.7 ms; ranks 0, 2, 6
and 7 came 2.7 to 4.8 ms later. That pause lies before their traces begin: the moment each
rank's profiler started its trace (``torch.profiler`` starts it inside ``prof.step()``, on each
rank alone, unfenced). The slowest rank's measured step holds that transient, which no trace
records and rank 0's shows from one side only (how late the last rank came, not how early the
first one did). Printed with it: the ratio of the two for rank 0 and where it lies among what 8
exchangeable ranks give, and rank 0's replicas given that one number from the other traces.

Run from anywhere:

    .venv/bin/python bench/dlrm_multirank.py [--traces DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from whatif.collectors.ranks import load_traces
from whatif.report.ranks import rank_reports, step_segments
from whatif.sim.graph import GPU_TASK_KINDS, EdgeKind
from whatif.sim.multirank import build_job, rank_of_tasks, replicate_rank, transfer_on
from whatif.topology import Cluster

from measured_code import REPO, code_version  # noqa: E402  (bench/ is the script's folder)

DEFAULT_TRACES = REPO.parent / "shared" / "traces" / "param-dlrm-8rank"
CLUSTER = {"machine": "dgx_v100", "machines": 1}
MAX_REPLAY_ERROR_PCT = 1.0
MAX_PREDICTION_ERROR_PCT = 10.0


def step_ms(job, schedule) -> list[float]:
    """Each rank's predicted first iteration (the traces hold one)."""
    return [float(r.iterations["predicted_ms"].iat[0]) for r in rank_reports(job, schedule)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=DEFAULT_TRACES, help="the folder of the 8 DLRM rank traces")
    args = parser.parse_args(argv)
    if not args.traces.is_dir():
        print(f"dlrm_multirank: no folder {args.traces} (check out ../shared beside the repository)", file=sys.stderr)
        return 2
    traces = load_traces(args.traces)
    cluster = Cluster.from_config(CLUSTER)
    devices = traces.ranks[0].trace.device_properties
    print(f"code:    {code_version()}")
    print(f"traces:  {args.traces} ({len(traces.ranks)} ranks, backend {traces.ranks[0].backend})")
    for path, why in traces.skipped:
        print(f"         skipped {Path(path).name}: {why}")
    print(f"devices: {len(devices)} x {devices[0]['name'] if devices else 'unknown'} in each trace")
    print(f"cluster: {CLUSTER} -> backend {cluster.backend}, {cluster.n_gpus} GPUs")

    job = build_job(traces)
    replay = job.replay()
    reports = rank_reports(job, replay)
    print(f"\n1. Replay of the {len(reports)} ranks joined at their {len(job.collectives)} collectives")
    print(f"{'rank':>4} {'measured ms':>12} {'predicted ms':>13} {'error %':>8} {'collective wait ms':>19} {'transfer ms':>12}")
    errors = []
    for r in reports:
        row = r.iterations.iloc[0]
        errors.append(abs(row["error_pct"]))
        print(f"{r.rank:>4} {row['measured_ms']:>12.3f} {row['predicted_ms']:>13.3f} {row['error_pct']:>8.2f} "
              f"{row['collective_wait_ms']:>19.2f} {row['transfer_ms']:>12.2f}")
    replay_ok = max(errors) <= MAX_REPLAY_ERROR_PCT
    print(f"largest |error| {max(errors):.2f} % (target {MAX_REPLAY_ERROR_PCT} %): {'PASS' if replay_ok else 'MISSED'}")

    price = transfer_on(cluster)
    starts = job.members.assign(start=job.graph.tasks["measured_end_us"].to_numpy()[job.members["arrival"].to_numpy()])
    spread = starts.groupby("collective")["start"].agg(lambda s: s.max() - s.min())
    print(f"\n2. The collectives, priced on {CLUSTER['machine']} by NCCL's model")
    print(f"{'#':>2} {'op':<11} {'bytes':>9} {'algorithm':>10} {'measured transfer us':>21} {'model us':>9} {'arrivals spread ms':>19}")
    for key, c in job.collectives.iterrows():
        choice = f"{c['algorithm']}/{c['protocol']}" if c["algorithm"] else "p2p"
        print(f"{key:>2} {c['op']:<11} {c['nbytes']:>9.0f} {choice:>10} {c['transfer_us']:>21.1f} {price(c):>9.1f} "
              f"{spread[key] / 1e3:>19.2f}")

    rank0 = replicate_rank(traces.ranks[0], len(traces.ranks))
    measured = [float(r.iterations["measured_ms"].iat[0]) for r in reports]
    slowest = int(np.argmax(measured))
    late_us = {key: max(c["transfer_us"] - price(c), 0.0) for key, c in rank0.collectives.iterrows()}
    first = rank0.collectives.index[0]
    skewed = rank0.with_collectives(price, lambda c: late_us[c.name])
    no_skew = max(step_ms(rank0, rank0.simulate(rank0.with_collectives(price, lambda c: 0.0))))
    rank0_first = max(step_ms(rank0, rank0.simulate(skewed)))
    predicted = max(step_ms(rank0, rank0.simulate(rank0.entering({1: -late_us[first]}, skewed))))
    together = step_ms(job, job.simulate(job.entering()))
    error = 100.0 * (predicted - measured[slowest]) / measured[slowest]
    print(f"\n3. The {len(traces.ranks)}-rank step from rank 0's trace alone ({len(traces.ranks)} replicas of its graph)")
    print(f"   the last rank came this much after rank 0 (its kernel less the model's transfer), per collective, ms: "
          f"{', '.join(f'{late_us[k] / 1e3:.2f}' for k in sorted(late_us))}")
    print(f"   predicted step of the slowest rank, ranks exchangeable: {predicted:7.2f} ms  "
          f"(it entered {late_us[first] / 1e3:.2f} ms before rank 0)")
    print(f"   the same with rank 0 the first to enter:                {rank0_first:7.2f} ms")
    print(f"   the same with no skew (identical ranks, a lower bound): {no_skew:7.2f} ms")
    print(f"   measured, slowest rank (rank {slowest}):                         {measured[slowest]:7.2f} ms")
    print(f"   error against the slowest rank: {error:+.1f} % (target {MAX_PREDICTION_ERROR_PCT} %): "
          f"{'PASS' if abs(error) <= MAX_PREDICTION_ERROR_PCT else 'MISSED'}")
    print(f"   the 8 traces joined, every rank entering the step when the last did: {min(together):.2f} to "
          f"{max(together):.2f} ms (the prediction is {100.0 * (predicted - max(together)) / max(together):+.1f} % of the slowest)")

    predicted_schedule = rank0.simulate(rank0.entering({1: -late_us[first]}, skewed))
    print(f"\n4. Where the slowest rank's step goes: measured (rank {slowest}, the joined traces' replay) "
          f"against the prediction's slowest replica, ms")
    measured_parts = step_segments(job, replay, slowest)
    predicted_parts = step_segments(rank0, predicted_schedule, 1)
    print_segments(job, measured_parts, predicted_parts)

    entries = entries_ms(job, replay)
    leaves = exits_ms(job, replay)
    early, last = min(entries, key=entries.get), max(entries, key=entries.get)
    print("\n5. The entry, as the eight traces show it (ms after the first rank entered the step)")
    print(f"   entered: {', '.join(f'rank {k} {v:.2f}' for k, v in sorted(entries.items()))}: {entries[last]:.2f} ms apart")
    print(f"   left:    {', '.join(f'rank {k} {v:.2f}' for k, v in sorted(leaves.items()))}: "
          f"{max(leaves.values()) - min(leaves.values()):.2f} ms apart")
    tail = tail_ms(job, replay)
    print(f"   each rank left the step {min(tail.values()):.2f} to {max(tail.values()):.2f} ms after its last collective "
          f"completed (on every rank at once)")
    before = launched_before_trace(job)
    for k, (n, start, end, same) in sorted(before.items()):
        print(f"   rank {k}: {n} GPU tasks launched before its trace began ran {start:.2f} to {end:.2f}"
              + (f", the same kernels as the {n} that end this step after its last collective: the previous step's" if same else ""))
    if before and all(same for *_, same in before.values()):
        done = min(start for _, start, _, _ in before.values())
        due = done + max(tail.values())
        late = {k: v - due for k, v in entries.items() if v > due}
        print(f"   so the previous step's last collective had completed everywhere by {done:.2f}; leaving as this step's ranks "
              f"do, every rank would have entered by {due:.2f}; later by: "
              f"{', '.join(f'rank {k} {v:.2f}' for k, v in sorted(late.items()))} ms, a pause before their traces began")
    lead_us = 1e3 * (entries[0] - entries[early])
    ratio = lead_us / late_us[first]
    print(f"   rank 0 entered {lead_us / 1e3:.2f} ms after the first rank and waited {late_us[first] / 1e3:.2f} ms for the last "
          f"at #{first}: a ratio of {ratio:.2f}; the prediction takes the two equal, as they are on average for exchangeable ranks "
          f"whose entries spread symmetrically")
    print(f"   for {len(entries)} exchangeable ranks with i.i.d. entries, {ratio:.2f} is the "
          f"{', '.join(f'{100 * ratio_percentile(ratio, len(entries), shape):.0f}th percentile ({shape})' for shape in SHAPES)}")
    given = max(step_ms(rank0, rank0.simulate(rank0.entering({1: -lead_us}, skewed))))
    print(f"   rank 0's replicas with the first entering {lead_us / 1e3:.2f} ms before rank 0 (the one number taken from the "
          f"other traces): {given:.2f} ms ({100.0 * (given - measured[slowest]) / measured[slowest]:+.1f} % of the slowest rank)")
    return 0 if replay_ok and abs(error) <= MAX_PREDICTION_ERROR_PCT else 1


def print_segments(job, measured, predicted) -> None:
    """The two cuts of a step side by side, one row per collective, and their totals."""
    print(f"{'#':>2} {'op':<11} {'to it':>13} {'wait':>13} {'transfer':>15}")
    print(f"{'':>14} {'meas':>6} {'pred':>6} {'meas':>6} {'pred':>6} {'meas':>7} {'pred':>7}")
    table = {}
    for name, parts in (("meas", measured), ("pred", predicted)):
        for row in parts.itertuples(index=False):
            table[(row.collective, row.part, name)] = row.ms
    for key, c in job.collectives.iterrows():
        cells = [table.get((key, part, name), np.nan) for part in ("to", "wait", "transfer") for name in ("meas", "pred")]
        print(f"{key:>2} {c['op']:<11} {cells[0]:>6.2f} {cells[1]:>6.2f} {cells[2]:>6.2f} {cells[3]:>6.2f} "
              f"{cells[4]:>7.3f} {cells[5]:>7.3f}")
    print(f"   after the last: {table.get((-1, 'after', 'meas'), np.nan):.2f} measured, {table.get((-1, 'after', 'pred'), np.nan):.2f} predicted")
    diff = predicted.set_index(["part", "collective"])["ms"] - measured.set_index(["part", "collective"])["ms"]
    worst = diff.abs().idxmax()
    rest = diff.drop(index=worst)
    print(f"   total: {measured['ms'].sum():.2f} measured, {predicted['ms'].sum():.2f} predicted: {diff.sum():+.2f} ms, "
          f"of which {diff[worst]:+.2f} in {worst[0]} #{worst[1]}; every other part within {rest.abs().max():.2f} "
          f"(together {rest.sum():+.2f})")


def entries_ms(job, schedule) -> dict:
    """When each rank entered its first iteration in ``schedule``, ms after the first rank did."""
    starts = {r.rank: float(rep.iterations["span_start_us"].iat[0]) + r.shift_us
              for r, rep in zip(job.ranks, rank_reports(job, schedule))}
    first = min(starts.values())
    return {k: (v - first) / 1e3 for k, v in starts.items()}


def exits_ms(job, schedule) -> dict:
    """When each rank left its first iteration, ms after the first rank entered it."""
    reports = rank_reports(job, schedule)
    starts = [float(rep.iterations["span_start_us"].iat[0]) + r.shift_us for r, rep in zip(job.ranks, reports)]
    return {r.rank: (float(rep.iterations["span_end_us"].iat[0]) + r.shift_us - min(starts)) / 1e3
            for r, rep in zip(job.ranks, reports)}


def tail_ms(job, schedule) -> dict:
    """How long after its last collective completed each rank left its first iteration."""
    reports = rank_reports(job, schedule)
    out = {}
    for r, rep in zip(job.ranks, reports):
        end = float(rep.iterations["span_end_us"].iat[0]) + r.shift_us
        done = schedule.end_us[job.members.loc[job.members["rank"] == r.rank, "completion"].to_numpy()]
        out[r.rank] = (end - done[done <= end].max()) / 1e3
    return out


def launched_before_trace(job) -> dict:
    """Per rank with any: how many GPU tasks have no launching call in its trace (launched before
    it began), when the first started and the last ended (ms after the first rank entered the
    step), and whether they are, name for name, the GPU tasks that end the rank's step after its
    last collective (the previous step's end, then)."""
    tasks, edges = job.graph.tasks, job.graph.edges
    gpu = tasks["kind"].isin([int(k) for k in GPU_TASK_KINDS]).to_numpy()
    launched = np.zeros(len(tasks), dtype=bool)
    launched[edges.loc[edges["kind"] == int(EdgeKind.LAUNCH), "dst"].to_numpy()] = True
    launched[job.members["completion"].to_numpy()] = True  # its arrival holds the launch
    rank_of = rank_of_tasks(job.graph)
    start, end = tasks["measured_start_us"].to_numpy(), tasks["measured_end_us"].to_numpy()
    names = tasks["name"].astype(str).to_numpy()
    first = min(float(r.iterations["start_us"].iat[0]) + r.shift_us for r in job.ranks)
    out = {}
    for r in job.ranks:
        mine = gpu & (rank_of == r.rank)
        orphans = np.flatnonzero(mine & ~launched)
        if not len(orphans):
            continue
        orphans = orphans[np.argsort(start[orphans], kind="stable")]
        last_collective = end[job.members.loc[job.members["rank"] == r.rank, "completion"].to_numpy()].max()
        tail = np.flatnonzero(mine & launched & (start >= last_collective))
        tail = tail[np.argsort(start[tail], kind="stable")][-len(orphans):]
        same = len(tail) == len(orphans) and (names[tail] == names[orphans]).all()
        out[r.rank] = (len(orphans), (start[orphans].min() - first) / 1e3, (end[orphans].max() - first) / 1e3, bool(same))
    return out


SHAPES = {"uniform": lambda rng, size: rng.random(size), "normal": lambda rng, size: rng.standard_normal(size)}


def ratio_percentile(ratio: float, n: int, shape: str, draws: int = 200_000) -> float:
    """The share of draws in which a given rank of ``n`` i.i.d. entries (of ``shape``) entered at
    most ``ratio`` times as long after the first as the last entered after it, among the draws
    where it was not the last (it waited)."""
    x = SHAPES[shape](np.random.default_rng(0), (draws, n))
    wait, lead = x.max(axis=1) - x[:, 0], x[:, 0] - x.min(axis=1)
    waited = wait > 0
    return float(np.mean(lead[waited] <= ratio * wait[waited]))


def rank0_head_ms(traces) -> float:
    """How long before its first collective kernel rank 0's trace begins."""
    trace = traces.ranks[0].trace
    kernels = trace.events[trace.events["name"].astype(str).str.startswith("ncclKernel")]
    return float(kernels["ts_us"].min()) / 1e3


if __name__ == "__main__":
    sys.exit(main())
