"""Import paths from before the layout by seam (issue 29 part c1) keep working, as the
same module objects (``torchtitan_zephon/old_paths.py``), and nothing in the package
or its scripts uses them."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from tests.test_imports import PACKAGE, REPO
from torchtitan_zephon.old_paths import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_new_module(old: str) -> None:
    new = importlib.import_module(MOVED[old])
    assert importlib.import_module(old) is new
    assert sys.modules[old] is new
    assert new.__name__ == MOVED[old] and new.__spec__.name == MOVED[old]


def test_every_old_path_names_a_module_that_exists_and_no_file_is_left_there() -> None:
    for old, new in MOVED.items():
        rel = new.split(".")[1:]
        assert (PACKAGE.joinpath(*rel).with_suffix(".py")).is_file() or (
            PACKAGE.joinpath(*rel, "__init__.py").is_file()
        ), new
        gone = old.split(".")[1:]
        assert not PACKAGE.joinpath(*gone).with_suffix(".py").exists(), old
        assert not PACKAGE.joinpath(*gone, "__init__.py").exists(), old


def test_old_names_work_in_a_fresh_process_in_every_import_form() -> None:
    code = (
        "from torchtitan_zephon.ownership import process\n"
        "from torchtitan_zephon.ownership.lock import RunFolderLock\n"
        "from torchtitan_zephon.loader import ZephonLoader\n"
        "import torchtitan_zephon.runs as runs\n"
        "from torchtitan_zephon.titan.trainer import ZephonTrainer\n"
        "from torchtitan_zephon.titan.init import TopologyFreeInit\n"
        "import torchtitan_zephon.titan.components.trainer as t\n"
        "import torchtitan_zephon.job.loader as l\n"
        "import torchtitan_zephon.run.recorded as r\n"
        "assert ZephonTrainer is t.ZephonTrainer and ZephonLoader is l.ZephonLoader\n"
        "assert runs is r and process.__name__ == 'torchtitan_zephon.run.process'\n"
        "assert RunFolderLock.__module__ == 'torchtitan_zephon.run.lock'\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_old_registry_module_still_parses_a_job() -> None:
    from torchtitan_zephon.train import parse_config

    old = parse_config(["--module", "torchtitan_zephon.configs", "--config", "llama3_tiny"])
    new = parse_config(["--module", "torchtitan_zephon.titan.jobs", "--config", "llama3_tiny"])
    assert type(old) is type(new) and old.training.seq_len == new.training.seq_len


def old_imports(source: str) -> list[str]:
    """The import lines of ``source`` that name a module by its old path."""
    found = []
    for line in source.splitlines():
        stripped = line.strip()
        if not stripped.startswith(("import ", "from ")):
            continue
        words = stripped.replace(",", " ").split()
        dotted = {w for w in words if w.startswith(PACKAGE.name)}
        if words[0] == "from" and len(words) > 3 and words[2] == "import":
            dotted |= {f"{words[1]}.{w}" for w in words[3:] if w.isidentifier()}
        if any(d == old or d.startswith(old + ".") for d in dotted for old in MOVED):
            found.append(stripped)
    return found


def test_old_imports_finds_every_form() -> None:
    assert old_imports(
        "import torchtitan_zephon.loader\n"
        "from torchtitan_zephon import runs, old_paths\n"
        "    from torchtitan_zephon.titan import trainer\n"
        "from torchtitan_zephon.ownership.lock import X\n"
        "from torchtitan_zephon.titan.components import trainer\n"
        "from torchtitan_zephon.titan.jobs import config_registry as configs\n"
        "from torchtitan_zephon.titan import platform\n"
    ) == [
        "import torchtitan_zephon.loader",
        "from torchtitan_zephon import runs, old_paths",
        "from torchtitan_zephon.titan import trainer",
        "from torchtitan_zephon.ownership.lock import X",
    ]


def test_nothing_in_the_package_or_scripts_imports_an_old_path() -> None:
    offenders = [
        f"{path.relative_to(REPO)}: {line}"
        for path in [*PACKAGE.rglob("*.py"), *(REPO / "scripts").glob("*.py")]
        if path.name != "old_paths.py"
        for line in old_imports(path.read_text())
    ]
    assert not offenders, offenders
