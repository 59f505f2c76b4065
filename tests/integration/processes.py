"""Real component processes on loopback for the integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from openengine_serve.client import NO_CREDENTIALS, Credentials, is_serving
from openengine_serve.common.net import free_port
from openengine_serve.local import component_command

LOG_DIR = Path(os.environ.get("OPENENGINE_TEST_LOG_DIR", "/tmp/openengine-test-logs"))


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@dataclass
class Component:
    name: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    preexec_fn: Callable[[], None] | None = None  # runs in the child before exec (e.g. to enter a cgroup)
    host: str = "127.0.0.1"  # any loopback address (127.0.0.0/8)
    credentials: Credentials = NO_CREDENTIALS  # what its readiness check needs (TLS)

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> Component:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        log = open(LOG_DIR / f"{self.name}-{self.port}.log", "ab")
        env = {**os.environ, **self.env}
        self.proc = subprocess.Popen(
            component_command(self.args[0], self.host, self.port, *self.args[1:]),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=self.preexec_fn,
        )
        return self

    def wait_ready(self, timeout: float = 60.0) -> Component:
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}; see {LOG_DIR}")
            return is_serving(self.target, credentials=self.credentials)

        wait_for(ready, timeout, f"{self.name} readiness")
        return self

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def coordinator(**env) -> Component:
    return Component(
        "coordinator", ["coordinator", "--metrics-port", "0", "--heartbeat-s", "0.3", "--node-expiry-s", "1.5"], env
    )


def node(coordinator_target: str, rank: int, *extra: str, **env) -> Component:
    """A node on the simulated engine (deterministic tokens); `extra` "--engine", "llama.cpp" for the real model."""
    return Component(
        f"node{rank}",
        [
            "node",
            "--metrics-port",
            "0",
            "--coordinator-address",
            coordinator_target,
            "--node-rank",
            str(rank),
            "--engine",
            "simulated",
            *extra,
        ],
        env,
    )


def frontend(coordinator_target: str, server: str, *extra: str, **env) -> Component:
    return Component(
        f"frontend-{server}",
        [
            "frontend",
            "--metrics-port",
            "0",
            "--grpc-server",
            server,
            "--coordinator-address",
            coordinator_target,
            "--heartbeat-s",
            "0.3",
            *extra,
        ],
        env,
    )


def with_metrics(component: Component) -> tuple[Component, int]:
    """Gives a component its own metrics port (the helpers above disable metrics)."""
    port = free_port()
    component.args[component.args.index("--metrics-port") + 1] = str(port)
    return component, port


def with_http(component: Component) -> tuple[Component, str]:
    """Serves a frontend's OpenAI-compatible HTTP API on a port of its own; returns its base URL (.../v1)."""
    port = free_port()
    component.args += ["--http-port", str(port)]
    return component, f"http://{component.host}:{port}/v1"


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _stat_fields(pid: int | str) -> list[str]:
    """/proc/<pid>/stat after the command name: [state, ppid, ...]; [] when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def alive(pid: int) -> bool:
    """Whether the process exists and is not a zombie."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] != "Z"


def descendants(pid: int) -> list[int]:
    """Every live descendant of a process (the one walk of /proc in the tests), children first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(entry)):
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, frontier = [], [pid]
    while frontier:
        kids = children.get(frontier.pop(), [])
        out += kids
        frontier += kids
    return out


def environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {key.decode(): value.decode() for key, value in pairs}


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def engine_worker_pids(node_pid: int) -> list[int]:
    return [p for p in descendants(node_pid) if "openengine_serve.engine.worker" in cmdline(p)]


class Deployment:
    """A private deployment for tests that kill or restart its parts; stops everything it started."""

    def __init__(self) -> None:
        self.components: list[Component] = []

    def add(self, component: Component, ready_timeout: float = 90.0) -> Component:
        self.components.append(component)
        component.start().wait_ready(ready_timeout)
        return component

    def close(self) -> None:
        for component in reversed(self.components):
            component.stop(timeout=15)
            if component.proc is not None and component.proc.poll() is None:
                component.proc.kill()
