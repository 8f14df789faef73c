"""The emulated cluster: machines as network namespaces, NICs shaped with tc, always cleaned up."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from trace_corpus import REPO
from whatif.lab import cluster
from whatif.lab.cluster import EmulatedCluster, LabError, LabSpec, run_job

can_run = pytest.mark.skipif(
    os.geteuid() != 0 or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0,
    reason="the lab needs root and network namespaces",
)
needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="real runs need torch (pip install torch==2.13.0)"
)

ALLREDUCE = """
import json, os, socket, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones({elements})
dist.all_reduce(t)
dist.barrier()
start = time.perf_counter()
for _ in range(3):
    dist.all_reduce(t)
seconds = (time.perf_counter() - start) / 3
out = os.environ["WHATIF_LAB_OUT"]
with open(f"{{out}}/rank{{dist.get_rank()}}.json", "w") as f:
    json.dump({{"host": socket.gethostname(), "seconds": seconds, "sum": float(t[0])}}, f)
dist.barrier()
dist.destroy_process_group()
"""


BUNDLED = REPO / "data" / "convnet_cpu.pt.trace.json.gz"


def namespaces() -> set:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


@can_run
@needs_torch
def test_a_shaped_link_gives_the_all_reduce_time_of_its_bandwidth(tmp_path):
    """Two machines at 100 Mbps: a 25 MB ring all-reduce sends 25 MB each way through each NIC,
    2 s at line rate; TCP over the token bucket delivers about 94 % of it."""
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE.format(elements=25_000_000 // 4))
    before = namespaces()
    result = run_job(LabSpec(2, 1, 100.0), "ddp", [sys.executable, str(script)], tmp_path / "out", timeout_s=240)
    assert result.exit_codes == [0, 0]
    reports = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert {r["host"] for r in reports} == {f"{cluster.tag_for(os.getpid())}-m0", f"{cluster.tag_for(os.getpid())}-m1"}
    assert all(r["sum"] == 2 ** 4 for r in reports), "four all-reduces of ones over two workers"
    line_rate_s = 25e6 / (100e6 / 8)
    # TCP over the token bucket delivers about 94 % of the rate; the bound leaves room for a busy box
    assert line_rate_s <= reports[0]["seconds"] <= line_rate_s / 0.7
    assert namespaces() == before, "every namespace the lab made is gone"
    assert not any(p.name.startswith(cluster.tag_for(os.getpid())) for p in _etc_netns())


@can_run
@needs_torch
def test_workers_of_one_machine_share_its_namespace_and_talk_over_loopback(tmp_path):
    """1 machine x 2 workers at a very low NIC rate: their all-reduce does not cross the NIC."""
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE.format(elements=25_000_000 // 4))
    run_job(LabSpec(1, 2, 1.0), "ddp", [sys.executable, str(script)], tmp_path / "out", timeout_s=240)
    report = json.loads((tmp_path / "out" / "rank0.json").read_text())
    assert report["seconds"] < 2.0, "25 MB at 1 Mbps would take 200 s"


@can_run
def test_the_lab_cleans_up_after_a_failing_worker(tmp_path):
    before = namespaces()
    result = run_job(LabSpec(2, 1, 100.0), "ddp", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path, 60)
    assert result.exit_codes == [3, 3]
    assert namespaces() == before


@can_run
def test_the_lab_cleans_up_after_a_timeout(tmp_path):
    before = namespaces()
    with pytest.raises(LabError, match="still running"):
        run_job(LabSpec(2, 1, 100.0), "ddp", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path, 2)
    assert namespaces() == before


def test_without_root_the_lab_refuses_with_a_clear_message(monkeypatch):
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(LabError, match="needs root"):
        with EmulatedCluster(LabSpec(2, 1, 100.0)):
            pass


@can_run
def test_a_latency_without_netem_is_refused_not_ignored(monkeypatch):
    monkeypatch.setattr(cluster, "_netem_available", lambda: False)
    with pytest.raises(LabError, match="sch_netem"):
        with EmulatedCluster(LabSpec(2, 1, 100.0, latency_ms=1.0)):
            pass


KILLED_LAB = """
import sys, time
from whatif.lab.cluster import EmulatedCluster, LabSpec
lab = EmulatedCluster(LabSpec(2, 1, 100.0)).__enter__()
lab.start(lab.workers()[0], ["sleep", "300"], {{}}, __import__("pathlib").Path("{log}"))
print(lab.tag, flush=True)
time.sleep(300)
"""


def _objects_named(tag: str) -> list:
    """Every namespace, link (host side) and /etc/netns entry whose name starts with ``tag``."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return sorted(
        [n for n in namespaces() if n.startswith(tag)]
        + [line.split(":")[1].strip() for line in links.splitlines() if line.split(":")[1].strip().startswith(tag)]
        + [p.name for p in _etc_netns() if p.name.startswith(tag)]
    )


