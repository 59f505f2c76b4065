"""Docker Compose fixtures: build the three images once, run one stack per session.

With CI=true these tests must run: a missing Docker engine or Compose v2 plugin
is a failure there. Locally they are skipped (with the reason) when no engine answers.

The stack runs as its own Compose project (`oe-test-<random>`), every published
port bound to 127.0.0.1: the frontend's gRPC port is a free port chosen here
(OPENENGINE_FRONTEND_PUBLISH), its metrics port is ephemeral ("0", looked up
with `docker port`), so a local stack on 50051/9091 is never disturbed. The
coordinator's and nodes' metrics are read inside their containers (`docker exec`):
they publish nothing.
`docker compose down -v` always runs in the finalizer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from openengine_serve.common.net import free_port

from ..conftest import IN_CI

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILES = [REPO / "docker-compose.yml", Path(__file__).resolve().parent / "compose.test.yml"]
LOG_DIR = Path(os.environ.get("OPENENGINE_TEST_LOG_DIR", "/tmp/openengine-test-logs"))
BUILD_TIMEOUT_S = 1200
UP_TIMEOUT_S = 240


def _docker_binary() -> str | None:
    # /usr/local/bin/docker on these machines has no BuildKit client; Debian's has.
    for candidate in (os.environ.get("DOCKER"), "/usr/bin/docker", shutil.which("docker")):
        if candidate and os.path.exists(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def _unavailable(reason: str):
    if IN_CI:
        pytest.fail(f"CI=true and the container tests cannot run: {reason}", pytrace=False)
    pytest.skip(f"container tests need a Docker engine with Compose v2: {reason}")


class Stack:
    """One Compose project; every command gets the same files, project name and environment."""

    def __init__(self, docker: str) -> None:
        self.docker = docker
        self.project = f"oe-test-{uuid.uuid4().hex[:8]}"
        self.frontend_port = free_port()
        self.env = {
            **{k: v for k, v in os.environ.items() if k != "OPENENGINE_VERSION"},
            "DOCKER_BUILDKIT": "1",
            "COMPOSE_PROJECT_NAME": self.project,
            "OPENENGINE_BIND": "127.0.0.1",
            "OPENENGINE_GRPC_SERVER": "grpcio",
            "OPENENGINE_NODES": "1",
            "OPENENGINE_FRONTEND_PUBLISH": str(self.frontend_port),
            "OPENENGINE_FRONTEND_METRICS_PUBLISH": "0",
            "OPENENGINE_FRONTEND_HTTP_PUBLISH": "0",
        }
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{self.project}.log"
        self.started = False

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.frontend_port}"

    def _base(self) -> list[str]:
        cmd = [self.docker, "compose", "-p", self.project]
        for f in COMPOSE_FILES:
            cmd += ["-f", str(f)]
        return cmd

    def compose(
        self, *args: str, timeout: float = 120, env: dict[str, str] | None = None, check: bool = True
    ) -> subprocess.CompletedProcess:
        cmd = self._base() + list(args)
        proc = subprocess.run(
            cmd, cwd=REPO, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout
        )
        with open(self.log_path, "a") as log:
            log.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}[exit {proc.returncode}]\n")
        if check and proc.returncode != 0:
            raise AssertionError(
                f"`docker compose {' '.join(args)}` exited {proc.returncode}:\n"
                f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{self.logs()}"
            )
        return proc

    def docker_cmd(self, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.docker, *args], capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"`docker {' '.join(args)}` exited {proc.returncode}: {proc.stderr[-2000:]}")
        return proc

    def logs(self, tail: int = 60) -> str:
        try:
            proc = subprocess.run(
                self._base() + ["logs", "--no-color", "--tail", str(tail)],
                cwd=REPO,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            return "--- compose logs ---\n" + proc.stdout[-8000:] + proc.stderr[-2000:]
        except Exception as exc:  # noqa: BLE001 - diagnostics only
            return f"(no logs: {exc})"

    def up(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.started = True
        self.compose(
            "up", "-d", "--wait", "--wait-timeout", str(UP_TIMEOUT_S - 20), *args, timeout=UP_TIMEOUT_S, env=env
        )

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "--timeout", "10", timeout=180, check=False)

    def container_ids(self, service: str, all_: bool = False) -> list[str]:
        args = ["ps", "-q"] + (["-a"] if all_ else []) + [service]
        return sorted(self.compose(*args).stdout.split())

    def published_port(self, container: str, port: int) -> int:
        out = self.docker_cmd("port", container, f"{port}/tcp").stdout.split()
        host_ports = [int(line.rsplit(":", 1)[1]) for line in out if line.startswith("127.0.0.1:")]
        assert host_ports, f"{container} does not publish {port} on 127.0.0.1: {out}"
        return host_ports[0]

    def scrape_inside(self, container: str, port: int) -> str:
        """The /metrics text a container serves on `port`, fetched from inside it."""
        fetch = (
            f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics').read().decode())"
        )
        return self.docker_cmd("exec", container, "python3", "-c", fetch, timeout=30).stdout

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={self.project}"
        found = {}
        for kind, args in (
            ("containers", ["ps", "-aq", "--filter", label]),
            ("networks", ["network", "ls", "-q", "--filter", label]),
            ("volumes", ["volume", "ls", "-q", "--filter", label]),
        ):
            found[kind] = self.docker_cmd(*args).stdout.split()
        return found


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`openengine-serve ...` from the host's environment (this interpreter)."""
    return subprocess.run(
        [sys.executable, "-m", "openengine_serve", *args], capture_output=True, text=True, timeout=timeout
    )


