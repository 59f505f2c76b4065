"""The real Prometheus tools (Debian's `prometheus` package) for the monitoring tests.

With CI=true a missing binary is a failure (.ci/run installs the package);
elsewhere the tests skip and say what to install.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from openengine_serve.local import free_port

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "deploy" / "monitoring"
RULES = MONITORING / "openengine-alerts.yml"
DASHBOARD = MONITORING / "openengine-dashboard.json"
RULE_TESTS = MONITORING / "tests" / "alerts.test.yml"
RULE_TEST_FILES = tuple(sorted((MONITORING / "tests").glob("*.test.yml")))  # promtool unit tests of RULES
ADAPTER_RULES = MONITORING / "prometheus-adapter-rules.yaml"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        reason = f"`{name}` is not on PATH (Debian: apt-get install prometheus)"
        if IN_CI:
            pytest.fail(f"CI=true and {reason}", pytrace=False)
        pytest.skip(reason)
    return path


def alert_rules() -> list[dict[str, Any]]:
    """Every alerting rule of RULES, as written."""
    import yaml

    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panel_queries(rate_interval: str = "15s") -> list[tuple[str, str, str]]:
    """(panel title, refId, PromQL) of every query of the dashboard, with Grafana's
    variables replaced as Grafana would for "All namespaces"."""
    out = []
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$namespace", ".*").replace("$__rate_interval", rate_interval)
            out.append((panel["title"], target["refId"], expr))
    return out


class Prometheus:
    """A real Prometheus server on a free loopback port, with its own data directory."""

    def __init__(self, workdir: Path, config: dict[str, Any]) -> None:
        self.port = free_port()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.log = open(workdir / "prometheus.log", "ab")
        self.proc = subprocess.Popen(
            [
                binary("prometheus"),
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 30.0) -> Prometheus:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready after {timeout}s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return (self.workdir / "prometheus.log").read_text(errors="replace")[-3000:]

    def api(self, path: str, **params: Any) -> Any:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        body = json.loads(urllib.request.urlopen(url, timeout=10).read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.api("query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict[str, Any]]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def finite_values(result: list[dict[str, Any]]) -> list[float]:
    return [v for v in (float(s["value"][1]) for s in result) if math.isfinite(v)]
