"""The import graph of the service and the benchmark, read from the source (every import statement, those
inside functions too): no circle, and no import from a lower layer to a higher one."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "openengine_serve": ROOT / "service" / "openengine_serve",
    "openengine_bench": ROOT / "tools" / "openengine_bench",
}
GENERATED = "openengine_serve.api"

# (importer prefix, imported prefix): a module under the first never imports one under the second.
UPWARD = [
    # The service never imports the benchmark (it finds `openengine-bench` as an entry point).
    ("openengine_serve", "openengine_bench"),
    # The engines know neither the processes that drive them nor the components above.
    *[
        ("openengine_serve.engine", higher)
        for higher in (
            "openengine_serve.node",
            "openengine_serve.frontend",
            "openengine_serve.coordinator",
            "openengine_serve.cli",
            "openengine_serve.local",
            "openengine_serve.client",
        )
    ],
    # An engine implements engine/interface.py; the worker creates it, never the other way round.
    ("openengine_serve.engine.llamacpp", "openengine_serve.engine.worker"),
    ("openengine_serve.engine.simulated", "openengine_serve.engine.worker"),
    ("openengine_serve.engine.interface", "openengine_serve.engine.llamacpp"),
    ("openengine_serve.engine.interface", "openengine_serve.engine.simulated"),
    # common/ is below every component.
    *[
        ("openengine_serve.common", f"openengine_serve.{higher}")
        for higher in ("engine", "node", "frontend", "coordinator", "cli", "local", "client")
    ],
]


def module_name(package: str, root: Path, path: Path) -> str:
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found = {}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            name = module_name(package, root, path)
            if not name.startswith(GENERATED):
                found[name] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports (a `from package import module` names the module)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [source] + [f"{source}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


@functools.cache
def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found) | {GENERATED}
    return {name: imports(name, path, known) - {GENERATED} for name, path in found.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_the_graph_sees_the_imports():
    edges = graph()
    assert "openengine_serve.engine.interface" in edges["openengine_serve.engine.llamacpp.engine"]
    assert "openengine_serve.common.wire.http2" in edges["openengine_serve.common.health_check"]
    assert "openengine_serve.engine.llamacpp.kv_layout" in edges["openengine_serve.engine.worker"]  # inside a function


def test_no_import_circle():
    assert circles(graph()) == []


@pytest.mark.parametrize("lower, higher", UPWARD, ids=[f"{lo}->{hi}" for lo, hi in UPWARD])
def test_no_upward_import(lower, higher):
    tied = sorted(
        f"{name} imports {target}"
        for name, targets in graph().items()
        if under(name, lower)
        for target in targets
        if under(target, higher)
    )
    assert not tied


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
