"""The processes under test: start, pin to cores, stop, and account their CPU time from /proc.

Components run exactly as `openengine-serve up` runs them (`python -m
openengine_serve coordinator|node|frontend ...`), each in its own session so a
stop never reaches anything but the component and its children. The frontend
(or the bare baseline server) is pinned to the frontend CPUs; the coordinator,
the node and everything the node spawns (launcher, mpiexec, hydra, engine
worker) to the other CPUs. Pinning happens at exec (`taskset`) and again on
every thread of the whole process tree once it is up (MPI's launcher may set
its own affinity).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from openengine_serve.client import is_serving
from openengine_serve.common.net import free_port
from openengine_serve.local import component_command

CLK_TCK = os.sysconf("SC_CLK_TCK")
HOST = "127.0.0.1"
STOP_TIMEOUT_S = 40.0
CLUSTER_STOP_TIMEOUT_S = 10.0
FRONTEND_DRAIN_S = 2.0


# ---------------------------------------------------------------- CPUs


def parse_cpus(spec: str) -> list[int]:
    """'0', '0,2', '1-3' or '0-1,4' -> sorted CPU numbers."""
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = (int(x) for x in part.split("-", 1))
            if hi < lo:
                raise ValueError(f"bad CPU range {part!r}")
            cpus.update(range(lo, hi + 1))
        else:
            cpus.add(int(part))
    if not cpus:
        raise ValueError(f"no CPUs in {spec!r}")
    return sorted(cpus)


def format_cpus(cpus: Iterable[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def pinned(command: list[str], cpus: Iterable[int]) -> list[str]:
    """`command` run on `cpus` (when taskset is there). taskset execs the command: the pid stays the command's,
    and every thread inherits the mask."""
    if shutil.which("taskset"):
        return ["taskset", "-c", format_cpus(cpus), *command]
    return command


def split_cpus(frontend_spec: str) -> tuple[list[int], list[int]]:
    """(frontend CPUs, other CPUs) within this process's allowed CPUs. With one CPU both share it."""
    allowed = sorted(os.sched_getaffinity(0))
    frontend = parse_cpus(frontend_spec)
    missing = [c for c in frontend if c not in allowed]
    if missing:
        raise ValueError(
            f"--frontend-cpus {frontend_spec!r}: CPUs {missing} are not available (allowed: {format_cpus(allowed)})"
        )
    other = [c for c in allowed if c not in frontend] or frontend
    return frontend, other


# ---------------------------------------------------------------- placements of the server under test


@dataclass(frozen=True)
class Placement:
    """How the frontend (or the bare server) is constrained: pinned to the frontend CPUs before it starts, or
    seeing every core under a cgroup CPU quota (how `docker --cpus` and Kubernetes limits work), or neither.
    The rest of the stack and the load generator stay on the other CPUs in every placement."""

    name: str
    pinned: bool
    quota_cpus: float | None = None

    def describe(self) -> str:
        where = "pinned to the frontend CPUs" if self.pinned else "every core visible"
        return where + (f", {self.quota_cpus:g}-CPU cgroup quota" if self.quota_cpus else "")


PLACEMENT_NAMES = ("pinned", "quota", "shared")


def placement(name: str, quota_cpus: float = 1.0) -> Placement:
    if name == "pinned":
        return Placement("pinned", pinned=True)
    if name == "quota":
        return Placement("quota", pinned=False, quota_cpus=quota_cpus)
    if name == "shared":
        return Placement("shared", pinned=False)
    raise ValueError(f"unknown placement {name!r} (known: {', '.join(PLACEMENT_NAMES)})")


def parse_placements(spec: str, quota_cpus: float = 1.0) -> list[Placement]:
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise ValueError(f"no placement in {spec!r} (known: {', '.join(PLACEMENT_NAMES)})")
    return [placement(n, quota_cpus) for n in dict.fromkeys(names)]


# ---------------------------------------------------------------- /proc