def cli_popen(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "openengine_serve", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def pytest_collection_modifyitems(items):
    """The test that takes the shared stack down runs after every other container test, whichever module holds it."""
    here = Path(__file__).resolve().parent
    down = [item for item in items if item.name == "test_down_leaves_nothing"]
    rest = [item for item in items if item not in down]
    container = [i for i, item in enumerate(rest) if here in Path(item.path).resolve().parents]
    if down and container:
        rest[container[-1] + 1 : container[-1] + 1] = down
        items[:] = rest


@pytest.fixture(scope="session")
def docker() -> str:
    binary = _docker_binary()
    if binary is None:
        _unavailable("no docker client found (set DOCKER or install docker.io)")
    info = subprocess.run([binary, "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        errors = [line.strip() for line in (info.stdout + info.stderr).splitlines() if "ERROR" in line.upper()]
        _unavailable(f"`{binary} info` failed (is dockerd running?): " + " ".join(errors)[:500])
    compose = subprocess.run([binary, "compose", "version", "--short"], capture_output=True, text=True, timeout=60)
    if compose.returncode != 0 or not compose.stdout.strip().lstrip("v").startswith("2"):
        _unavailable(f"`{binary} compose` (v2 plugin) is missing: {compose.stderr.strip()[:500]}")
    return binary


@pytest.fixture(scope="session")
def stack(docker, request) -> Stack:
    """Builds the images once (`docker compose build`), then `up -d --wait` one node."""
    s = Stack(docker)
    request.addfinalizer(s.down)
    started = time.monotonic()
    build = s.compose("build", "--progress=plain", timeout=BUILD_TIMEOUT_S, check=False)
    if build.returncode != 0:
        pytest.fail(f"docker compose build failed (full log: {s.log_path}):\n{build.stderr[-5000:]}", pytrace=False)
    s.build_seconds = time.monotonic() - started
    s.up()
    s.up_seconds = time.monotonic() - started - s.build_seconds
    return s


def compose_ps(s: Stack, service: str) -> list[dict]:
    out = s.compose("ps", "--format", "json", service).stdout.strip()
    if not out:
        return []
    if out.startswith("["):
        return json.loads(out)
    return [json.loads(line) for line in out.splitlines() if line.strip()]
