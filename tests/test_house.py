"""The house rules a newcomer relies on (issue 29 point 3): no module of the package
over 450 lines, and no import circle between its modules.

Every import counts: at module level, inside a function, and under
``if TYPE_CHECKING:``. ``from P import NAME`` is an import of ``P.NAME`` when that is
a module of the package, else of ``P``. A package's ``__init__`` is the module ``P``;
importing ``P.M`` does not count as importing ``P`` (Python runs ``P/__init__`` first,
but ``P.M`` does not depend on what it holds).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_imports import PACKAGE, parse

MAX_LINES = 450
ROOT = PACKAGE.name


def module_files(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``package``."""
    found: dict[str, Path] = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported_modules(tree: ast.Module, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules that the module ``name`` imports anywhere in ``tree``."""
    here = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [
                f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` names a.b.c
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph(package: Path) -> dict[str, set[str]]:
    files = module_files(package)
    known = set(files)
    return {
        name: imported_modules(
            parse(path.read_text(), str(path)), name, path.name == "__init__.py", known
        )
        for name, path in files.items()
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_module_over_450_lines() -> None:
    long = {
        str(path.relative_to(PACKAGE.parent)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by concept): {long}"


def test_no_import_circle() -> None:
    found = circles(import_graph(PACKAGE))
    assert not found, f"import circles (move the shared part down): {found}"


def test_a_circle_through_a_function_or_type_checking_import_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / ROOT
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from torchtitan_zephon.sub import b\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n"
    )
    (pkg / "sub" / "c.py").write_text("def f():\n    import torchtitan_zephon.sub.a\n")
    (pkg / "d.py").write_text("from torchtitan_zephon.sub.a import x\n")  # into it, not part of it
    assert circles(import_graph(pkg)) == [
        ["torchtitan_zephon.sub.a", "torchtitan_zephon.sub.b", "torchtitan_zephon.sub.c"]
    ]
    (pkg / "sub" / "c.py").write_text("def f():\n    import os\n")
    assert circles(import_graph(pkg)) == []


def test_a_package_importing_its_own_module_is_no_circle(tmp_path: Path) -> None:
    pkg = tmp_path / ROOT
    (pkg / "store").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "store" / "__init__.py").write_text("from torchtitan_zephon.store import remote\n")
    (pkg / "store" / "reader.py").write_text("X = 1\n")
    (pkg / "store" / "remote.py").write_text("from torchtitan_zephon.store.reader import X\n")
    graph = import_graph(pkg)
    assert graph["torchtitan_zephon.store"] == {"torchtitan_zephon.store.remote"}
    assert graph["torchtitan_zephon.store.remote"] == {"torchtitan_zephon.store.reader"}
    assert circles(graph) == []