def read_stat(pid: int) -> tuple[int, float] | None:
    """(ppid, utime+stime in seconds) of a process, all its threads included; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    # fields[0] is field 3 (state): ppid = field 4, utime = field 14, stime = field 15
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_seconds(pid: int) -> float | None:
    stat = read_stat(pid)
    return None if stat is None else stat[1]


def _thread_files(pid: int, *names: str) -> Iterator[tuple[int, list[str]]]:
    """(thread id, [the text of /proc/<pid>/task/<tid>/<name> for each name]) for each live thread."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return
    for tid in tids:
        try:
            texts = [Path(f"/proc/{pid}/task/{tid}/{name}").read_text() for name in names]
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended meanwhile
        yield int(tid), texts


def thread_seconds(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (/proc/<pid>/task/*/comm; threads of one name summed)."""
    out: dict[str, float] = {}
    for tid, (comm, stat) in _thread_files(pid, "comm", "stat"):
        name = comm.strip()
        if tid == pid:
            name = "main (asyncio loop)"
        elif name.startswith("python"):
            name = "other Python threads"  # grpc.aio poller, pygrpc-native dispatch, executor workers
        fields = stat[stat.rindex(")") + 2 :].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def wake_ups(pid: int) -> int:
    """Times the process's threads blocked and were woken (voluntary context switches, every thread summed).

    On a small VM each wake-up costs tens of µs of CPU (docs/benchmarks.md), and the count moves far less with
    the machine's load than CPU time does: wake-ups per message is the steadier measure of a server's per-token
    cost. Threads that ended are not counted."""
    total = 0
    for _, (status,) in _thread_files(pid, "status"):
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                total += int(line.split()[1])
                break
    return total


def descendants(root: int) -> list[int]:
    """root and every process below it (from the ppid of every process in /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = read_stat(int(entry))
        if stat is not None:
            children.setdefault(stat[0], []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def pin_tree(root: int, cpus: Sequence[int]) -> list[int]:
    """Sets the affinity of every thread of root and its descendants; returns the pids pinned."""
    pids = descendants(root)
    for pid in pids:
        with contextlib.suppress(FileNotFoundError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
                    os.sched_setaffinity(int(tid), cpus)
    return pids


def affinity(pid: int) -> list[int] | None:
    with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
        return sorted(os.sched_getaffinity(pid))
    return None


class CpuSampler:
    """CPU seconds of named groups of processes: snapshot at window start and end, then `delta`."""

    def __init__(self) -> None:
        self.groups: dict[str, list[int]] = {}

    def set_group(self, name: str, pids: Iterable[int]) -> None:
        self.groups[name] = list(pids)

    def snapshot(self) -> dict[str, dict[int, float]]:
        snap: dict[str, dict[int, float]] = {}
        for name, pids in self.groups.items():
            snap[name] = {}
            for pid in pids:
                seconds = cpu_seconds(pid)
                if seconds is not None:
                    snap[name][pid] = seconds
        return snap

    @staticmethod
    def delta(before: dict[str, dict[int, float]], after: dict[str, dict[int, float]]) -> dict[str, float]:
        """Per group, CPU seconds spent between the snapshots by processes alive at both."""
        out: dict[str, float] = {}
        for name, end in after.items():
            start = before.get(name, {})
            out[name] = sum(end[pid] - start[pid] for pid in end if pid in start)
        return out


# ---------------------------------------------------------------- processes


def established_connections(port: int) -> int | None:
    """TCP connections established to 127.0.0.1:port (from `ss`), None without ss."""
    if shutil.which("ss") is None:
        return None
    out = subprocess.run(
        ["ss", "-Htn", "state", "established", f"( sport = :{port} )"], capture_output=True, text=True, timeout=10
    ).stdout
    return sum(1 for line in out.splitlines() if line.strip())


@dataclass
class Process:
    """One component process, started in its own session and pinned to `cpus`."""

    name: str
    command: list[str]
    cpus: list[int]
    log_path: Path
    port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    preexec_fn: Callable[[], None] | None = None  # runs in the child before exec (e.g. entering a cgroup)
    proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def target(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self) -> Process:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = pinned(list(self.command), self.cpus)
        env = {**os.environ, **self.env}
        # mpiexec lives next to the interpreter in a venv; MPI Spawn looks it up on PATH.
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=self.preexec_fn,
            )
        if not shutil.which("taskset"):
            pin_tree(self.proc.pid, self.cpus)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pin(self) -> list[int]:
        return pin_tree(self.pid, self.cpus)

    def wait_ready(self, timeout: float, check) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                status = None if self.proc is None else self.proc.returncode
                raise RuntimeError(f"{self.name} exited with status {status}; see {self.log_path}")
            if check():
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} was not ready within {timeout:.0f}s; see {self.log_path}")

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM (the component drains), then SIGKILL to its own process group after `timeout`."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


class Stack:
    """Coordinator + one node (with its MPI engine worker) that stay up, and a frontend restarted per round."""

    def __init__(
        self,
        out_dir: Path,
        frontend_cpus: Sequence[int],
        other_cpus: Sequence[int],
        *,
        step_ms: float,
        max_batch: int,
        max_queue: int,
        log_level: str = "info",
    ) -> None:
        self.log_dir = out_dir / "logs"
        self.frontend_cpus = list(frontend_cpus)
        self.other_cpus = list(other_cpus)
        self.step_ms = step_ms
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.log_level = log_level
        self.coordinator: Process | None = None
        self.node: Process | None = None
        self.frontend: Process | None = None
        self.baseline: Process | None = None
        self._frontend_starts = 0

    def start_cluster(self, timeout: float = 120.0) -> None:
        port = free_port(HOST)
        self.coordinator = Process(
            "coordinator",
            component_command("coordinator", HOST, port, metrics_port=0, log_level=self.log_level),
            self.other_cpus,
            self.log_dir / "coordinator.log",
            port,
        ).start()
        self.coordinator.wait_ready(60, lambda: is_serving(self.coordinator.target))
        port = free_port(HOST)
        self.node = Process(
            "node",
            component_command(
                "node",
                HOST,
                port,
                metrics_port=0,
                log_level=self.log_level,
                coordinator_address=self.coordinator.target,
                node_rank=0,
                engine="simulated",
                step_ms=self.step_ms,
                max_batch=self.max_batch,
                max_queue=self.max_queue,
            ),
            self.other_cpus,
            self.log_dir / "node.log",
            port,
        ).start()
        self.node.wait_ready(timeout, lambda: is_serving(self.node.target))
        self.node.pin()  # the engine worker exists now (node readiness follows it)

    def node_tree(self) -> list[int]:
        """The node and everything below it: launcher, mpiexec, hydra proxy, engine worker."""
        return descendants(self.node.pid) if self.node and self.node.alive() else []

    def placed_cpus(self, pinned: bool) -> list[int]:
        """The CPUs the server under test may run on: its own when pinned, else every CPU of the run."""
        return self.frontend_cpus if pinned else sorted(set(self.frontend_cpus) | set(self.other_cpus))

    def start_frontend(
        self, server: str, timeout: float = 90.0, *, pinned: bool = True, enter_cgroup: Callable[[], None] | None = None
    ) -> Process:
        assert self.coordinator is not None, "start_cluster first"
        self._frontend_starts += 1
        port = free_port(HOST)
        self.frontend = Process(
            f"frontend-{server}",
            component_command(
                "frontend",
                HOST,
                port,
                metrics_port=0,
                log_level=self.log_level,
                coordinator_address=self.coordinator.target,
                grpc_server=server,
                workers=1,
                # Short drain: streams the client cancelled at the end of a saturation window may still be open
                # when the frontend stops, and a full drain would wait for them; shutdown is not what is measured.
                drain_timeout_s=FRONTEND_DRAIN_S,
                frontend_id=f"bench-{server}-{self._frontend_starts}-{os.getpid()}",
            ),
            self.placed_cpus(pinned),
            self.log_dir / f"frontend-{self._frontend_starts:02d}-{server}.log",
            port,
            preexec_fn=enter_cgroup,
        ).start()
        self.frontend.wait_ready(timeout, lambda: is_serving(self.frontend.target))
        self.frontend.pin()
        return self.frontend

    def stop_frontend(self) -> None:
        if self.frontend is not None:
            self.frontend.stop()
            self.frontend = None

    def start_baseline(self, server: str, timeout: float = 60.0) -> Process:
        from .baseline import wait_baseline_ready

        port = free_port(HOST)
        self.baseline = Process(
            f"baseline-{server}",
            [
                sys.executable,
                "-m",
                "openengine_bench.baseline",
                "--server",
                server,
                "--host",
                HOST,
                "--port",
                str(port),
                "--step-ms",
                str(self.step_ms),
            ],
            self.frontend_cpus,
            self.log_dir / f"baseline-{server}.log",
            port,
        ).start()
        self.baseline.wait_ready(timeout, lambda: wait_baseline_ready(self.baseline.target))
        self.baseline.pin()
        return self.baseline

    def stop_baseline(self) -> None:
        if self.baseline is not None:
            self.baseline.stop()
            self.baseline = None

    def stop_all(self) -> None:
        """Frontend first (drains), then the node, then the coordinator."""
        for stop in (self.stop_baseline, self.stop_frontend):
            with contextlib.suppress(Exception):
                stop()
        for proc in (self.node, self.coordinator):
            if proc is not None:
                with contextlib.suppress(Exception):
                    # Shutdown is not measured: a node that has not exited after this long is killed.
                    proc.stop(timeout=CLUSTER_STOP_TIMEOUT_S)


class UpStack:
    """A whole deployment as `openengine-serve up --nodes N --workers W --grpc-server S`: one child process that
    starts coordinator, nodes (each with its MPI engine worker) and frontend, and stops them in order."""

    def __init__(
        self,
        server: str,
        *,
        nodes: int,
        workers: int,
        log_path: Path | None = None,
        pythonpath: str = "",
        coordinator_port: int = 0,
    ) -> None:
        self.server = server
        self.nodes = nodes
        self.workers = workers
        self.log_path = log_path
        self.pythonpath = pythonpath
        self.port = free_port(HOST)
        self.coordinator_port = coordinator_port or free_port(HOST)
        self.proc: subprocess.Popen | None = None

    @property
    def target(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def coordinator_target(self) -> str:
        return f"{HOST}:{self.coordinator_port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 120.0) -> UpStack:
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])  # mpiexec
        if self.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [self.pythonpath, env.get("PYTHONPATH")]))
        command = component_command(
            "up",
            HOST,
            self.port,
            nodes=self.nodes,
            engine="simulated",
            grpc_server=self.server,
            coordinator_port=self.coordinator_port,
            workers=self.workers,
        )
        if self.log_path is None:
            self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        else:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while not self._every_worker_serving():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"`openengine-serve up --grpc-server {self.server}` did not become ready"
                    + (f"; see {self.log_path}" if self.log_path else "")
                )
            time.sleep(0.5)
        return self

    def _every_worker_serving(self) -> bool:
        """Readiness on 4 connections per worker, each its own: the workers share the port (the kernel spreads
        new connections over them) and each is ready once it has the model's tokenizer, not all at one moment.
        One worker of W not ready yet is missed by every check with p = ((W - 1) / W) ** (4 W): 1/256 at W = 2."""
        return all(is_serving(self.target) for _ in range(4 * self.workers))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 120.0) -> int | None:
        """SIGTERM to `up` (it stops frontend, nodes, coordinator in order). Each component runs in its own
        session, so if `up` has to be killed, whatever it leaves behind is killed by pid."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                left = descendants(self.proc.pid)[1:]
                self.proc.kill()
                self.proc.wait()
                for pid in left:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
        return self.proc.returncode
