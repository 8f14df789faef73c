"""An emulated cluster on one box: machines as network namespaces, NICs shaped with ``tc``.

Each machine is a network namespace with one veth "NIC" plugged into a bridge that lives in a
switch namespace of its own, so nothing touches the host's network. Both directions of every NIC
are shaped with a token bucket (``tc tbf``) to the chosen bandwidth: the machine side shapes
what it sends, the switch side what it receives, as a full-duplex link. The G workers of a
machine share its namespace and talk over its loopback, so intra-machine traffic stays fast.
Each worker runs in a UTS namespace of its own whose hostname is its machine's name, with
``/etc/netns/<namespace>/hosts`` mapping every machine name to its address: Gloo resolves the
local hostname to find the interface to use.

Latency: the kernels this was built on have no ``sch_netem``, so a latency can be asked for only
where ``tc qdisc ... netem`` works; otherwise the lab refuses a non-zero ``--latency`` instead of
quietly ignoring it (the veth path itself has a few tens of microseconds, which calibration
measures).

Everything created is removed on leaving the context, on success, error, Ctrl-C or timeout.
Every namespace, veth and ``/etc/netns`` entry is named ``wfl<pid>...`` (:data:`PREFIX` and the
creating process's id, so that concurrent labs never collide) and written to a state file,
``/run/whatif-lab/wfl<pid>.json`` (:data:`STATE_DIR`), before it is made. A lab killed with
SIGKILL cannot clean up after itself; ``whatif lab clean`` (:func:`clean`) removes what every
lab whose process is gone left behind, from the state files and from the names themselves.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence


class LabError(Exception):
    """The lab cannot run here or as asked; the message is one line."""


#: what every namespace, veth, bridge port and ``/etc/netns`` entry of the lab is named from,
#: followed by the creating process's id (an interface name has at most 15 characters)
PREFIX = "wfl"
#: where each running lab records what it creates, one JSON file per lab (``WHATIF_LAB_STATE``)
STATE_DIR = Path(os.environ.get("WHATIF_LAB_STATE", "/run/whatif-lab"))
ETC_NETNS = Path("/etc/netns")


def progress(message: str) -> None:
    """One line on stderr saying what the lab is doing now, with the time of day: calibration and
    validation run for minutes."""
    print(f"[{time.strftime('%H:%M:%S')}] lab: {message}", file=sys.stderr, flush=True)


def tag_for(pid: int) -> str:
    """The name every object of the lab run by process ``pid`` starts with."""
    return f"{PREFIX}{pid}"


@dataclass(frozen=True)
class LabSpec:
    machines: int
    gpus_per_machine: int
    bandwidth_mbit: float
    latency_ms: float = 0.0
    threads_per_worker: int = 1

    @property
    def workers(self) -> int:
        return self.machines * self.gpus_per_machine


@dataclass
class Worker:
    rank: int
    machine: int
    local_rank: int
    cores: Optional[list] = None


@dataclass
class EmulatedCluster:
    """Namespaces, veths, bridge and shaping for ``spec``; use as a context manager."""

    spec: LabSpec
    tag: str = field(default_factory=lambda: tag_for(os.getpid()))
    created: list = field(default_factory=list)
    processes: list = field(default_factory=list)

    # -- names -----------------------------------------------------------------------------------

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    def namespace(self, machine: int) -> str:
        return f"{self.tag}-m{machine}"

    def hostname(self, machine: int) -> str:
        return f"{self.tag}-m{machine}"

    def nic(self, machine: int) -> str:
        return f"{self.tag}n{machine}"

    def address(self, machine: int) -> str:
        return f"10.{200 + (os.getpid() % 50)}.0.{machine + 1}"

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> "EmulatedCluster":
        check_can_run(self.spec)
        self._previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
        for s in self._previous:
            signal.signal(s, _raise_interrupt)
        try:
            self._build()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.processes:
            _kill_group(proc)
        _remove(reversed(self.created))
        self.created.clear()
        self.state_file.unlink(missing_ok=True)
        for s, handler in getattr(self, "_previous", {}).items():
            signal.signal(s, handler)

    def _build(self) -> None:
        spec = self.spec
        self._netns(self.switch)
        _ip(self.switch, "link", "add", "br0", "type", "bridge")
        _ip(self.switch, "link", "set", "br0", "up")
        names = [(self.hostname(m), self.address(m)) for m in range(spec.machines)]
        for m in range(spec.machines):
            ns, nic, port = self.namespace(m), self.nic(m), f"{self.tag}p{m}"
            self._netns(ns)
            self._record("link", nic)
            _run(["ip", "link", "add", nic, "type", "veth", "peer", "name", port])
            _run(["ip", "link", "set", nic, "netns", ns])
            _run(["ip", "link", "set", port, "netns", self.switch])
            _ip(self.switch, "link", "set", port, "master", "br0")
            _ip(self.switch, "link", "set", port, "up")
            _ip(ns, "link", "set", "lo", "up")
            _ip(ns, "addr", "add", f"{self.address(m)}/24", "dev", nic)
            _ip(ns, "link", "set", nic, "up")
            _shape(ns, nic, spec)  # what the machine sends
            _shape(self.switch, port, spec)  # what it receives
            hosts = ETC_NETNS / ns
            self._record("hosts", str(hosts))
            hosts.mkdir(parents=True, exist_ok=True)
            (hosts / "hosts").write_text(
                "127.0.0.1 localhost\n" + "".join(f"{addr} {name}\n" for name, addr in names)
            )

    def _netns(self, name: str) -> None:
        self._record("netns", name)
        _run(["ip", "netns", "add", name])

    @property
    def state_file(self) -> Path:
        return STATE_DIR / f"{self.tag}.json"

    def _record(self, kind: str, name: str) -> None:
        """Write ``name`` to the state file before it is made, so that a lab killed between the
        two still names it."""
        self.created.append((kind, name))
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state = {"pid": os.getpid(), "started": _start_time(os.getpid()), "created": self.created}
        written = self.state_file.with_suffix(".new")
        written.write_text(json.dumps(state))
        written.replace(self.state_file)

    # -- workers ---------------------------------------------------------------------------------

    def workers(self) -> list[Worker]:
        """Ranks machine by machine, pinned: see :func:`pin`."""
        spec = self.spec
        return [
            Worker(rank, rank // spec.gpus_per_machine, rank % spec.gpus_per_machine, pin(spec, rank, os.cpu_count() or 1))
            for rank in range(spec.workers)
        ]

    def command(self, worker: Worker, argv: Sequence[str]) -> list[str]:
        """``argv`` run as ``worker``: in its machine's namespace, under its hostname, pinned."""
        pin = ["taskset", "-c", ",".join(map(str, worker.cores))] if worker.cores else []
        inner = " ".join(_quote(a) for a in pin + list(argv))
        return [
            "ip", "netns", "exec", self.namespace(worker.machine),
            "unshare", "--uts", "sh", "-c", f"hostname {self.hostname(worker.machine)} && exec {inner}",
        ]

    def start(self, worker: Worker, argv: Sequence[str], env: dict, log: Path) -> subprocess.Popen:
        out = open(log, "wb")
        proc = subprocess.Popen(
            self.command(worker, argv), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        proc.log_file = out
        carry_priority(proc.pid)
        self.processes.append(proc)
        return proc


def carry_priority(pid: Optional[int] = None) -> None:
    """Give the scheduling autogroup of process ``pid`` (None: this one) this process's nice.

    Under Linux's autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``, on by
    default on many kernels and on the box the lab was built on) a nice value orders a process
    only among the processes of its own session: every session's group competes with every
    other as an equal. A worker the lab starts in a session of its own (so that its whole
    process group can be stopped) would lose the priority the lab was started with, and on a
    box shared with other sessions a worker of ``nice -n -15`` got about a fifth of a core (a
    one-worker step of the example transformer took 857 ms where it took 168 ms on a quiet
    box). Writing the nice into ``/proc/PID/autogroup`` gives the group that priority (a
    negative one needs root, which the lab has). Only a raised priority is carried: a lab run
    under ``nice -n 19`` (the test suite's) keeps its workers' groups at the default, as before,
    rather than starving them. Nothing happens where the kernel has no autogroups."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice >= 0:
        return
    try:
        Path(f"/proc/{pid if pid is not None else 'self'}/autogroup").write_text(str(nice))
    except OSError:
        pass


def pin(spec: LabSpec, rank: int, cores: int) -> list[int]:
    """The cores worker ``rank`` runs on, of the box's ``cores``.

    Where the box has a core for every thread, each worker gets cores of its own. Where it has
    fewer, the machines share the box's cores out, as even as they go (machine m takes
    ``cores // machines`` cores from ``m * cores // machines``, at least one, wrapping around),
    and every worker of a machine runs on all of its machine's cores: the lab is then a cluster
    of smaller machines whose workers share their machine's cores (two machines of one core and
    two workers each, on a 2-core box), never another machine's, so that the simulation can hold
    a machine's workers to its cores."""
    threads = spec.threads_per_worker
    if spec.workers * threads <= cores:
        return list(range(rank * threads, (rank + 1) * threads))
    machine = rank // spec.gpus_per_machine
    per_machine = max(cores // spec.machines, 1)
    first = machine * cores // spec.machines if spec.machines <= cores else machine % cores
    return sorted({(first + c) % cores for c in range(per_machine)})


def check_can_run(spec: LabSpec) -> None:
    """Refuse, in one line, a lab this box cannot run: before any capture or calibration."""
    if spec.machines < 1 or spec.gpus_per_machine < 1:
        raise LabError("machines and GPUs per machine must be at least 1")
    if spec.threads_per_worker < 1:
        raise LabError(f"--threads {spec.threads_per_worker}: a worker needs at least 1 thread")
    cores = box_cores()
    if spec.machines > cores:
        raise LabError(f"--machines {spec.machines} is more than this box's {cores} cores: the lab gives every "
                       f"machine a core of its own, so at most {cores} machines here")
    if spec.bandwidth_mbit <= 0:
        raise LabError("bandwidth must be positive")
    if os.geteuid() != 0:
        raise LabError("the lab needs root to create network namespaces (run as root, or use a machine where you are)")
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            raise LabError(f"the lab needs the '{tool}' command (Debian: iproute2 / util-linux)")
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise LabError(f"network namespaces are not available here: {probe.stderr.strip()}")
    if spec.latency_ms > 0 and not _netem_available():
        raise LabError("--latency needs the kernel's sch_netem qdisc, which this kernel lacks; run with --latency 0")


def box_cores() -> int:
    """The cores this process may run on: the most machines the lab can emulate."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _netem_available() -> bool:
    name = f"{tag_for(os.getpid())}-probe"
    subprocess.run(["ip", "netns", "add", name], capture_output=True)
    try:
        done = subprocess.run(
            ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
            capture_output=True,
        )
        return done.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _shape(ns: str, dev: str, spec: LabSpec) -> None:
    """A token bucket at the link rate; the bucket holds a few ms of traffic at that rate (at
    least 64 KB) so TCP's bursts pass as they would through a switch port's buffer."""
    rate = f"{spec.bandwidth_mbit:g}mbit"
    burst = max(64 * 1024, int(spec.bandwidth_mbit * 1e6 / 8 * 0.002))
    if spec.latency_ms > 0:
        _ip_tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{spec.latency_ms:g}ms")
        _ip_tc(ns, "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:", "tbf", "rate", rate,
               "burst", str(burst), "latency", "200ms")
    else:
        _ip_tc(ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst), "latency", "200ms")


def _ip(ns: str, *args: str) -> None:
    _run(["ip", "netns", "exec", ns, "ip", *args])


def _ip_tc(ns: str, *args: str) -> None:
    _run(["ip", "netns", "exec", ns, "tc", *args])


def _run(argv: list) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise LabError(f"'{' '.join(argv)}' failed: {done.stderr.strip() or done.returncode}")


def _remove(created) -> None:
    """Remove ``(kind, name)`` objects: a namespace once the processes left in it are killed (a
    namespace lives on while a process is in it), a veth left in the host's namespace (deleting
    one end removes its peer), an ``/etc/netns`` entry."""
    for kind, name in created:
        if kind == "netns":
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        elif kind == "link":
            subprocess.run(["ip", "link", "del", name], capture_output=True)
        elif kind == "hosts":
            shutil.rmtree(name, ignore_errors=True)


def _start_time(pid: int) -> Optional[str]:
    """When process ``pid`` started (field 22 of /proc/PID/stat), to tell it from a later process
    given the same id; None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: Optional[str] = None) -> bool:
    now = _start_time(pid)
    return now is not None and (started is None or now == started)


