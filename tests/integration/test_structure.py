"""The package's layering: no import cycle, and imports only in the direction data flows.

Imports made inside functions count too (they are what used to hide a cycle), and so do those under
``TYPE_CHECKING``. The layers, in the order data passes through them, are in ``docs/DESIGN.md``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "protrain_fx"

#: Layer -> layers it must not import (a module's layer is its folder, or its own name at the top).
FORBIDDEN = {
    "runtime": {"passes", "planner", "search", "profile", "analysis", "inspect", "backend", "capture"},
    "analysis": {"planner", "passes", "profile", "inspect", "backend", "runtime"},
    "search": {"analysis", "planner", "passes", "profile", "inspect", "backend", "capture", "runtime"},
    "profile": {"planner", "passes", "inspect", "backend", "capture"},
    "planner": {"passes", "inspect", "backend"},
    "passes": {"planner", "inspect", "backend", "profile"},
    "capture": {"analysis", "planner", "passes", "profile", "search", "inspect", "backend", "runtime"},
    "progress": {"analysis", "planner", "passes", "profile", "search", "inspect", "backend", "runtime", "capture",
                 "state", "config", "errors", "plan", "meta", "machine", "chunks", "integrations"},
    "state": {"analysis", "planner", "passes", "profile", "search", "inspect", "backend", "runtime", "capture"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its source."""
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for m, f in modules.items():
        package = m if f.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for name in names:
                while name and name not in modules:
                    name = name.rsplit(".", 1)[0] if "." in name else ""
                if name and name != m and name != "protrain_fx":
                    edges[m].add(name)
    return edges


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_no_import_cycle() -> None:
    edges = _imports(_modules())
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n] if n in path else [m, n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_imports_follow_the_data_flow() -> None:
    edges = _imports(_modules())
    wrong = [
        f"{m} -> {n}"
        for m, outs in sorted(edges.items())
        for n in sorted(outs)
        if _layer(n) in FORBIDDEN.get(_layer(m), set())
    ]
    assert not wrong, "imports against the data flow: " + ", ".join(wrong)


def test_the_cost_model_and_the_search_import_neither_torch_nor_fx() -> None:
    for f in sorted((PACKAGE / "search").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "torch" or n.startswith("torch.") for n in names), f"{f.name} imports {names}"


def test_no_module_is_over_700_lines() -> None:
    long = {f.name: n for f in PACKAGE.rglob("*.py") if (n := len(f.read_text().splitlines())) > 700}
    assert not long, long
