"""Specification of GPU fabrics as data, and of which backend prices a cluster."""

import glob
from pathlib import Path

import numpy as np
import pytest

from whatif.topology import (
    Cluster,
    TopologyError,
    allreduce_time_us,
    collective_cost,
    collective_plan,
    load_cluster,
    parameter_server_time_us,
    plan_allreduce,
    simulate_plan,
)
from whatif.topology.fabric import preset_names
from whatif.topology.nccl.graphs import Comm

REPO = Path(__file__).resolve().parent.parent
MB = 1e6


def test_a_dgx_h100_cluster_is_one_line():
    cluster = Cluster.from_config({"machine": "dgx_h100", "machines": 16})
    fabric = cluster.fabric
    assert (cluster.machines, cluster.gpus_per_machine, cluster.n_gpus) == (16, 8, 128)
    assert (fabric.gpu.name, fabric.nics_per_machine, fabric.nic.name, fabric.nvlink_domain) == ("h100", 8, "ib_ndr", 8)
    assert cluster.backend == "nccl"


@pytest.mark.parametrize("machine", preset_names("machines"))
def test_every_machine_preset_builds_a_cluster_that_prices_an_all_reduce(machine):
    per_machine = Cluster.from_config({"machine": machine, "machines": 1}).gpus_per_machine
    machines = 72 // per_machine if machine == "gb200_nvl72" else 2
    cluster = Cluster.from_config({"machine": machine, "machines": machines})
    cost = collective_cost(cluster, "all_reduce", 64 * MB)
    assert cost.time_us > 0 and cost.channels >= 1


@pytest.mark.parametrize("machine", preset_names("machines"))
def test_a_communicator_counts_each_nodes_rails_as_device_of_assigns_them(machine):
    """``Comm.of`` finds the fewest network devices the ranks of a node are rail-assigned to
    for all ranks at once; held against ``Fabric.device_of`` rank by rank, node by node, on
    random groups of ranks of every machine preset (some have fewer NICs than GPUs)."""
    rng = np.random.default_rng(0)
    for machines in (1, 3, 18):
        fabric = Cluster.from_config({"machine": machine, "machines": machines}).fabric
        for _ in range(10):
            ids = np.sort(rng.choice(fabric.n_gpus, size=int(rng.integers(1, fabric.n_gpus + 1)), replace=False))
            nodes = ids // fabric.node_size
            fewest = min(len({fabric.device_of(int(g)) for g in ids[nodes == node]}) for node in np.unique(nodes))
            assert Comm.of(fabric, ids.tolist()).node_nics == fewest


def test_a_machine_used_with_fewer_gpus_keeps_its_nvlink_domain_to_them():
    """``machine: dgx_h100, gpus_per_machine: 1`` is one GPU of each machine: its NVLink domain
    is that GPU, so the GPUs of four machines talk over the network (one rail NIC each, about
    48 GB/s), not over NVLink as if the four were one machine. A rack's domain, which spans its
    trays, stays; an nvlink_domain given wins."""
    one = Cluster.from_config({"machine": "dgx_h100", "machines": 4, "gpus_per_machine": 1})
    assert one.fabric.nvlink_domain == 1
    cost = collective_cost(one, "all_gather", 256 * MB)
    assert cost.algorithm == "ring" and cost.time_us > 256 * MB * 3 / 4 / 50e3  # bus bandwidth under one NIC's 50 GB/s
    assert Cluster.from_config({"machine": "dgx_h100", "machines": 2, "gpus_per_machine": 2}).fabric.nvlink_domain == 2
    assert Cluster.from_config({"machine": "gb200_nvl72", "machines": 36, "gpus_per_machine": 2}).fabric.nvlink_domain == 72
    given = Cluster.from_config({"machine": "dgx_h100", "machines": 2, "gpus_per_machine": 2, "nvlink_domain": 4})
    assert given.fabric.nvlink_domain == 4


