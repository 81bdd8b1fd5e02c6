"""The package layering of issue H, checked from the source: no import runs upward, no cycle.

    core  <  elastic, ckpt  <  trainer  <  chaos

`core` imports none of ours; `elastic` and `ckpt` import only `core` (and themselves); `trainer`
imports those; `chaos` sits on top and nothing imports it. Imports inside functions and under
TYPE_CHECKING count too: a lazy import that runs upward is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "elastic", "ckpt", "trainer", "chaos")
ALLOWED = {
    "core": {"core"},
    "elastic": {"core", "elastic"},
    "ckpt": {"core", "ckpt"},
    "trainer": {"core", "elastic", "ckpt", "trainer"},
    "chaos": set(PACKAGES),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Our modules that `path` imports (absolute names; `from pkg import mod` resolves to pkg.mod if it is one)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in PACKAGES}


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    return {name: {m for m in _imports(path) if m in files and m != name} for name, path in files.items()}


def test_no_import_runs_upward():
    upward = [f"{mod} imports {dep}" for mod, deps in _graph().items() for dep in deps
              if dep.split(".")[0] not in ALLOWED[mod.split(".")[0]]]
    assert upward == []


def test_no_import_cycle_between_modules():
    graph = _graph()
    # A package's __init__ re-exporting its own modules is not a cycle a reader trips over.
    edges = {m: {d for d in deps if not (d == m.split(".")[0] and "." in m)} for m, deps in graph.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep] if dep in stack else [node, dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for mod in sorted(edges):
        if mod not in state:
            visit(mod, [mod])
    assert cycles == []


def test_nothing_imports_chaos():
    importers = [m for m, deps in _graph().items()
                 if not m.startswith("chaos") and any(d.startswith("chaos") for d in deps)]
    assert importers == []
