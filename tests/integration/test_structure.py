"""The package's layering: no import cycle, and imports only in the direction data flows.

Imports made inside functions count too (they are what used to hide a cycle), and so do those under
``TYPE_CHECKING``. The layers, in the order data passes through them, are in ``docs/DESIGN.md``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "protrain_fx"

#: Layer -> layers it must not import (a module's layer is its folder, or its own name at the top).
FORBIDDEN = {
    "runtime": {"passes", "planner", "search", "profile", "analysis", "inspect", "backend", "capture", "integrations",
                "api"},
    "analysis": {"planner", "passes", "profile", "inspect", "backend", "runtime"},
    "search": {"analysis", "planner", "passes", "profile", "inspect", "backend", "capture", "runtime"},
    "profile": {"planner", "passes", "inspect", "backend", "capture"},
    "planner": {"passes", "inspect", "backend"},
    "passes": {"planner", "inspect", "backend", "profile"},
    "capture": {"analysis", "planner", "passes", "profile", "search", "inspect", "backend", "runtime"},
    "progress": {"analysis", "planner", "passes", "profile", "search", "inspect", "backend", "runtime", "capture",
                 "state", "config", "errors", "plan", "meta", "machine", "chunks", "integrations"},
    "state": {"analysis", "planner", "passes", "profile", "search", "inspect", "backend", "runtime", "capture"},
    "handoffs": {"analysis", "planner", "passes", "profile", "search", "inspect", "backend", "runtime", "capture",
                 "state"},
}
for _forbidden in FORBIDDEN.values():  # api.py (offload()) sits above every layer: only the root imports it
    _forbidden.add("api")


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its source. ``from protrain_fx import X``
    is an edge to the submodule ``X`` where there is one, else to the package root (which must then
    have run far enough to define ``X``: the hidden cycle of a root that imports its users)."""
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
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for name in names:
                while name and name not in modules:
                    name = name.rsplit(".", 1)[0] if "." in name else ""
                if name and name != m:
                    edges[m].add(name)
    return edges


def _imports_inside_functions() -> list[tuple[str, int, str]]:
    """(file, line, the line and the one above) of every package import made inside a function."""
    found = []
    for f in sorted(PACKAGE.rglob("*.py")):
        lines = f.read_text().splitlines()
        tree = ast.parse(f.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                ours = (isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("protrain_fx"))) \
                    or (isinstance(node, ast.Import) and any(a.name.startswith("protrain_fx") for a in node.names))
                if ours:
                    # the comment above a group of imports covers the group; else one on the line
                    above = node.lineno - 2
                    while above > 0 and lines[above].strip().startswith(("from ", "import ")):
                        above -= 1
                    found.append((str(f.relative_to(PACKAGE.parent)), node.lineno,
                                  lines[above] + "\n" + "\n".join(lines[node.lineno - 1:node.end_lineno])))
    return found


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


def test_imports_inside_functions_are_few_and_each_says_why() -> None:
    """An import inside a function hides a dependency from the module's head; the few left (an
    optional package's integration, the package root kept light) carry their reason beside them."""
    inside = _imports_inside_functions()
    assert len(inside) <= 10, "imports inside functions: " + ", ".join(f"{f}:{n}" for f, n, _ in inside)
    silent = [f"{f}:{n}" for f, n, text in inside if "#" not in text]
    assert not silent, "imports inside functions without their reason beside them: " + ", ".join(silent)


