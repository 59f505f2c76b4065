"""Fixtures for the Helm chart tests: render the chart with the Helm v4 library
(PyPI helm-python-sdk, no helm binary, no cluster) and parse what it renders.

These tests never skip: a missing tool is a failure that names the package to
install (CI installs the project's dev extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .chart_helpers import CHART_DIR, NAMESPACE, RELEASE, VARIANTS, Rendered, require


@pytest.fixture(scope="session")
def helm() -> Any:
    return require("helm_python")


@pytest.fixture(scope="session")
def yaml() -> Any:
    return require("yaml")


@pytest.fixture(scope="session")
def chart(helm: Any) -> Any:
    assert (CHART_DIR / "Chart.yaml").is_file(), f"no chart at {CHART_DIR}"
    loaded = helm.Chart.load(str(CHART_DIR))
    yield loaded
    loaded.close()


@pytest.fixture(scope="session")
def render(chart: Any, yaml: Any):
    """render(values, release=RELEASE) -> Rendered; cached per value set."""
    cache: dict[str, Rendered] = {}

    def _render(values: dict[str, Any] | None = None, release: str = RELEASE) -> Rendered:
        key = repr((values, release))
        if key not in cache:
            files = chart.render(values or {}, name=release, namespace=NAMESPACE, is_install=True)
            cache[key] = Rendered(files, yaml)
        return cache[key]

    return _render


@pytest.fixture(scope="session")
def rendered_dir(render, tmp_path_factory) -> Path:
    """Every variant's `helm template`-style stream written to <variant>.yaml."""
    out = tmp_path_factory.mktemp("rendered")
    for variant, values in VARIANTS.items():
        (out / f"{variant}.yaml").write_text(render(values).stream)
    return out
