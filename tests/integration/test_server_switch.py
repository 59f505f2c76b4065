"""OPENENGINE_GRPC_SERVER: the frontend's server switch, its dependency check, and workers sharing a port."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from openengine_serve.api.openengine.v1 import server_pb2
from openengine_serve.client import Client
from openengine_serve.common.config import FrontendConfig

from ..conftest import IN_CI
from . import processes
from .conftest import by_output, collect, request

SITE_PACKAGES = Path(sysconfig.get_paths()["purelib"])
# scripts/bootstrap.sh (dev extra) downloads this wheel once, so the test installs it without a package index.
OUTDATED_NATIVE = "pygrpc-native==0.4.0"
WHEELS = Path(sys.prefix) / "wheels"


def run_cli(*args, env=None, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "openengine_serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_invalid_variable_value_names_variable_and_choices():
    result = run_cli("frontend", "--metrics-port", "0", env={"OPENENGINE_GRPC_SERVER": "tornado"})
    assert result.returncode == 2
    assert "OPENENGINE_GRPC_SERVER" in result.stderr
    assert "grpcio" in result.stderr and "pygrpc-native" in result.stderr


def test_invalid_flag_value_is_refused():
    result = run_cli("frontend", "--grpc-server", "tornado")
    assert result.returncode == 2 and "pygrpc-native" in result.stderr


@pytest.fixture(scope="module")
def site_without_native(tmp_path_factory) -> Path:
    """A second environment: every installed distribution except pygrpc-native."""
    site = tmp_path_factory.mktemp("site-without-native")
    for entry in SITE_PACKAGES.iterdir():
        if not entry.name.lower().startswith(("pygrpc_native", "pygrpc-native")):
            (site / entry.name).symlink_to(entry)
    return site


def python_with_site(site: Path, *args, timeout=60) -> subprocess.CompletedProcess:
    # -S skips the real site-packages; the substitute site directory is the only one on the path.
    code = (
        "import site, sys; site.addsitedir(sys.argv[1]); sys.argv = ['openengine-serve', *sys.argv[2:]]; "
        "from openengine_serve.cli import main; raise SystemExit(main())"
    )
    return subprocess.run(
        [sys.executable, "-S", "-c", code, str(site), *args], capture_output=True, text=True, timeout=timeout
    )


def test_missing_native_package_fails_with_install_command(site_without_native):
    result = python_with_site(
        site_without_native,
        "frontend",
        "--grpc-server",
        "pygrpc-native",
        "--coordinator-address",
        "127.0.0.1:9",
        "--metrics-port",
        "0",
    )
    assert result.returncode == 2
    assert "pip install 'openengine-serve[native]'" in result.stderr
    assert "frontend listening" not in result.stderr  # failed before binding


def test_outdated_native_package_names_found_version_and_range(site_without_native, tmp_path):
    old = tmp_path / "site-old-native"
    old.mkdir()
    for entry in site_without_native.iterdir():
        (old / entry.name).symlink_to(entry.resolve())
    if not any(WHEELS.glob("pygrpc_native-0.4.0-*.whl")):
        missing = f"no {OUTDATED_NATIVE} wheel in {WHEELS} (`bash scripts/bootstrap.sh native,dev` downloads it)"
        if IN_CI:
            pytest.fail(f"CI=true: {missing}", pytrace=False)
        pytest.skip(missing)
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--find-links",
            str(WHEELS),
            "--target",
            str(old),
            OUTDATED_NATIVE,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert install.returncode == 0, install.stderr
    result = python_with_site(old, "frontend", "--grpc-server", "pygrpc-native", "--metrics-port", "0")
    assert result.returncode == 2
    assert "found pygrpc-native 0.4.0" in result.stderr
    assert "pygrpc-native==0.5.0" in result.stderr


def test_grpcio_default_does_not_need_native(site_without_native):
    # With the default server the missing extra is no problem: the check only runs for pygrpc-native.
    result = python_with_site(site_without_native, "health", "--target", "127.0.0.1:9", "--timeout", "0.2")
    assert result.returncode == 1 and "UNREACHABLE" in result.stdout


def test_internal_components_stay_on_grpc_aio(cluster):
    """With the variable set to pygrpc-native, coordinator and node still build grpc.aio servers and say so."""
    coord, _ = cluster
    node = processes.node(coord.target, 5, OPENENGINE_GRPC_SERVER="pygrpc-native").start()
    try:
        node.wait_ready(90)
    finally:
        node.stop()
    log = (processes.LOG_DIR / f"node5-{node.port}.log").read_text()
    assert "OPENENGINE_GRPC_SERVER is ignored" in log
    assert "grpc_server=grpcio" in log
    code = (
        "import os; os.environ['OPENENGINE_GRPC_SERVER']='pygrpc-native'; import grpc; "
        "from openengine_serve.common.grpc_server import create_internal_server; "
        "s = create_internal_server(); print(type(s).__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30).stdout
    assert out.strip().startswith("grpc"), out


def test_identical_tokens_on_both_servers(cluster):
    """And with the lane's window (default) or without (OPENENGINE_LANE_WINDOW=0: no limit)."""
    coord, nodes = cluster
    frontends = {
        s: processes.frontend(coord.target, s, "--frontend-id", f"fe-identical-{s}").start()
        for s in ("grpcio", "pygrpc-native")
    }
    frontends["no-window"] = processes.frontend(
        coord.target, "grpcio", "--lane-window", "0", "--frontend-id", "fe-identical-no-window"
    ).start()
    try:
        for f in frontends.values():
            f.wait_ready(60)
        streams = {}
        for server, f in frontends.items():
            with Client(f.target) as client:
                reqs = [request(f"prompt number {i}", max_tokens=30, seed=i, ignore_eos=False) for i in range(4)]
                reqs[0].sampling.num_sequences = 2
                streams[server] = [{k: v["ids"] for k, v in by_output(collect(client, r)).items()} for r in reqs]
    finally:
        for f in frontends.values():
            f.stop()
    assert streams["grpcio"] == streams["pygrpc-native"] == streams["no-window"]
    node_logs = "".join((processes.LOG_DIR / f"{n.name}-{n.port}.log").read_text() for n in nodes)
    assert f"frontend_id=fe-identical-grpcio window={FrontendConfig().lane_window}" in node_logs
    assert "frontend_id=fe-identical-no-window window=0" in node_logs


def test_two_native_workers_share_one_port(cluster):
    coord, _ = cluster
    fe = processes.frontend(coord.target, "pygrpc-native", "--workers", "2").start()
    try:
        fe.wait_ready(60)
        seen = set()
        for _ in range(40):
            # a fresh channel per call: a new connection, which the kernel may hand to either worker
            with Client(fe.target) as client:
                info = client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=5)
                assert info.extra["grpc_server"] == "pygrpc-native"
                seen.add(info.instance_id)
                responses = collect(client, request(max_tokens=3))
                assert responses[-1].HasField("usage")
            if len(seen) == 2:
                break
        assert len(seen) == 2, f"only {seen} answered"
    finally:
        assert fe.stop() == 0