def test_a_gb200_nvl72_rack_is_one_nvlink_domain_across_eighteen_trays():
    rack = Cluster.from_config({"machine": "gb200_nvl72", "machines": 18})
    assert rack.fabric.node_size == 72 and rack.fabric.node_of(71) == 0
    two = Cluster.from_config({"machine": "gb200_nvl72", "machines": 36})
    assert two.fabric.node_of(72) == 1
    one_rack = collective_cost(rack, "all_reduce", 1e9)
    across = collective_cost(two, "all_reduce", 1e9)
    assert across.time_us > one_rack.time_us  # the second rack is reached over InfiniBand


def test_machine_keys_can_be_overridden_and_links_follow_the_nics():
    cluster = Cluster.from_config({"machine": "dgx_h100", "machines": 2, "nics_per_machine": 4,
                                   "nic": {"preset": "roce_400", "efficiency": 0.9}})
    assert cluster.fabric.nic.transport == "roce" and cluster.fabric.nic.efficiency == 0.9
    # the single-NIC model of cluster.py sees a machine's NICs together
    assert cluster.inter_node.bandwidth_bytes_per_us == pytest.approx(4 * 400e9 / 8 / 1e6)


@pytest.mark.parametrize(
    "config, key",
    [
        ({"machine": "dgx_h900", "machines": 2}, "machine"),
        ({"machine": "dgx_h100", "machines": 2, "nic": "ib_qdr"}, "nic.preset"),
        ({"machine": "dgx_h100", "machines": 2, "nvlink_domain": 3}, "nvlink_domain"),
        ({"machine": "gb200_nvl72", "machines": 5, "nvlink_domain": 6}, "nvlink_domain"),
        ({"gpu": "h100", "machines": 2, "gpus_per_machine": 8, "network": {"oversubscription": 0.5}},
         "network.oversubscription"),
        ({"machine": "dgx_h100", "machines": 2, "backend": "mpi"}, "backend"),
        ({"machine": "dgx_h100", "machines": 2, "nccl": {"net": {"ring/fast": {"bandwidth": 0.9}}}}, "nccl.net.ring/fast"),
        ({"machines": 2, "gpus_per_machine": 8, "nvswitch": True}, "gpu"),
    ],
)
def test_a_bad_fabric_is_one_line_naming_its_key(config, key):
    with pytest.raises(TopologyError) as err:
        Cluster.from_config(config)
    assert err.value.key.startswith(key) and "\n" not in str(err.value)


# -- which backend -------------------------------------------------------------------------------


def test_todays_descriptions_keep_the_gloo_backend_and_an_nccl_one_can_be_asked_for():
    old = {"machines": 2, "gpus_per_machine": 2, "intra_node": "nvlink2", "inter_node": "25gbe"}
    assert Cluster.from_config(old).backend == "gloo"
    asked = Cluster.from_config({**old, "backend": "nccl"})
    assert asked.backend == "nccl" and asked.fabric.gpu.name == "v100" and asked.fabric.nic.transport == "socket"
    assert Cluster.from_config({"machine": "dgx_a100", "machines": 2, "backend": "gloo"}).backend == "gloo"


LAB_FILES = sorted(glob.glob(str(REPO / "docs" / "validation" / "fresh" / "*.yaml")))
OLD_CLUSTERS = [
    {"machines": m, "gpus_per_machine": g, "intra_node": intra, "inter_node": inter}
    for m, g in ((1, 2), (2, 1), (4, 2), (3, 4))
    for intra, inter in (("nvlink2", "10gbe"), ("pcie3", {"bandwidth": "1Gbps", "latency": "30us", "efficiency": 0.9}))
]


@pytest.mark.parametrize("config", OLD_CLUSTERS)
def test_the_gloo_backend_is_todays_closed_forms_and_plans_bit_for_bit(config):
    cluster = Cluster.from_config(config)
    for size in (1e3, 4 * MB, 75.6 * MB):
        for algorithm in ("ring", "hierarchical"):
            cost = collective_cost(cluster, "all_reduce", size, algorithm=algorithm)
            assert cost.time_us == allreduce_time_us(cluster, size, algorithm)
            assert (cost.protocol, cost.channels) == ("tcp", 1)
        plan, today = collective_plan(cluster, "all_reduce", size), plan_allreduce(cluster, size)
        assert [(s.src.tolist(), s.dst.tolist(), s.nbytes.tolist()) for s in plan.steps] == \
               [(s.src.tolist(), s.dst.tolist(), s.nbytes.tolist()) for s in today.steps]
    push, pull = (collective_cost(cluster, op, MB).time_us for op in ("push", "pull"))
    assert push == pull == parameter_server_time_us(cluster, MB) / 2


