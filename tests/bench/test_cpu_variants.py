"""The CPU-variant bench's short form (openengine_bench.cpu_variants): each subject's process loads the variant
it names, decodes the real model, and the table and JSON report it."""

from __future__ import annotations

import json
import subprocess
import sys


def test_short_run_loads_each_subject_and_reports_its_decode_speed(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "openengine_bench.cpu_variants", "--variants", "best,haswell",
         "--rounds", "1", "--steps", "4", "--output", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "cpu_variants.json").read_text())
    median = result["median"]
    assert median["haswell"]["variant"] == "haswell"
    assert median["best"]["variant"] not in ("", "built in"), median  # llama.cpp's choice, by name
    for subject in ("best", "haswell"):
        assert median[subject]["1"] > 0 and median[subject]["32"] > 0, median
    assert "| haswell | haswell |" in done.stdout, done.stdout
