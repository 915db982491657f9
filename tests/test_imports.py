"""The import contract (issue 19 point 6): the parts import-linter cannot check.

``pyproject.toml`` (``[tool.importlinter]``) holds the contract that ``lint-imports``
checks in ``scripts/test.sh``: titan -> job -> {order, ingest} -> store, ``order``
never imports ``ingest``, the engine never imports torchtitan. Here:

- no module under ``store/``, ``order/`` or ``ingest/`` imports ``torch.distributed``
  (a submodule of an external package, which import-linter cannot forbid) or
  torchtitan, at module level or inside a function, nor reaches
  ``torch.distributed`` as an attribute of ``torch``;
- the layers contract names every top-level module and package, so a new one
  cannot sit outside the rule;
- ``lint-imports`` fails on scratch copies of the package with one bad import per
  contract (skipped where import-linter is not installed: the ``test`` extra has it).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "torchtitan_zephon"
PYPROJECT = REPO / "pyproject.toml"
ENGINE = ("store", "order", "ingest")


def parse(source: str, filename: str) -> ast.Module:
    """``ast.parse``, tried again when CPython 3.11 (before 3.11.8) raises its spurious
    "AST constructor recursion depth mismatch" SystemError (cpython gh-106905: the AST
    builder's depth count is shared by the interpreter's threads, and this test process
    has threads of earlier tests). Any other error is raised as it is."""
    for attempt in range(3):
        try:
            return ast.parse(source, filename)
        except SystemError as e:
            if "recursion depth mismatch" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")


FORBIDDEN = ("torch.distributed", "torchtitan")


def _is_forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def forbidden_imports(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, module) of every use of torch.distributed or torchtitan in ``source``:
    ``import``/``from`` statements anywhere (functions included), ``importlib.import_module``
    and ``__import__`` of a constant name, and ``torch.distributed`` reached as an
    attribute of a name bound to ``torch``."""
    tree = parse(source, filename)
    found: list[tuple[int, str]] = []
    torch_names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_forbidden(alias.name):
                    found.append((node.lineno, alias.name))
                elif alias.name == "torch" or (
                    alias.name.startswith("torch.") and alias.asname is None
                ):
                    torch_names.add(alias.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if _is_forbidden(node.module):
                found.append((node.lineno, node.module))
            else:
                for alias in node.names:
                    if _is_forbidden(f"{node.module}.{alias.name}"):
                        found.append((node.lineno, f"{node.module}.{alias.name}"))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            dynamic = (isinstance(func, ast.Name) and func.id == "__import__") or (
                isinstance(func, ast.Attribute) and func.attr == "import_module"
            )
            first = node.args[0]
            if (
                dynamic
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
                and _is_forbidden(first.value)
            ):
                found.append((node.lineno, first.value))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "distributed"
            and isinstance(node.value, ast.Name)
            and node.value.id in torch_names
        ):
            found.append((node.lineno, "torch.distributed"))
    return sorted(set(found))


def engine_violations(package: Path) -> list[str]:
    """``path:line imports module`` for each forbidden import under the engine's folders."""
    out = []
    for part in ENGINE:
        for path in sorted((package / part).rglob("*.py")):
            for line, name in forbidden_imports(path.read_text(), str(path)):
                out.append(f"{path.relative_to(package.parent).as_posix()}:{line} imports {name}")
    return out


def top_level_modules(package: Path) -> set[str]:
    """The package's top-level modules (``x.py``) and packages (folders holding Python)."""
    names = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    names |= {
        p.name
        for p in package.iterdir()
        if p.is_dir() and p.name != "__pycache__" and any(p.rglob("*.py"))
    }
    return names


def contract_layers(pyproject: Path, container: str = "torchtitan_zephon") -> set[str]:
    """The module names the layers contract(s) over ``container`` place."""
    config = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]
    names: set[str] = set()
    for contract in config["contracts"]:
        if contract["type"] == "layers" and contract.get("containers") == [container]:
            for layer in contract["layers"]:
                names |= {n.strip().strip("()") for n in re.split(r"[|:]", layer)}
    return names