_OWNER = re.compile(rf"^{PREFIX}(\d+)")


def leftovers() -> list:
    """``(kind, name)`` of every lab object whose creating process is gone: those its state file
    names, and any namespace, host-side veth or ``/etc/netns`` entry named :data:`PREFIX` + a
    dead process's id (a state file lost, or a lab from before state files)."""
    found = []
    for state_file in sorted(STATE_DIR.glob(f"{PREFIX}*.json")) if STATE_DIR.is_dir() else []:
        try:
            state = json.loads(state_file.read_text())
            if _alive(int(state["pid"]), state.get("started")):
                continue
            found += [(kind, name) for kind, name in reversed(state["created"])]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable: the names below still find its objects
        found.append(("state", str(state_file)))
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.split("\n")
    candidates = [("netns", line.split()[0]) for line in names if line.strip()]
    candidates += [("link", line.split(":")[1].strip().split("@")[0]) for line in links if line.count(":") >= 2]
    candidates += [("hosts", str(p)) for p in ETC_NETNS.iterdir()] if ETC_NETNS.is_dir() else []
    for kind, name in candidates:
        owner = _OWNER.match(Path(name).name)
        if owner and not _alive(int(owner.group(1))) and (kind, name) not in found:
            found.append((kind, name))
    return found


def clean() -> list:
    """Remove what labs killed before they could clean up left behind (:func:`leftovers`);
    a running lab's objects are left alone. Returns what was removed."""
    found = leftovers()
    _remove([(kind, name) for kind, name in found if kind != "state"])
    for kind, name in found:
        if kind == "state":
            Path(name).unlink(missing_ok=True)
    return found


