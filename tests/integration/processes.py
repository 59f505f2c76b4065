"""Real component processes on loopback for the integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from openengine_serve.client import NO_CREDENTIALS, Credentials, is_serving
from openengine_serve.local import free_port

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
    credentials: Credentials = NO_CREDENTIALS  # what its readiness check needs (TLS)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "Component":
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        log = open(LOG_DIR / f"{self.name}-{self.port}.log", "ab")
        env = {**os.environ, **self.env}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "openengine_serve", *self.args, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    def wait_ready(self, timeout: float = 60.0) -> "Component":
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
    return Component("coordinator", ["coordinator", "--metrics-port", "0", "--heartbeat-s", "0.3",
                                     "--node-expiry-s", "1.5"], env)


def node(coordinator_target: str, rank: int, *extra: str, **env) -> Component:
    return Component(f"node{rank}", ["node", "--metrics-port", "0", "--coordinator-address", coordinator_target,
                                     "--node-rank", str(rank), *extra], env)


def frontend(coordinator_target: str, server: str, *extra: str, **env) -> Component:
    return Component(f"frontend-{server}", ["frontend", "--metrics-port", "0", "--grpc-server", server,
                                            "--coordinator-address", coordinator_target, "--heartbeat-s", "0.3",
                                            *extra], env)


def descendants(pid: int) -> list[int]:
    """Every live descendant of a process (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
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
