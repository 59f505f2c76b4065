"""ruff over the whole tree with the rules and format in pyproject.toml ([tool.ruff]), and mypy over service/
([tool.mypy]). Generated code (service/openengine_serve/api) is excluded there."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


TREES = ["service", "tests", "tools", "scripts"]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--no-cache", *TREES],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_ruff_finds_no_defects():
    done = ruff("check", "--output-format", "concise")
    assert done.returncode == 0, f"ruff check found defects:\n{done.stdout}{done.stderr}"


def test_code_is_formatted():
    done = ruff("format", "--check")
    assert done.returncode == 0, f"run `ruff format {' '.join(TREES)}`:\n{done.stdout}{done.stderr}"


def test_mypy_finds_no_type_errors():
    # A cache outside the tree, one per checkout: later runs check again only what changed (mypy compares each
    # cached module with its source, so a stale cache cannot hide an error).
    checkout = hashlib.sha256(str(REPO).encode()).hexdigest()[:12]
    cache = Path(tempfile.gettempdir()) / f"openengine-serve-mypy-{checkout}"
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, f"mypy found type errors:\n{done.stdout}{done.stderr}"
