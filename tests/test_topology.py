"""Specification of units, link presets and cluster descriptions (``whatif.topology``)."""

import pytest
import yaml

from whatif.topology import (
    Cluster,
    Link,
    TopologyError,
    as_gbps,
    gbps,
    gigabytes_per_s,
    link_presets,
    load_cluster,
    mbps,
    parse_bandwidth,
    parse_fraction,
    parse_latency,
    parse_size,
    preset_names,
)


def error_of(call, *args, **kwargs) -> str:
    with pytest.raises(TopologyError) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, "errors are one line"
    return message


# -- units ---------------------------------------------------------------------------------------


class TestBandwidth:
    @pytest.mark.parametrize(
        "text, gigabits",
        [
            ("10Gbps", 10),
            ("10 Gbps", 10),
            ("10 Gb/s", 10),
            ("10gbps", 10),
            ("10 Gbit/s", 10),
            ("25GbE", 25),
            ("25 GbE", 25),
            ("100GbE", 100),
            ("100 Mbps", 0.1),
            ("100Mb/s", 0.1),
            ("1.5 Tbps", 1500),
            ("1e1 Gbps", 10),
        ],
    )
    def test_bits_per_second(self, text, gigabits):
        assert parse_bandwidth(text) == pytest.approx(gbps(gigabits))

    @pytest.mark.parametrize(
        "text, gigabytes",
        [("25 GB/s", 25), ("12.5GB/s", 12.5), ("900 GB/s", 900), ("15.75GB/s", 15.75), ("500 MB/s", 0.5), ("1 GBps", 1)],
    )
    def test_bytes_per_second(self, text, gigabytes):
        assert parse_bandwidth(text) == pytest.approx(gigabytes_per_s(gigabytes))

    def test_lowercase_b_is_bits_and_uppercase_B_is_bytes(self):
        assert parse_bandwidth("8Gbps") == parse_bandwidth("1GB/s")
        assert parse_bandwidth("10Gb/s") == parse_bandwidth("1.25GB/s")

    def test_binary_prefixes(self):
        assert parse_bandwidth("1 GiB/s") == pytest.approx(2**30 / 1e6)

    def test_internal_unit_is_bytes_per_microsecond(self):
        assert gbps(10) == 1250.0  # 10e9 bits/s = 1.25e9 bytes/s = 1250 bytes/us
        assert mbps(100) == 12.5
        assert gigabytes_per_s(1) == 1000.0
        assert as_gbps(gbps(25)) == pytest.approx(25)

    def test_a_bandwidth_needs_a_unit(self):
        message = error_of(parse_bandwidth, "10", "inter_node.bandwidth")
        assert message == "inter_node.bandwidth: '10' has no unit; write e.g. 10Gbps"

    @pytest.mark.parametrize("value", [10, 10.0, " 10 ", "1e1"])
    def test_numbers_without_unit_are_refused_however_written(self, value):
        assert "has no unit; write e.g. 10Gbps" in error_of(parse_bandwidth, value, "inter_node.bandwidth")

    @pytest.mark.parametrize("value", ["0Gbps", "-10Gbps", "0 GB/s"])
    def test_a_bandwidth_must_be_positive(self, value):
        assert "must be positive" in error_of(parse_bandwidth, value, "inter_node.bandwidth")

    def test_an_unknown_unit_is_named_with_suggestions(self):
        message = error_of(parse_bandwidth, "10Gbs", "inter_node.bandwidth")
        assert message.startswith("inter_node.bandwidth: unknown unit 'Gbs'")
        assert "Gbps" in message

    @pytest.mark.parametrize("value", ["fast", "", None, True, [10]])
    def test_not_a_quantity(self, value):
        assert error_of(parse_bandwidth, value, "bw").startswith("bw: ")


class TestLatency:
    @pytest.mark.parametrize(
        "text, microseconds",
        [
            ("5us", 5),
            ("5 us", 5),
            ("5 µs", 5),  # micro sign
            ("5μs", 5),  # Greek mu
            ("1ms", 1000),
            ("2.5 ms", 2500),
            ("100ns", 0.1),
            ("0.001s", 1000),
            ("0", 0),
            (0, 0),
            (0.0, 0),
            ("0us", 0),
        ],
    )
    def test_forms(self, text, microseconds):
        assert parse_latency(text) == pytest.approx(microseconds)

    def test_only_zero_may_omit_the_unit(self):
        assert error_of(parse_latency, "5", "inter_node.latency") == "inter_node.latency: '5' has no unit; write e.g. 5us"

    def test_a_latency_must_not_be_negative(self):
        assert "must not be negative" in error_of(parse_latency, "-1us", "inter_node.latency")

    def test_unknown_unit(self):
        assert error_of(parse_latency, "5 fortnights", "latency").startswith("latency: unknown unit 'fortnights'")