def unplaced_modules(package: Path, pyproject: Path) -> list[str]:
    """The top-level modules of ``package`` that no layer of ``pyproject`` names."""
    return sorted(top_level_modules(package) - contract_layers(pyproject))


def _scratch_copy(root: Path) -> Path:
    """The package's modules and pyproject.toml, copied under ``root``."""
    shutil.copytree(
        PACKAGE, root / "torchtitan_zephon", ignore=shutil.ignore_patterns("__pycache__", "assets")
    )
    shutil.copy(PYPROJECT, root / "pyproject.toml")
    return root / "torchtitan_zephon"


# -- the engine never imports torch.distributed or torchtitan --------------------------


def test_engine_imports_neither_torch_distributed_nor_torchtitan() -> None:
    for part in ENGINE:
        assert any((PACKAGE / part).rglob("*.py")), f"no modules under {part}/"
    assert engine_violations(PACKAGE) == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import torch.distributed\n", [(1, "torch.distributed")]),
        ("import torch.distributed.checkpoint as dcp\n", [(1, "torch.distributed.checkpoint")]),
        ("from torch import distributed as dist\n", [(1, "torch.distributed")]),
        ("from torch.distributed import barrier\n", [(1, "torch.distributed")]),
        ("def f():\n    from torch.distributed import get_rank\n", [(2, "torch.distributed")]),
        ("import torchtitan\n", [(1, "torchtitan")]),
        (
            "class A:\n    def f(self):\n        import torchtitan.train\n",
            [(3, "torchtitan.train")],
        ),
        ("from torchtitan.tools.logging import logger\n", [(1, "torchtitan.tools.logging")]),
        (
            "import importlib\nimportlib.import_module('torchtitan.train')\n",
            [(2, "torchtitan.train")],
        ),
        ("__import__('torch.distributed')\n", [(1, "torch.distributed")]),
        (
            "import torch\n\n\ndef f():\n    return torch.distributed.get_rank()\n",
            [(5, "torch.distributed")],
        ),
        ("import torch as t\nt.distributed.barrier()\n", [(2, "torch.distributed")]),
        ("import torch.nn\ntorch.distributed.barrier()\n", [(2, "torch.distributed")]),
        # allowed: torch itself, our own package, a `distributed` attribute of something else
        ("import torch\nx = torch.tensor([1])\n", []),
        ("from torchtitan_zephon.store.format import StoreError\n", []),
        ("import torchtitan_zephon.order\n", []),
        ("import torch.nn as nn\nnn.distributed = 1\n", []),
        ("from . import distributed\nfrom .torchtitan import x\n", []),
    ],
)
def test_forbidden_imports_finds_every_form(source: str, expected: list[tuple[int, str]]) -> None:
    assert forbidden_imports(source) == expected


def test_engine_violation_in_a_function_of_a_real_module_is_reported(tmp_path: Path) -> None:
    copy = _scratch_copy(tmp_path)
    module = copy / "order" / "__init__.py"
    lines = module.read_text().splitlines()
    lines += ["", "", "def _rank() -> int:", "    import torch.distributed as dist", ""]
    lines += ["    return dist.get_rank()", ""]
    module.write_text("\n".join(lines))
    line = len(lines) - 3
    assert engine_violations(copy) == [
        f"torchtitan_zephon/order/__init__.py:{line} imports torch.distributed"
    ]


# -- the contract names every top-level module -----------------------------------------


def test_contract_names_every_top_level_module() -> None:
    named = {"run", "configs", "train", "tracker", "job", "titan", "cli", "bench"}
    assert named | set(ENGINE) <= top_level_modules(PACKAGE)
    assert unplaced_modules(PACKAGE, PYPROJECT) == []


