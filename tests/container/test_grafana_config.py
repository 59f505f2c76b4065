"""The observability profile's Grafana as Compose resolves it (`docker compose config`, no container):
read-only for anonymous viewers, no admin account, no login."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

from .conftest import REPO


def test_grafana_has_no_admin_account_and_no_login():
    docker = os.environ.get("DOCKER") or shutil.which("docker")
    assert docker, "the docker CLI (with the compose plugin) is needed: set DOCKER or put docker on PATH"
    proc = subprocess.run(
        [docker, "compose", "--profile", "observability", "config", "--format", "json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    env = json.loads(proc.stdout)["services"]["grafana"]["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert env["GF_SECURITY_DISABLE_INITIAL_ADMIN_CREATION"] == "true"
    assert env["GF_AUTH_DISABLE_LOGIN_FORM"] == "true" and env["GF_AUTH_BASIC_ENABLED"] == "false"
    assert not {"GF_SECURITY_ADMIN_USER", "GF_SECURITY_ADMIN_PASSWORD"} & env.keys()