def test_imports_follow_the_data_flow() -> None:
    edges = _imports(_modules())
    wrong = [
        f"{m} -> {n}"
        for m, outs in sorted(edges.items())
        for n in sorted(outs)
        if _layer(n) in FORBIDDEN.get(_layer(m), set())
    ]
    assert not wrong, "imports against the data flow: " + ", ".join(wrong)


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of a module's module, classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def test_the_planner_holds_no_offload_handle() -> None:
    """The planner decides from data (``handoffs.ChunkFacts``, ``handoffs.StepReadings``) and hands back
    decisions; the backend holds the offload handle and applies them, or lends the planner a narrow
    port where a search places chunks mid-way (``planner.verify.Placer``, ``planner.rates.RunningOffload``).
    So no planner module imports the handle's module, or names ``OffloadHandle`` in its code (an import,
    a name, an attribute, a string annotation; its docstrings may say what the backend does with it)."""
    modules = _modules()
    edges = _imports(modules)
    handle_module = "protrain_fx.runtime.offload.handle"
    found = []
    for m, f in modules.items():
        if _layer(m) != "planner":
            continue
        if handle_module in edges[m]:
            found.append(f"{m} imports {handle_module}")
        tree = ast.parse(f.read_text())
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.alias):
                names = [node.name.rsplit(".", 1)[-1], node.asname or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                names = re.findall(r"\w+", node.value)
            if "OffloadHandle" in names:
                found.append(f"{m}:{getattr(node, 'lineno', '?')} names OffloadHandle")
    assert not found, "the planner holds the offload handle: " + ", ".join(found)


def test_the_cost_model_and_the_search_import_neither_torch_nor_fx() -> None:
    for f in sorted((PACKAGE / "search").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "torch" or n.startswith("torch.") for n in names), f"{f.name} imports {names}"


def test_no_folder_holds_more_than_12_modules() -> None:
    """A folder is one subsystem a reader takes in at once (``runtime/`` is in rooms for that). The
    package root, the entry points and the records every layer shares, is not a subsystem."""
    crowded = {str(d.relative_to(PACKAGE.parent)): n for d in PACKAGE.rglob("*/")
               if d.is_dir() and (n := len([f for f in d.glob("*.py") if f.name != "__init__.py"])) > 12}
    assert not crowded, crowded


def test_no_module_is_over_700_lines() -> None:
    long = {f.name: n for f in PACKAGE.rglob("*.py") if (n := len(f.read_text().splitlines())) > 700}
    assert not long, long


def test_the_environment_is_read_in_the_settings_module_only() -> None:
    """Every environment variable the package reads is read in ``settings.py`` (one place to find
    them, one API for tests to change them), which imports nothing of the package."""
    reads = []
    for f in sorted(PACKAGE.rglob("*.py")):
        if f == PACKAGE / "settings.py":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv")
                    and isinstance(node.value, ast.Name) and node.value.id == "os"):
                reads.append(f"{f.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not reads, "the environment read outside settings.py: " + ", ".join(reads)
    assert not _imports(_modules())["protrain_fx.settings"]


def test_design_md_names_every_module_with_its_job() -> None:
    """``docs/DESIGN.md``'s "Every module" section names each module of the package (a new one is
    added there with its one job)."""
    design = (PACKAGE.parent / "docs" / "DESIGN.md").read_text()
    section = design.split("## Every module, and its one job", 1)[1].split("\n## ", 1)[0]
    missing = sorted(str(f.relative_to(PACKAGE)) for f in PACKAGE.rglob("*.py")
                     if f.name != "__init__.py" and f"`{f.stem}`" not in section)
    assert not missing, "modules not in DESIGN.md's module list: " + ", ".join(missing)


#: The modules that may store into a record: capture.py makes it, backend.py drives one compile and
#: stores what each phase returns (``capture.CapturedGraph``).
RECORD_OWNERS = {"capture.py", "backend.py"}
#: Methods that change a list, dict or set in place.
_MUTATORS = {"append", "extend", "insert", "update", "clear", "pop", "popitem", "remove", "setdefault", "add",
             "discard", "sort", "reverse", "__setitem__", "__delitem__"}


def _record_names(fn: ast.AST) -> set[str]:
    """The names a function's code calls a record: ``record``, and any argument or variable
    annotated ``CapturedGraph``."""
    names = {"record"}
    for node in ast.walk(fn):
        annotated = (node.arg, node.annotation) if isinstance(node, ast.arg) else (
            (node.target.id, node.annotation) if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            else None)
        if annotated and annotated[1] is not None and "CapturedGraph" in ast.unparse(annotated[1]):
            names.add(annotated[0])
    return names


def _into_record(target: ast.AST, names: set[str]) -> bool:
    """Whether ``target`` is a field of a record, or anything reached from one through attributes and
    items (``record.x``, ``record.x[k]``, ``record.x.y``); not the record itself, nor what a method
    of it returns."""
    through_attribute = False
    while isinstance(target, (ast.Attribute, ast.Subscript)):
        through_attribute |= isinstance(target, ast.Attribute)
        target = target.value
    return through_attribute and isinstance(target, ast.Name) and target.id in names


def _called(call: ast.Call) -> str:
    """The name a call calls (``setattr``, ``__setattr__`` of ``object.__setattr__``)."""
    return call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")


def _record_writes(tree: ast.AST) -> list[int]:
    """Lines of ``tree`` that assign to a record's fields or change one in place."""
    lines = []
    for fn in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        names = _record_names(fn)
        for node in ast.walk(fn):
            targets: list[ast.AST] = []
            if isinstance(node, ast.Assign):
                targets = [t for target in node.targets for t in ast.walk(target)
                           if isinstance(t, (ast.Attribute, ast.Subscript))]
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = list(node.targets)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
                targets = [node.func.value] if isinstance(node.func.value, (ast.Attribute, ast.Subscript)) else []
            elif isinstance(node, ast.Call) and node.args and _called(node) in ("setattr", "__setattr__"):
                targets = [ast.Attribute(value=node.args[0], attr="?")]  # setattr(record, ...), object.__setattr__
            if any(_into_record(t, names) for t in targets):
                lines.append(node.lineno)
    return sorted(set(lines))


def test_only_the_backend_stores_into_a_record() -> None:
    """The record is captured data plus what each phase returned (``capture.CapturedGraph``): a pass,
    the planner or an inspector returns its result, and the backend, which drives the compile,
    stores it. So no other module assigns to a record's fields (an object named ``record``, or
    annotated ``CapturedGraph``) or changes one in place (``.append``, ``[k] = ...``)."""
    found = [f"{f.relative_to(PACKAGE.parent)}:{line}"
             for f in sorted(PACKAGE.rglob("*.py")) if f.name not in RECORD_OWNERS or f.parent != PACKAGE
             for line in _record_writes(ast.parse(f.read_text()))]
    assert not found, "a record's fields written outside the backend: " + ", ".join(found)


def test_the_record_writes_check_finds_each_form() -> None:
    code = '''
def f(record, other: CapturedGraph, plain):
    record.budget = 1
    record.passes.append(2)
    record.inductor_plans["forward"] = 3
    other.auto_plan.phases = 4
    a, record.step = 5, 6
    setattr(record, "memory", 7)
    record.phases.update({})
    plain.budget = 8
    record.real_inputs().append(9)
    record = 10
'''
    assert _record_writes(ast.parse(code)) == [3, 4, 5, 6, 7, 8, 9]