class TestSize:
    @pytest.mark.parametrize(
        "text, nbytes",
        [("25MB", 25e6), ("64 MiB", 64 * 2**20), ("1.5 GB", 1.5e9), ("100 B", 100), ("8Mb", 1e6), (4096, 4096)],
    )
    def test_forms(self, text, nbytes):
        assert parse_size(text) == pytest.approx(nbytes)

    def test_errors(self):
        assert "unknown unit" in error_of(parse_size, "25 MBps", "bucket")
        assert "must not be negative" in error_of(parse_size, "-1MB", "bucket")


def test_fractions():
    assert parse_fraction(0.9) == 0.9
    assert parse_fraction("90%") == pytest.approx(0.9)
    assert parse_fraction(1) == 1.0
    for bad in (0, 1.5, -0.1, "high"):
        assert error_of(parse_fraction, bad, "inter_node.efficiency").startswith("inter_node.efficiency: ")


# -- presets -------------------------------------------------------------------------------------


class TestPresets:
    def test_the_nics_and_intra_node_links_the_issue_asks_for(self):
        assert set(preset_names("inter_node")) >= {"10gbe", "20gbe", "25gbe", "40gbe", "100gbe"}
        assert set(preset_names("intra_node")) >= {"pcie3", "pcie4", "nvlink2", "nvlink3"}

    @pytest.mark.parametrize("name, gigabits", [("10gbe", 10), ("20gbe", 20), ("25gbe", 25), ("40gbe", 40), ("100gbe", 100)])
    def test_nic_line_rates(self, name, gigabits):
        nic = link_presets()["inter_node"][name]
        assert nic.bandwidth_bytes_per_us == pytest.approx(gbps(gigabits))
        assert 0.9 <= nic.efficiency <= 1.0
        assert nic.latency_us > 0

    @pytest.mark.parametrize(
        "name, effective_gigabytes",
        [("pcie3", 12), ("pcie4", 24), ("nvlink2", 120), ("nvlink3", 240)],
    )
    def test_intra_node_effective_bandwidths(self, name, effective_gigabytes):
        link = link_presets()["intra_node"][name]
        assert link.effective_bandwidth_bytes_per_us == pytest.approx(gigabytes_per_s(effective_gigabytes), rel=0.02)

    def test_nvlink2_is_150_GB_per_s_per_direction(self):
        assert link_presets()["intra_node"]["nvlink2"].bandwidth_bytes_per_us == gigabytes_per_s(150)

    @pytest.mark.parametrize("spelling", ["25GbE", "25gbe", "25-GbE", "25 GBE"])
    def test_names_ignore_case_and_separators(self, spelling):
        assert Link.from_config(spelling, "inter_node", "inter_node").name == "25gbe"

    def test_a_preset_with_overrides(self):
        link = Link.from_config({"preset": "25GbE", "efficiency": 0.8, "latency": "20us"}, "inter_node", "inter_node")
        assert link.bandwidth_bytes_per_us == gbps(25)
        assert (link.efficiency, link.latency_us) == (0.8, 20.0)
        assert link.name == "25gbe*"

    def test_a_custom_link(self):
        link = Link.from_config({"bandwidth": "10 Gb/s", "latency": "5 µs"}, "inter_node", "inter_node")
        assert link == Link(gbps(10), 5.0, 1.0)
        assert link.transfer_time_us(1250) == pytest.approx(6.0)


# -- clusters ------------------------------------------------------------------------------------

CONFIG = {"machines": 4, "gpus_per_machine": 8, "intra_node": "nvlink2", "inter_node": "25GbE"}