def test_a_new_top_level_module_or_package_is_reported_unplaced(tmp_path: Path) -> None:
    package = tmp_path / "torchtitan_zephon"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in top_level_modules(PACKAGE):
        (package / f"{name}.py").write_text("")
    assert unplaced_modules(package, PYPROJECT) == []
    (package / "extras.py").write_text("")
    (package / "plugins" / "inner").mkdir(parents=True)
    (package / "plugins" / "inner" / "hook.py").write_text("")
    (package / "assets").mkdir()
    (package / "assets" / "tokenizer.json").write_text("{}")
    assert unplaced_modules(package, PYPROJECT) == ["extras", "plugins"]
    pyproject = tmp_path / "pyproject.toml"
    layers = sorted(top_level_modules(PACKAGE) - {"run", "configs"})
    layers[2:4] = [" | ".join(layers[2:4])]  # independent siblings are read too
    pyproject.write_text(
        '[tool.importlinter]\nroot_packages = ["torchtitan_zephon"]\n'
        '[[tool.importlinter.contracts]]\nname = "layers"\ntype = "layers"\n'
        f'containers = ["torchtitan_zephon"]\nlayers = {json.dumps(layers)}\n'
    )
    assert unplaced_modules(package, pyproject) == ["configs", "extras", "plugins", "run"]


# -- lint-imports fails on a violation of each contract --------------------------------


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    pytest.importorskip("importlinter")
    code = "import sys; from importlinter.cli import lint_imports_command; lint_imports_command()"
    return subprocess.run(
        [sys.executable, "-c", code, "--no-cache", "--no-logo", str(root / "pyproject.toml")],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _append(module: Path, *lines: str) -> None:
    module.write_text(module.read_text() + "\n\n" + "\n".join(lines) + "\n")


def test_lint_imports_fails_on_a_bad_import_of_each_contract(tmp_path: Path) -> None:
    package = _scratch_copy(tmp_path)
    clean = _lint_imports(tmp_path)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "0 broken" in clean.stdout

    _append(
        package / "order" / "__init__.py",
        "def _units():",
        "    from torchtitan_zephon.ingest import units",
        "    return units",
    )
    _append(package / "store" / "__init__.py", "import torchtitan  # noqa: E402")
    _append(package / "job" / "__init__.py", "import torchtitan_zephon.titan  # noqa: E402")
    _append(
        package / "titan" / "__init__.py",
        "from torchtitan_zephon.ingest import prepare  # noqa: E402",
    )
    broken = _lint_imports(tmp_path)
    out = re.sub(r"\s+", " ", broken.stdout)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "order never imports ingest BROKEN" in out
    assert "torchtitan_zephon.order -> torchtitan_zephon.ingest.units" in out
    assert "torchtitan_zephon.job -> torchtitan_zephon.titan " in out
    assert "never imports torchtitan (torch.distributed: tests/test_imports.py) BROKEN" in out
    assert "torchtitan_zephon.store -> torchtitan " in out
    assert "it neither ingests nor opens a store itself BROKEN" in out
    assert "torchtitan_zephon.titan -> torchtitan_zephon.ingest.prepare" in out


def test_lint_imports_fails_on_an_unplaced_top_level_module(tmp_path: Path) -> None:
    package = _scratch_copy(tmp_path)
    (package / "extras.py").write_text('"""A module no layer names."""\n')
    result = _lint_imports(tmp_path)
    out = re.sub(r"\s+", " ", result.stdout + result.stderr)
    assert result.returncode == 1, out
    assert "torchtitan_zephon.extras" in out


def _package_imports() -> list[tuple[str, int, str, str]]:
    """Every ``from torchtitan_zephon... import NAME`` of the package, the tests and the
    scripts, at module level or inside a function: (file, line, module, name)."""
    out = []
    for root in (PACKAGE, REPO / "tests", REPO / "scripts"):
        for path in sorted(root.rglob("*.py")):
            tree = parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    if node.module.split(".")[0] == "torchtitan_zephon":
                        for alias in node.names:
                            out.append((str(path.relative_to(REPO)), node.lineno, node.module,
                                        alias.name))  # fmt: skip
    return out


def test_every_name_imported_from_the_package_exists():
    """A name moved to another module (a refactor) leaves no import behind, also one
    inside a function that no test runs."""
    import importlib

    missing = []
    for where, line, module, name in _package_imports():
        mod = importlib.import_module(module)
        if name != "*" and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{where}:{line}: {module} has no {name}")
    assert not missing, "\n".join(missing)