def _quote(arg: str) -> str:
    return shlex.quote(str(arg))


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


#: ``torch.distributed`` families that rendezvous as DDP does (``examples/parallel.py``)
TORCH_FAMILIES = ("fsdp", "tp", "pp", "ep", "fsdp+tp")
FRAMEWORKS = ("horovod", "ddp") + TORCH_FAMILIES


@dataclass
class JobResult:
    exit_codes: list
    logs: list  # one path per worker
    out_dir: Path


def run_job(
    spec: LabSpec, framework: str, argv: Sequence[str], out_dir: Path, timeout_s: float = 900.0,
    env: Optional[dict] = None,
) -> JobResult:
    """Run ``argv`` as every worker of ``framework`` on an emulated cluster of ``spec``.

    Each worker gets the environment its framework reads (Horovod's Gloo variables, or PyTorch's
    ``MASTER_ADDR`` / ``RANK`` / ``WORLD_SIZE`` for DDP and the other ``torch.distributed``
    families), ``OMP_NUM_THREADS`` = threads per worker,
    ``WHATIF_LAB_OUT`` = ``out_dir`` for per-rank reports, and the variables in ``env`` (the
    job's own settings, e.g. Horovod's fusion threshold); logs go to ``out_dir/rank<r>.log``.
    """
    if framework not in FRAMEWORKS:
        raise LabError(f"unknown framework {framework!r}; choose from {', '.join(FRAMEWORKS)}")
    if not timeout_s > 0:
        raise LabError(f"--timeout {timeout_s:g}: the workers need some seconds to run")
    out_dir.mkdir(parents=True, exist_ok=True)
    carry_priority()
    with EmulatedCluster(spec) as cluster:
        workers = cluster.workers()
        base = dict(os.environ, **(env or {}), OMP_NUM_THREADS=str(spec.threads_per_worker), WHATIF_LAB_OUT=str(out_dir))
        if framework == "horovod":
            per_rank = _horovod_environment(cluster, workers, out_dir)
        else:
            per_rank = _ddp_environment(cluster, workers)
        logs = []
        for worker in workers:
            log = out_dir / f"rank{worker.rank}.log"
            logs.append(log)
            cluster.start(worker, argv, dict(base, **per_rank[worker.rank]), log)
        workers_only = [p for p in cluster.processes if getattr(p, "role", "worker") == "worker"]
        codes = _wait(workers_only, timeout_s)
    return JobResult(codes, logs, out_dir)


