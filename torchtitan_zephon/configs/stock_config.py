"""A stock TorchTitan config run on Zephon's trainer (``--module llama3 --config
llama3_debugmodel`` through ``torchtitan_zephon.train``).

Role: ``zephon_config`` turns the ``Trainer.Config`` a TorchTitan registry function
returns into ``ZephonTrainer.Config``, saying what changed (the entry point logs it).

Invariant: every value of the stock config is kept except the dataloader and the
validator, which become Zephon's (the stock ones' workers / pinning and enable / freq /
steps kept), and an unset ``debug.seed``, which becomes Zephon's 0; a config of
another type is refused, naming what to return.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan.trainer import Trainer

from torchtitan_zephon.titan.components.dataloader import ZephonDataLoader
from torchtitan_zephon.titan.components.trainer import ZephonTrainer
from torchtitan_zephon.titan.components.validate import ZephonValidator
from torchtitan_zephon.titan.settings.zephon_section import Zephon


def zephon_config(config: Any) -> tuple[ZephonTrainer.Config, list[str]]:
    """``config`` as Zephon's trainer config, and what changed (for the log).

    A config function of Zephon's registry already returns one. A stock TorchTitan
    ``Trainer.Config`` (``--module llama3 --config llama3_debugmodel``) keeps every
    value, with Zephon's dataloader (its num_workers / pin_memory kept) and validator
    (enable / freq / steps kept) in place of its own, the ``zephon`` section's
    defaults and, where it leaves ``debug.seed`` unset, Zephon's seed 0.
    """
    if isinstance(config, ZephonTrainer.Config):
        return config, []
    if type(config) is not Trainer.Config:
        raise ValueError(
            f"the config function returned a {type(config).__qualname__}, which Zephon cannot "
            "extend (it adds its section to TorchTitan's Trainer.Config): return a "
            "Trainer.Config, or a ZephonTrainer.Config from torchtitan_zephon.titan.components.trainer"
        )
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    notes = []
    old = values["dataloader"]
    values["dataloader"] = ZephonDataLoader.Config(
        num_workers=getattr(old, "num_workers", 0), pin_memory=getattr(old, "pin_memory", False)
    )
    what = f" (dataset {old.dataset!r})" if getattr(old, "dataset", "") else ""
    notes.append(
        f"dataloader {type(old).__qualname__}{what} replaced by Zephon's ZephonDataLoader: the "
        "data is --zephon.store (empty: the builtin store) or --zephon.mixture"
    )
    old = values["validator"]
    values["validator"] = ZephonValidator.Config(
        enable=getattr(old, "enable", False), freq=old.freq, steps=getattr(old, "steps", -1)
    )
    notes.append(
        f"validator {type(old).__qualname__} replaced by Zephon's ZephonValidator: held-out "
        "samples of the store (--zephon.heldout_samples)"
    )
    if values["debug"].seed is None:
        values["debug"] = dataclasses.replace(values["debug"], seed=0)
        notes.append("debug.seed None -> 0 (Zephon's default: reproducible runs)")
    return ZephonTrainer.Config(**values, zephon=Zephon()), notes