@can_run
def test_lab_clean_removes_what_a_lab_killed_with_sigkill_left(tmp_path):
    """A lab killed with SIGKILL leaves its namespaces, a worker in one, and /etc/netns entries;
    they are all named from the one prefix and in the state file, and `whatif lab clean` removes
    every one of them (and the worker), leaving nothing with the prefix."""
    lab = subprocess.Popen([sys.executable, "-c", KILLED_LAB.format(log=tmp_path / "worker.log")],
                           stdout=subprocess.PIPE, text=True)
    tag = lab.stdout.readline().strip()
    assert tag == cluster.tag_for(lab.pid)
    assert len(_objects_named(tag)) >= 5, "switch and two machine namespaces, two /etc/netns entries"
    state = json.loads((cluster.STATE_DIR / f"{tag}.json").read_text())
    assert {name for _, name in state["created"]} >= {f"{tag}-sw", f"{tag}-m0", f"{tag}-m1"}
    worker = subprocess.run(["ip", "netns", "pids", f"{tag}-m0"], capture_output=True, text=True).stdout.split()
    assert worker, "the worker runs in machine 0's namespace"
    lab.kill()
    lab.wait()
    assert _objects_named(tag), "SIGKILL left the lab's objects behind"
    done = subprocess.run([sys.executable, "-m", "whatif.cli", "lab", "clean"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"removed netns {tag}-m0" in done.stdout
    assert _objects_named(tag) == []
    assert not (cluster.STATE_DIR / f"{tag}.json").exists()
    assert not any(os.path.exists(f"/proc/{pid}") and "sleep" in open(f"/proc/{pid}/cmdline").read() for pid in worker)


@can_run
def test_lab_clean_leaves_a_running_lab_alone():
    with EmulatedCluster(LabSpec(1, 1, 100.0)) as lab:
        cluster.clean()
        assert f"{lab.tag}-m0" in namespaces()
    assert not _objects_named(lab.tag)


def test_lab_clean_says_what_it_removes_and_what_it_leaves(capsys):
    from whatif.cli import main

    with pytest.raises(SystemExit):
        main(["lab", "clean", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"Every lab names what it creates {cluster.PREFIX}<its pid> and records it in {cluster.STATE_DIR}" in text
    assert "a lab whose process still runs is left alone" in text


def test_more_machines_than_cores_are_refused_naming_the_limit(monkeypatch):
    monkeypatch.setattr(cluster, "box_cores", lambda: 2)
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 0)
    with pytest.raises(LabError, match=r"--machines 3 is more than this box's 2 cores.*at most 2 machines"):
        cluster.check_can_run(LabSpec(3, 1, 100.0))


def _etc_netns():
    from pathlib import Path

    folder = Path("/etc/netns")
    return list(folder.iterdir()) if folder.is_dir() else []


def test_calibration_recovers_the_latency_and_efficiency_of_a_ring():
    """Times made from the ring's cost with L = 150 us and e = 0.9 at 200 Mbps fit back to them."""
    from whatif.lab.calibrate import fit_ring

    bandwidth = 200e6 / 8
    sizes = [64e3, 1e6, 4e6, 16e6, 32e6]
    n = 4
    seconds = [2 * (n - 1) * 150e-6 + 2 * (n - 1) / n * s / (0.9 * bandwidth) for s in sizes]
    fit = fit_ring(sizes, seconds, n, bandwidth)
    assert fit["latency_us"] == pytest.approx(150, rel=1e-6)
    assert fit["efficiency"] == pytest.approx(0.9, rel=1e-6)


def test_contention_is_the_busy_to_idle_ratio_of_each_large_all_reduce_and_the_lost_compute_rate():
    """Sizes under 1 MB are latency and left out; a busy run measured faster than an idle one
    is noise, not a speed-up, and gives 1."""
    from whatif.lab.calibrate import fit_contention

    measured = {"sizes_bytes": [64e3, 4e6, 16e6, 32e6], "seconds": [0.01, 0.1, 0.4, 0.8],
                "seconds_busy": [0.05, 0.09, 0.6, 1.6], "compute_rate_alone": 1000.0, "compute_rate_during_comm": 800.0}
    assert fit_contention(measured) == {"comm": {"4MB": 1.0, "16MB": pytest.approx(1.5), "32MB": pytest.approx(2.0)},
                                        "compute": pytest.approx(1.25)}
    quiet = {**measured, "seconds_busy": [0.01, 0.09, 0.39, 0.79], "compute_rate_during_comm": 1100.0}
    assert fit_contention(quiet) == {"comm": {"4MB": 1.0, "16MB": 1.0, "32MB": 1.0}, "compute": 1.0}


def test_calibrate_writes_links_a_scenario_can_use(tmp_path):
    from whatif.lab.calibrate import calibrate
    from whatif.scenario import Scenario

    links = tmp_path / "lab.yaml"
    doc = calibrate(200.0, links, tmp_path / "work")
    assert 0.85 <= doc["inter_node"]["efficiency"] <= 1.0, "TCP through tbf delivers most of the rate"
    scenario = tmp_path / "s.yaml"
    scenario.write_text(
        "trace: " + str(BUNDLED) + "\n"
        "cluster: {machines: 2, gpus_per_machine: 1, links: lab.yaml, inter_node: {bandwidth: [100Mbps, 400Mbps]}}\n"
    )
    points = Scenario.from_file(scenario).points
    assert [round(p.inter_node_gbps, 3) for p in points] == [0.1, 0.4]
    assert all(p.cluster.inter_node.efficiency == doc["inter_node"]["efficiency"] for p in points)
    contention = doc["inter_node"]["cpu_contention"]
    assert set(contention["comm"]) == {"1MB", "4MB", "16MB", "32MB", "64MB"}, "measured by size, above latency"
    at_sizes = [1e6, 4e6, 16e6, 32e6, 64e6]
    assert all(p.cluster.inter_node.comm_slowdown_at(at_sizes).tolist() == list(contention["comm"].values())
               for p in points)
    assert min(contention["comm"].values()) >= 1
    horovod = importlib.util.find_spec("horovod") is not None
    loop = {"horovod_loop"} if horovod else set()
    assert set(doc["intra_node"]["cpu_contention"]) == {"comm", "compute"} | loop, "loopback is calibrated busy too"
    if horovod:
        assert all(0 < p.cluster.inter_node.framework_loop_us("horovod") < 5000 for p in points), "a part of every 5 ms cycle"
    assert all(p.cluster.workers_sharing_memory == 2 for p in points), "the lab's machines share one box's memory"
    assert all(p.cluster.shared_memory.memory_slowdown(2) >= 1 for p in points)
    assert len(doc["runs"]) == 3, "each run's own links are kept, for the prediction interval"
    assert all(len(p.calibrations) == 3 for p in points)
    assert list(doc)[:2] == ["name", "calibrated"] and doc["calibrated"]["cores"] >= 1
    from whatif.lab.validate import stale_links
    assert stale_links(links) is None, "calibrated today, on this box"


def test_kept_links_of_another_day_or_of_no_day_are_named_stale(tmp_path):
    from whatif.lab.validate import stale_links

    links = tmp_path / "links_1000mbps.yaml"
    links.write_text("name: lab\ncalibrated: {date: 2026-11-28, cpu: x, cores: 2}\nintra_node: {}\ninter_node: {}\n")
    assert stale_links(links, today="2026-11-28") is None
    assert f"{links} was calibrated on 2026-11-28, not today" in stale_links(links, today="2026-12-03")
    links.write_text("name: lab\nintra_node: {}\ninter_node: {}\n")
    assert "carries no calibration date" in stale_links(links, today="2026-12-03")
    links.write_text("name: [unclosed\n")
    assert stale_links(links).endswith("unreadable; delete it to calibrate again")


@can_run
def test_validate_refuses_a_latency_without_netem_before_any_capture(monkeypatch, tmp_path):
    """`whatif validate --latency 2ms` on a kernel without sch_netem: refused at once, not after
    minutes of captures and calibration."""
    from whatif.lab import validate

    monkeypatch.setattr(cluster, "_netem_available", lambda: False)
    monkeypatch.setattr(validate, "capture", lambda *a, **k: pytest.fail("captured before checking the latency"))
    with pytest.raises(LabError, match="sch_netem"):
        validate.validate("convnet", 2, 1, 200.0, "horovod", tmp_path, latency_ms=2.0)
