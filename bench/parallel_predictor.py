"""The predictor ``bench/parallel_validation.py`` calls: a lab setting predicted by ``whatif``.

``predict(setting, captures, work)`` builds the scenario a user would write for the setting: its
one-rank capture (the rank's batch), the lab's machines and workers on the links calibrated at
its bandwidth (``lab/validate.py``'s ``links``, kept in ``work``), DDP as the framework and the
setting's ``parallelism:`` block, with a pipeline's microbatch capture as its
``microbatch_trace`` (a user profiles one microbatch too), a tensor-parallel setting's measured
library cost (``lab.parallel.measure_tensor_dispatch``) as its ``tensor_dispatch``, an FSDP
setting's (``measure_fsdp_dispatch``) as its ``fsdp_dispatch``, and returns the predicted steady
iteration in milliseconds. Where the lab runs a machine's workers on fewer cores than workers
(``lab/cluster.py``'s ``pin``: 2 machines x 2 workers on a 2-core box), the cluster says so
(``cores_per_machine``).

    sudo .venv/bin/python bench/parallel_validation.py --variants fsdp --bandwidths 200 --no-loopback \\
        --predictor parallel_predictor:predict
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from whatif.lab.cluster import box_cores, pin
from whatif.lab.parallel import LOOPBACK_MBPS, ParallelSetting, dispatch_block
from whatif.lab.validate import links
from whatif.pipeline import predict as run_pipeline
from whatif.scenario import Scenario


def predict(setting: ParallelSetting, captures: dict, work: Path, cpu_speed: float = 1.0) -> float:
    prediction = run_pipeline(scenario(setting, captures, work, cpu_speed=cpu_speed).request())
    return float(prediction.results["iteration_ms"].iloc[0])


def scenario(setting: ParallelSetting, captures: dict, work: Path, links_file: Optional[Path] = None,
             cpu_speed: float = 1.0) -> Scenario:
    """The scenario a user would write for ``setting``, on ``links_file`` (default: the lab's
    calibration at its bandwidth, kept in ``work``); with ``cpu_speed`` other than 1, its host
    that much faster than at the capture (``optimizations: [faster-cpu=...]``: the lab's drift
    between the capture and the runs, ``lab.parallel.anchor_step``)."""
    bandwidth = LOOPBACK_MBPS if setting.bandwidth_mbps is None else setting.bandwidth_mbps
    parallelism = setting.parallelism()
    if "microbatch" in captures and isinstance(parallelism.get("pipeline"), dict):
        parallelism["pipeline"] = {**parallelism["pipeline"], "microbatch_trace": str(captures["microbatch"])}
    if "tensor_dispatch" in captures and parallelism.get("tensor", 1) > 1:
        parallelism["tensor_dispatch"] = dispatch_block(captures["tensor_dispatch"])
    if "fsdp_dispatch" in captures and parallelism.get("fsdp"):
        parallelism["fsdp_dispatch"] = dispatch_block(captures["fsdp_dispatch"])
    cluster = {"machines": setting.machines, "gpus_per_machine": setting.gpus_per_machine,
               "links": str(links_file or links(bandwidth, work))}
    cores = len({core for rank in range(setting.gpus_per_machine) for core in pin(setting.spec(), rank, box_cores())})
    if cores < setting.gpus_per_machine:
        cluster["cores_per_machine"] = cores
    doc = {
        "trace": str(captures["step"]),
        "cluster": cluster,
        "framework": "ddp",
        "parallelism": parallelism,
    }
    if cpu_speed != 1.0:
        doc["optimizations"] = [f"faster-cpu={cpu_speed:.6g}"]
    return Scenario.from_dict(doc, base_dir=work)
