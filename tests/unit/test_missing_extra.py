"""A command whose extra is missing says so in one line, naming the extra to install (e.g. after
`pip install '.[native]'`), instead of a component's ModuleNotFoundError traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from openengine_serve.common.net import free_port

# Installed in every Python process of the command (its components too), through sitecustomize: the modules
# named in OPENENGINE_TEST_BLOCKED import as if they were not installed.
BLOCKER = """
import importlib.abc, os, sys

BLOCKED = set(os.environ["OPENENGINE_TEST_BLOCKED"].split(","))


class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
"""
# What `pip install '.[native]'` lacks of the node's and the frontend's extras.
NOT_INSTALLED = "mpi4py,zmq,llama_cpp,llguidance,grpc_reflection"


@pytest.mark.parametrize(
    "command, extra",
    [
        (["up", "--host", "127.0.0.1", "--port", "{port}", "--nodes", "1"], "all"),
        (["node", "--host", "127.0.0.1", "--port", "{port}", "--metrics-port", "0"], "node"),
        (["frontend", "--host", "127.0.0.1", "--port", "{port}", "--metrics-port", "0"], "frontend"),
    ],
    ids=["up", "node", "frontend"],
)
def test_a_missing_extra_is_one_line_naming_it(tmp_path, command, extra):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH", "")])),
        "OPENENGINE_TEST_BLOCKED": NOT_INSTALLED,
    }
    port = str(free_port("127.0.0.1"))
    argv = [sys.executable, "-m", "openengine_serve", *(port if arg == "{port}" else arg for arg in command)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"needs the extra '{extra}'" in done.stderr and f"pip install 'openengine-serve[{extra}]'" in done.stderr


def test_the_bench_command_without_its_extra_is_one_line_naming_it(tmp_path):
    """`openengine-bench` is installed with every install of the project; without its extra it says what to
    install (--help: what would run at once, were the check missing)."""
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH", "")])),
        "OPENENGINE_TEST_BLOCKED": "matplotlib",
    }
    argv = [sys.executable, "-m", "openengine_bench", "--help"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "no module matplotlib" in done.stderr and "pip install 'openengine-serve[bench]'" in done.stderr
