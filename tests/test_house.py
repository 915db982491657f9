"""The house rules a newcomer relies on: a module holds one concept, whatever its
length, so no private name (``_x``) of one module is imported or used by another, and
no class is assembled from mixins split out of it (a private base class would cross
modules); and no import circle between the modules (issue 29 point 3; issue 44 part 4
replaced the 450-line rule by the private-name rule).

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


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_crossings(package: Path) -> set[str]:
    """``importer -> module.name`` for each private name of a module of ``package`` that
    another module imports (``from M import _x``) or reads (``M._x``, where ``M`` was
    imported as a module of the package), package prefix left out."""
    files = module_files(package)
    known = set(files)
    prefix = package.name + "."
    out: set[str] = set()
    for name, path in files.items():
        tree = parse(path.read_text(), str(path))
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        bound: dict[str, str] = {}  # a local name -> the package module it is
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    base = here.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                if module not in known:
                    continue
                for alias in node.names:
                    full = f"{module}.{alias.name}"
                    if full in known:
                        bound[alias.asname or alias.name] = full
                    elif _is_private(alias.name) and module != name:
                        out.add(f"{name} -> {full}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in known and alias.asname:
                        bound[alias.asname] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                module = bound.get(node.value.id)
                if module and module != name and _is_private(node.attr):
                    out.add(f"{name} -> {module}.{node.attr}")
    return {line.replace(prefix, "") for line in out}


def test_no_private_name_crosses_modules() -> None:
    found = sorted(private_crossings(PACKAGE))
    assert not found, (
        f"private names used across modules: {found}. Make the name public in the module "
        "that owns the concept, or move its user there (a module holds one concept)."
    )


def tiny_package(tmp_path: Path, modules: dict[str, str]) -> Path:
    """A package named like ours under ``tmp_path`` with a ``sub`` package and the
    ``modules`` given (path relative to the package -> source)."""
    pkg = tmp_path / ROOT
    (pkg / "sub").mkdir(parents=True)
    for name, text in {"__init__.py": "", "sub/__init__.py": "", **modules}.items():
        (pkg / name).write_text(text)
    return pkg


def test_a_private_import_or_read_across_modules_is_found(tmp_path: Path) -> None:
    pkg = tiny_package(
        tmp_path,
        {
            "sub/a.py": "_X = 1\nclass _Mixin: ...\n__all__ = []\n",
            "sub/b.py": "from torchtitan_zephon.sub.a import _Mixin, __all__\n",
            "sub/c.py": "from . import a as m\ndef f():\n    return m._X\n",
            "d.py": "from torchtitan_zephon.sub import a\nY = a.X\n",  # public
        },
    )
    assert private_crossings(pkg) == {"sub.b -> sub.a._Mixin", "sub.c -> sub.a._X"}


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
