"""ruff over the whole tree with the rules in pyproject.toml ([tool.ruff.lint]): unused or undefined names,
syntax errors, mutable default arguments. Generated code (service/openengine_serve/api) is excluded there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ruff_finds_no_defects():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                           "service", "tests", "tools", "scripts"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"ruff check found defects:\n{done.stdout}{done.stderr}"
