"""Generated code is committed and made only by scripts/gen_protos.sh: regenerate and compare."""

import filecmp
import os
import shutil
import subprocess
import sys

from ..conftest import REPO


def test_generated_code_matches_protos(tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "protos", copy / "protos")
    shutil.copytree(REPO / "scripts", copy / "scripts")
    subprocess.run(
        ["bash", str(copy / "scripts" / "gen_protos.sh")],
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHON": sys.executable},
    )
    fresh = copy / "service" / "openengine_serve" / "api"
    committed = REPO / "service" / "openengine_serve" / "api"
    fresh_files = sorted(p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    committed_files = sorted(
        p.relative_to(committed) for p in committed.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    )
    assert fresh_files == committed_files, "run scripts/gen_protos.sh and commit the result"
    differing = [str(p) for p in fresh_files if not filecmp.cmp(fresh / p, committed / p, shallow=False)]
    assert differing == [], f"generated code drifted from protos/: {differing}; run scripts/gen_protos.sh"
