"""Import paths from before the house was laid out by seam (issue 29 part c1), kept
working: ``import torchtitan_zephon.loader`` is ``torchtitan_zephon.job.loader``, the
same module object, so code and tests written against the old paths run unchanged.
``torchtitan_zephon.configs`` stays the registry's name on the command line
(``--module torchtitan_zephon.configs --config FN``, as the README spells it).

Role: ``MOVED`` (old dotted name -> new) is the one table of moves; ``install`` puts a
finder at the front of ``sys.meta_path`` (``torchtitan_zephon/__init__`` calls it)
that answers an old name by importing the new module and handing back that object.

Invariant: an old name never loads a second copy of a module: ``sys.modules[old] is
sys.modules[new]``, so a class, a patched attribute or a module-level state is one
thing whichever path imported it. Nothing in the package imports an old path
(``tests/test_old_paths.py``); new code uses the new ones.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

_P = "torchtitan_zephon"

MOVED: dict[str, str] = {
    f"{_P}.{old}": f"{_P}.{new}"
    for old, new in {
        "loader": "job.loader",
        "runs": "run.recorded",
        "ownership": "run",
        "ownership.holder": "run.holder",
        "ownership.lock": "run.lock",
        "ownership.process": "run.process",
        "configs": "titan.jobs.config_registry",
        "titan.config": "titan.configs.zephon_section",
        "titan.job_view": "titan.configs.job_view",
        "titan.legacy_config": "titan.jobs.legacy_config",
        "titan.legacy_translate": "titan.jobs.legacy_translate",
        "titan.stock_config": "titan.jobs.stock_config",
        "titan.models": "titan.jobs.models",
        "titan.loss_chunks": "titan.configs.loss_chunks",
        "titan.dataloader": "titan.components.dataloader",
        "titan.validate": "titan.components.validate",
        "titan.trainer": "titan.components.trainer",
        "titan.attention": "titan.components.attention",
        "titan.job_data": "titan.start.job_data",
        "titan.accounting": "titan.components.accounting",
        "titan.checks": "titan.start.checks",
        "titan.preflight": "titan.start.preflight",
        "titan.old_runs": "titan.start.old_runs",
        "titan.start_plan": "titan.start.decision",
        "titan.init": "titan.weights.init",
        "titan.init_coverage": "titan.weights.init_coverage",
        "titan.init_draw": "titan.weights.init_draw",
    }.items()
}
"""Old dotted module name -> the module's name now."""


class _MovedLoader(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.new)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the new module ran when it was imported); give the module
        back its own ``__spec__``, which the import system set to the old name's."""
        module.__spec__ = self.own_spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, _MovedLoader(new))
        module = sys.modules.get(new)
        if module is not None and hasattr(module, "__path__"):
            spec.submodule_search_locations = list(module.__path__)
        return spec


def install() -> None:
    """Put the finder first on ``sys.meta_path``, once per process."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
