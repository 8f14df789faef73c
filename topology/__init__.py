"""Clusters, collectives and the network they run on.

* ``units``: bandwidths, latencies and sizes as people write them, parsed in one place.
* ``cluster``: :class:`Link` and :class:`Cluster`, built from plain dicts and YAML presets.
"""

from .cluster import Cluster, Link, link_presets, load_cluster, preset_names
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
    "Cluster",
    "Link",
    "TopologyError",
    "as_gbps",
    "as_gigabytes_per_s",
    "gbps",
    "gigabytes_per_s",
    "link_presets",
    "load_cluster",
    "mbps",
    "parse_bandwidth",
    "parse_fraction",
    "parse_latency",
    "parse_size",
    "preset_names",
]
