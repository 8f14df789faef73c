"""Clusters, collectives and the network they run on.

* ``units``: bandwidths, latencies and sizes as people write them, parsed in one place.
* ``yamlfile``: a user's YAML file (a cluster, its links, a scenario) read within bounds.
* ``cluster``: :class:`Link` and :class:`Cluster`, built from plain dicts and YAML presets.
* ``plan``: a collective as steps of concurrent transfers.
* ``collectives``: ring, hierarchical and parameter-server all-reduce and Gloo's other
  collectives on the two links, as plans and closed forms.
* ``network``: a SimPy model of links shared max-min fairly, which times plans and transfers.
* ``fabric``: GPU machines, NVLink domains, NICs and network tiers, from YAML presets.
* ``nccl``: NCCL's algorithms, protocols and choice; ``nccl_tests`` reads nccl-tests' output and
  ``calibrate`` fits a fabric to it.
* ``cost``: what a collective costs and the plan it runs, by op, priced by NCCL's models or
  the links' (Gloo's): the interface ``sim`` prices communication through (with ``Network``
  for links shared among collectives).
"""

from .cluster import CLUSTER_KEYS, Cluster, Link, SharedMemory, link_presets, load_cluster, preset_names, with_fabric_links
from .cost import COLLECTIVE_OPS, CollectiveCost, collective_cost, collective_plan
from .collectives import (
    ALGORITHMS,
    GLOO_OPS,
    allreduce_time_us,
    gloo_time_us,
    hierarchical_allreduce_time_us,
    parameter_server_time_us,
    plan_allreduce,
    plan_gloo,
    plan_hierarchical_allreduce,
    plan_parameter_server,
    plan_ring_allreduce,
    ring_allreduce_time_us,
    server_hosts,
)
from .fabric import Calibration, Fabric, Gpu, Nic
from .network import Network, fair_rates, simulate_plan
from .plan import NicTraffic, Plan, Step, nic_traffic
from .units import (
    TopologyError,
    as_gbps,
    as_gigabytes_per_s,
    gbps,
    gigabytes_per_s,
    mbps,
    parse_bandwidth,
    parse_fraction,
    parse_latency,
    parse_size,
)

__all__ = [
    "ALGORITHMS",
    "CLUSTER_KEYS",
    "COLLECTIVE_OPS",
    "GLOO_OPS",
    "Calibration",
    "Cluster",
    "CollectiveCost",
    "Fabric",
    "Gpu",
    "Nic",
    "Link",
    "SharedMemory",
    "Network",
    "NicTraffic",
    "Plan",
    "Step",
    "TopologyError",
    "allreduce_time_us",
    "as_gbps",
    "as_gigabytes_per_s",
    "collective_cost",
    "collective_plan",
    "fair_rates",
    "gloo_time_us",
    "gbps",
    "gigabytes_per_s",
    "hierarchical_allreduce_time_us",
    "link_presets",
    "load_cluster",
    "mbps",
    "nic_traffic",
    "parameter_server_time_us",
    "parse_bandwidth",
    "parse_fraction",
    "parse_latency",
    "parse_size",
    "plan_allreduce",
    "plan_gloo",
    "plan_hierarchical_allreduce",
    "plan_parameter_server",
    "plan_ring_allreduce",
    "preset_names",
    "ring_allreduce_time_us",
    "server_hosts",
    "simulate_plan",
    "with_fabric_links",
]