class TestCluster:
    def test_from_a_dict(self):
        cluster = Cluster.from_config(CONFIG)
        assert (cluster.machines, cluster.gpus_per_machine, cluster.n_gpus) == (4, 8, 32)
        assert cluster.intra_node == link_presets()["intra_node"]["nvlink2"]
        assert cluster.inter_node == link_presets()["inter_node"]["25gbe"]
        assert "4 x 8 GPUs" in cluster.describe()

    def test_gpus_are_numbered_machine_by_machine_and_each_machine_has_a_host(self):
        cluster = Cluster.from_config({**CONFIG, "server_machines": 2})
        assert cluster.machine_of(0) == 0 and cluster.machine_of(7) == 0 and cluster.machine_of(8) == 1
        assert list(cluster.gpus_of(1)) == list(range(8, 16))
        assert cluster.host(0) == 32 and cluster.machine_of(cluster.host(3)) == 3
        assert cluster.machine_of(cluster.host(5)) == 5  # a server machine
        assert cluster.n_endpoints == 32 + 6
        assert cluster.link_between(0, 7) is cluster.intra_node
        assert cluster.link_between(7, 8) is cluster.inter_node

    def test_from_a_yaml_file(self, tmp_path):
        path = tmp_path / "scenario.yaml"
        path.write_text(yaml.safe_dump({"cluster": {**CONFIG, "inter_node": {"preset": "10gbe", "efficiency": "90%"}}}))
        cluster = load_cluster(path, key="cluster")
        assert cluster.inter_node.efficiency == pytest.approx(0.9)

    @pytest.mark.parametrize(
        "change, key, words",
        [
            ({"machines": 0}, "machines", "must be positive"),
            ({"machines": -2}, "machines", "must be positive"),
            ({"machines": 2.5}, "machines", "whole number"),
            ({"gpus_per_machine": 0}, "gpus_per_machine", "must be positive"),
            ({"server_machines": -1}, "server_machines", "at least 0"),
            ({"inter_node": "25gbps"}, "inter_node", "unknown preset '25gbps'; did you mean 25gbe"),
            ({"inter_node": "nvlink3"}, "inter_node", "'nvlink3' is an intra_node link"),
            ({"intra_node": "pcie5"}, "intra_node", "did you mean pcie4"),
            ({"intra_node": "nvlnk2"}, "intra_node", "did you mean nvlink2"),
            ({"inter_node": {"preset": "25gbe", "efficiency": 0}}, "inter_node.efficiency", "(0, 1]"),
            ({"inter_node": {"preset": "25gbe", "efficiency": 1.2}}, "inter_node.efficiency", "(0, 1]"),
            ({"inter_node": {"bandwidth": "10", "latency": "5us"}}, "inter_node.bandwidth", "has no unit"),
            ({"inter_node": {"bandwidth": "10Gbps"}}, "inter_node.latency", "missing"),
            ({"inter_node": {"bandwidth": "-5Gbps"}}, "inter_node.bandwidth", "must be positive"),  # before the latency
            ({"inter_node": {"bandwith": "10Gbps"}}, "inter_node.bandwith", "did you mean 'bandwidth'"),
            ({"inter_node": {"preset": "25gbe", "latency": "-1us"}}, "inter_node.latency", "must not be negative"),
            ({"gpus_per_mashine": 8}, "gpus_per_mashine", "did you mean 'gpus_per_machine'"),
        ],
    )
    def test_errors_name_the_key(self, change, key, words):
        config = {**CONFIG, **change}
        message = error_of(Cluster.from_config, config)
        assert message.startswith(f"{key}: "), message
        assert words in message, message

    def test_missing_keys_are_named_with_an_example(self):
        config = dict(CONFIG)
        del config["inter_node"]
        assert error_of(Cluster.from_config, config).startswith("inter_node: missing; write e.g. inter_node: 25gbe")

    def test_a_bare_bandwidth_is_not_a_preset_but_the_error_says_how_to_write_it(self):
        message = error_of(Cluster.from_config, {**CONFIG, "inter_node": "40Gbps"})
        assert "{bandwidth: 40Gbps, latency: 10us}" in message

    def test_nested_errors_carry_the_prefix(self):
        assert error_of(Cluster.from_config, {**CONFIG, "machines": 0}, key="cluster").startswith("cluster.machines: ")

    def test_links_validate_numbers_too(self):
        assert error_of(Link, 0.0, 1.0).startswith("bandwidth_bytes_per_us: ")
        assert error_of(Link, 1.0, -1.0).startswith("latency_us: ")
        assert error_of(Link, 1.0, 1.0, 0.0).startswith("efficiency: ")
