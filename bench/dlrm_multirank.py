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
   target: within 10 % of the slowest rank's measured step.

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
from one moment everywhere, so the ranks' steps differ only by when they entered the step: the
slowest rank is the one that entered first. How early that was, rank 0's trace cannot say (it
begins after it); taking the ranks as exchangeable (no rank early by nature), the first rank
entered as long before rank 0 as the last came after it, which is rank 0's wait at the step's
first collective: one replica enters that much earlier (``Job.entering``), and its step is the
prediction. The same with rank 0 as the first to enter, and with no skew at all (identical
ranks: a lower bound), are printed beside it.
Run from anywhere:

    .venv/bin/python bench/dlrm_multirank.py [--traces DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from whatif.collectors.ranks import load_traces
from whatif.report.ranks import rank_reports
from whatif.sim.multirank import build_job, replicate_rank, transfer_on
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
    print(f"   why: the ranks reached the first collective {spread[job.collectives.index[0]] / 1e3:.2f} ms apart; "
          f"rank 0's trace begins {rank0_head_ms(traces):.2f} ms before it and shows only the {late_us[first] / 1e3:.2f} ms it waited there")
    print(f"   the 8 traces joined, every rank entering the step when the last did: {min(together):.2f} to "
          f"{max(together):.2f} ms (the prediction is {100.0 * (predicted - max(together)) / max(together):+.1f} % of the slowest)")
    return 0 if replay_ok and abs(error) <= MAX_PREDICTION_ERROR_PCT else 1


def rank0_head_ms(traces) -> float:
    """How long before its first collective kernel rank 0's trace begins."""
    trace = traces.ranks[0].trace
    kernels = trace.events[trace.events["name"].astype(str).str.startswith("ncclKernel")]
    return float(kernels["ts_us"].min()) / 1e3


if __name__ == "__main__":
    sys.exit(main())
