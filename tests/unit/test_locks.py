"""requirements/*.lock (scripts/lock.sh) against pyproject.toml: each image's lock pins, with a hash, a version
that satisfies every requirement the image installs; a stale lock fails here, before a Docker build."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
IMAGES = {"coordinator": ["coordinator"], "frontend": ["frontend", "native"], "node": ["node"]}
COMPILED = "llama-cpp-python"  # pinned by its sdist in llama-cpp-python.lock
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def expand(requirements: list[str]) -> list[Requirement]:
    out = []
    for text in requirements:
        requirement = Requirement(text)
        if requirement.name == PROJECT["name"]:
            extras = PROJECT["optional-dependencies"]
            out += expand([r for extra in sorted(requirement.extras) for r in extras[extra]])
        else:
            out.append(requirement)
    return out


def read_lock(name: str) -> dict[str, str]:
    """name -> version of a lock file; every entry must carry a sha256 hash."""
    text = (REPO / "requirements" / f"{name}.lock").read_text().replace("\\\n", " ")
    pins = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)\s+--hash=sha256:[0-9a-f]{64}", line.strip())
        assert match, f"requirements/{name}.lock: not `name==version --hash=sha256:<hex>`: {line!r}"
        pins[canonical(match[1])] = match[2]
    return pins


@pytest.mark.parametrize("image", IMAGES)
def test_each_image_lock_satisfies_what_the_image_installs(image):
    pins = read_lock(image) | read_lock("llama-cpp-python")
    wanted = expand(
        PROJECT["dependencies"] + [r for extra in IMAGES[image] for r in PROJECT["optional-dependencies"][extra]]
    )
    for requirement in wanted:
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        version = pins.get(canonical(requirement.name))
        assert version is not None, f"{requirement} is not in requirements/{image}.lock: run scripts/lock.sh"
        assert requirement.specifier.contains(version, prereleases=True), (
            f"requirements/{image}.lock pins {requirement.name}=={version}, pyproject.toml wants {requirement}: "
            "run scripts/lock.sh"
        )
    assert COMPILED not in read_lock(image), "its wheel is built, not downloaded: only its sdist is locked"


def test_the_default_model_is_locked():
    model = re.search(
        r'^DEFAULT_MODEL_WHEEL = "([^"]+)"', (REPO / "service/openengine_serve/engine/model_card.py").read_text(), re.M
    )[1]
    name, version = model.split("==")
    assert read_lock("node-model") == {canonical(name): version}
