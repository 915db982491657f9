"""Bench-only config registry: Zephon's jobs with the trainer fed one preallocated batch.

``torchrun ... -m torchtitan_zephon.train --module torchtitan_zephon.bench.train_synthetic
--config llama3_debug`` (or ``llama3_tiny``) is the job of the same name in
``torchtitan_zephon.configs`` with ``dataloader=SyntheticDataLoader.Config()``: a
``ZephonDataLoader`` (same trainer hand-off, plan, state and tracker) whose
``__iter__`` yields the same in-memory micro-batch, document positions included,
forever. It is the upper bound ``zephon bench step`` compares the Zephon loader
against: the same model, optimizer, attention masks and TorchTitan 0.3 trainer
(``ZephonTrainer``) with the data path reduced to handing over tensors that
already exist.

Invariant: each config function here returns ``configs.<same name>()`` with only
the dataloader replaced; every public lowercase callable of this module is such a
config function (TorchTitan's ``--config`` looks them up by name).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan_zephon.configs import config_registry as _configs
from torchtitan_zephon.titan.components.attention import document_positions
from torchtitan_zephon.titan.components.dataloader import ZephonDataLoader
from torchtitan_zephon.titan.components.trainer import ZephonTrainer


class SyntheticDataLoader(ZephonDataLoader):
    """A ZephonDataLoader whose batches are one fixed micro-batch (step 1's first)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ZephonDataLoader.Config):
        dataset: str = "synthetic"
        """Informational: one preallocated micro-batch of the job's data, repeated."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        inputs, labels = self.loader.step_microbatches(1)[0]
        positions = document_positions(inputs["input"], self.eos_id)
        self._batch = ({**inputs, "positions": positions}, labels)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        batch = self._batch
        while True:
            yield batch


def _synthetic(config: ZephonTrainer.Config) -> ZephonTrainer.Config:
    old = config.dataloader
    config.dataloader = SyntheticDataLoader.Config(
        num_workers=old.num_workers, pin_memory=old.pin_memory
    )
    return config


def llama3_debug() -> ZephonTrainer.Config:
    """``configs.llama3_debug`` fed one preallocated batch."""
    return _synthetic(_configs.llama3_debug())


def llama3_tiny() -> ZephonTrainer.Config:
    """``configs.llama3_tiny`` fed one preallocated batch."""
    return _synthetic(_configs.llama3_tiny())