def _wait(processes: list, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    codes = []
    for proc in processes:
        try:
            codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 0.01)))
        except subprocess.TimeoutExpired:
            raise LabError(f"workers still running after {timeout_s:.0f} s; stopped them") from None
        finally:
            proc.log_file.close()
    return codes


def _ddp_environment(cluster: EmulatedCluster, workers: list) -> dict:
    spec = cluster.spec
    master = cluster.address(0)
    return {
        w.rank: {
            "MASTER_ADDR": master,
            "MASTER_PORT": "29571",
            "RANK": str(w.rank),
            "WORLD_SIZE": str(spec.workers),
            "LOCAL_RANK": str(w.local_rank),
            "LOCAL_WORLD_SIZE": str(spec.gpus_per_machine),
            "GLOO_SOCKET_IFNAME": cluster.nic(w.machine),
        }
        for w in workers
    }


def _horovod_environment(cluster: EmulatedCluster, workers: list, out_dir: Path) -> dict:
    """Start the rendezvous server in machine 0's namespace and give each worker Horovod's Gloo
    variables (those ``horovodrun --gloo`` would set)."""
    spec = cluster.spec
    hosts = ",".join(f"{cluster.hostname(m)}:{spec.gpus_per_machine}" for m in range(spec.machines))
    port_file = out_dir / "rendezvous.port"
    port_file.unlink(missing_ok=True)
    server = cluster.start(
        Worker(-1, 0, -1),
        [sys.executable, "-m", "whatif.lab.horovod_rendezvous", hosts, str(spec.workers), str(port_file)],
        dict(os.environ),
        out_dir / "rendezvous.log",
    )
    server.role = "server"
    deadline = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text().strip():
        if server.poll() is not None or time.monotonic() > deadline:
            raise LabError(f"Horovod's rendezvous server did not start; see {out_dir / 'rendezvous.log'}")
        time.sleep(0.1)
    port = port_file.read_text().strip()
    return {
        w.rank: {
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_TIMEOUT_SECONDS": "120",
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": cluster.address(0),
            "HOROVOD_GLOO_RENDEZVOUS_PORT": port,
            "HOROVOD_GLOO_IFACE": cluster.nic(w.machine),
            "HOROVOD_HOSTNAME": cluster.hostname(w.machine),
            "HOROVOD_RANK": str(w.rank),
            "HOROVOD_SIZE": str(spec.workers),
            "HOROVOD_LOCAL_RANK": str(w.local_rank),
            "HOROVOD_LOCAL_SIZE": str(spec.gpus_per_machine),
            "HOROVOD_CROSS_RANK": str(w.machine),
            "HOROVOD_CROSS_SIZE": str(spec.machines),
        }
        for w in workers
    }