@pytest.mark.parametrize("path", LAB_FILES, ids=[Path(p).name for p in LAB_FILES])
def test_the_labs_calibrated_links_load_as_gloo_and_give_todays_numbers(path):
    from whatif.topology.cluster import Link

    import yaml

    links = yaml.safe_load(Path(path).read_text())
    cluster = Cluster(2, 2, Link.from_config(links["intra_node"], "intra_node", "intra_node"),
                      Link.from_config(links["inter_node"], "inter_node", "inter_node"))
    assert cluster.backend == "gloo"
    for size in (64e3, 16 * MB):
        assert collective_cost(cluster, "all_reduce", size).time_us == allreduce_time_us(cluster, size)


def test_a_gloo_cluster_prices_every_operation_on_its_links():
    cluster = Cluster.from_config({"machines": 2, "gpus_per_machine": 2, "intra_node": "pcie3", "inter_node": "10gbe"})
    nic = cluster.inter_node
    step = nic.latency_us + (4 * MB / 4) / nic.effective_bandwidth_bytes_per_us
    assert collective_cost(cluster, "all_gather", 4 * MB).time_us == pytest.approx(3 * step)
    send = nic.latency_us + 4 * MB / nic.effective_bandwidth_bytes_per_us
    assert collective_cost(cluster, "send_recv", 4 * MB).time_us == pytest.approx(send)
    for op in ("reduce_scatter", "broadcast", "reduce", "all_to_all"):
        plan = collective_plan(cluster, op, 4 * MB)
        assert simulate_plan(plan, cluster) > 0


def test_a_cluster_file_with_a_machine_loads_from_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cluster:\n  machine: dgx_b200\n  machines: 4\n")
    assert load_cluster(path, "cluster").fabric.gpu.name == "b200"


def test_a_factor_kept_to_a_node_count_applies_there_before_one_for_any_and_round_trips():
    from whatif.topology.fabric import Calibration

    config = {"net": {"tree/simple@2": {"bandwidth": 0.5}, "tree/simple": {"bandwidth": 0.8},
                      "ring/simple@3+": {"latency": 2.0}}}
    calibration = Calibration.from_config(config, "nccl")
    assert calibration.factors_for("net", "tree", "simple", 2) == (0.5, 1.0)
    assert calibration.factors_for("net", "tree", "simple", 16) == (0.8, 1.0)
    assert calibration.factors_for("net", "ring", "simple", 2) == (1.0, 1.0)
    assert calibration.factors_for("net", "ring", "simple", 4) == (1.0, 2.0)
    assert Calibration.from_config(calibration.as_config(), "nccl") == calibration
    with pytest.raises(TopologyError, match=r"nccl\.net\.tree/simple@4"):
        Calibration.from_config({"net": {"tree/simple@4": {"bandwidth": 0.5}}}, "nccl")


def test_a_memory_variant_of_the_traced_gpu_needs_no_note_that_its_kernels_keep_their_times():
    """An A100 80 GB trace on AWS p4d (A100 40 GB, preset ``a100_40gb``): the same chip, so no
    note that the kernels keep their traced times; on DGX H100s the note stays."""
    from whatif.pipeline import clusters_gpu_note
    from whatif.topology.fabric import gpu_chip

    assert gpu_chip("a100_40gb") == gpu_chip("a100") == "a100" and gpu_chip("h100") == "h100"
    traced = [{"name": "NVIDIA A100-SXM4-80GB"}]
    p4d = Cluster.from_config({"machine": "p4d", "machines": 2})
    h100 = Cluster.from_config({"machine": "dgx_h100", "machines": 2})
    assert clusters_gpu_note(traced, [p4d], []) == ""
    assert "on the clusters' h100 GPUs its kernels keep their traced times" in clusters_gpu_note(traced, [p4d, h100], [])
