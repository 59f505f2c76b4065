"""requirements/*.lock (scripts/lock.sh) against pyproject.toml: each image's lock pins, with a hash, a version
that satisfies every requirement the image installs; a stale lock fails here, before a Docker build. Each pin's
hash is the hash of the file it names (scripts/bootstrap.sh downloads them into the venv's wheels/locked), and
the test environment runs the locked versions, as the images do."""

from __future__ import annotations

import hashlib
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
IMAGES = {"coordinator": ["coordinator"], "frontend": ["frontend", "native"], "node": ["node"]}
COMPILED = "llama-cpp-python"  # pinned by its sdist in llama-cpp-python.lock
LOCKED_FILES = Path(sys.prefix) / "wheels" / "locked"  # scripts/bootstrap.sh: every pin's file, downloaded once
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


def read_hashed_lock(name: str) -> dict[str, tuple[str, str]]:
    """name -> (version, sha256) of a lock file; every entry must carry a sha256 hash."""
    text = (REPO / "requirements" / f"{name}.lock").read_text().replace("\\\n", " ")
    pins = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)\s+--hash=sha256:([0-9a-f]{64})", line.strip())
        assert match, f"requirements/{name}.lock: not `name==version --hash=sha256:<hex>`: {line!r}"
        pins[canonical(match[1])] = (match[2], match[3])
    return pins


def read_lock(name: str) -> dict[str, str]:
    """name -> version of a lock file."""
    return {name: version for name, (version, _) in read_hashed_lock(name).items()}


def every_pin() -> dict[str, tuple[str, str]]:
    """Every lock's pins together; two locks that pin one package must pin the same file."""
    pins: dict[str, tuple[str, str]] = {}
    for lock in sorted((REPO / "requirements").glob("*.lock")):
        for name, pin in read_hashed_lock(lock.stem).items():
            known = pins.setdefault(name, pin)
            assert known == pin, f"{name}: requirements/{lock.name} pins {pin}, another lock {known}"
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


def locked_file(name: str, version: str) -> Path:
    """The file bootstrap downloaded for a pin: a wheel or an sdist named `<name>-<version>...`."""
    stem = re.compile(rf"{re.sub(r'[-_.]+', '[-_.]', name)}-{re.escape(version)}[-.]", re.I)
    found = [path for path in LOCKED_FILES.iterdir() if stem.match(path.name)] if LOCKED_FILES.is_dir() else []
    assert len(found) == 1, (
        f"{name}=={version}: expected one file in {LOCKED_FILES}, found {[p.name for p in found]} "
        "(scripts/bootstrap.sh downloads every locked pin there)"
    )
    return found[0]


def test_every_pin_is_the_hash_of_the_file_it_names():
    pins = every_pin()
    assert len(pins) > 30
    for name, (version, sha256) in pins.items():
        path = locked_file(name, version)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == sha256, (
            f"{path.name}: its sha256 is not the one requirements/*.lock pins for {name}=={version}: "
            "run scripts/lock.sh"
        )


def test_the_test_environment_runs_the_locked_versions():
    """bootstrap installs the project with the locks as constraints, so the tests exercise what the images ship."""
    installed = {canonical(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    pins = {name: version for name, (version, _) in every_pin().items()}
    differ = {name: (version, installed.get(name)) for name, version in pins.items() if installed.get(name) != version}
    assert not differ, f"locked version != installed version (scripts/bootstrap.sh installs the locks): {differ}"
