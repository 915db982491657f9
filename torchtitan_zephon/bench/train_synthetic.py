"""Bench-only training entry: TorchTitan's trainer fed one preallocated batch.

``python -m torchtitan_zephon.bench.train_synthetic [TorchTitan args]`` is
``python -m torchtitan_zephon.train`` plus a train spec,
``model.name = "zephon_bench_synthetic"``, whose dataloader yields the same
in-memory micro-batch forever. It is the upper bound ``zephon bench step``
compares the Zephon loader against: the same model, optimizer and trainer with
the data path reduced to handing over a tensor that already exists.

Invariant: the synthetic spec differs from ``zephon_llama3`` only in the
dataloader's ``__iter__``; it is registered only by this entry module.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Iterator
from typing import Any

import torch

from torchtitan_zephon.titan.config import CONFIG_MODULE
from torchtitan_zephon.titan.dataloader import ZephonDataLoader, build_zephon_dataloader

NAME = "zephon_bench_synthetic"


class SyntheticDataLoader(ZephonDataLoader):
    """A ZephonDataLoader (same state, tracker, plan) whose batches are one fixed tensor."""

    def __init__(self, inner: ZephonDataLoader) -> None:
        self.__dict__.update(inner.__dict__)
        self._batch = inner.loader.step_microbatches(1)[0]

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        batch = self._batch
        while True:
            yield batch


@functools.wraps(build_zephon_dataloader)
def build_synthetic_dataloader(*args: Any, **kwargs: Any) -> SyntheticDataLoader:
    return SyntheticDataLoader(build_zephon_dataloader(*args, **kwargs))


def register() -> None:
    """Register ``zephon_bench_synthetic`` once (idempotent)."""
    from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

    from torchtitan_zephon.titan.spec import zephon_train_spec

    try:
        get_train_spec(NAME)
    except ValueError:
        spec = dataclasses.replace(
            zephon_train_spec(), build_dataloader_fn=build_synthetic_dataloader
        )
        register_train_spec(NAME, spec)


def main() -> None:
    # TorchTitan binds sys.argv when it is first imported: settle the argv first.
    if not any(
        a.startswith(("--job.custom_config_module", "--job.custom-config-module")) for a in sys.argv
    ):
        sys.argv += ["--job.custom_config_module", CONFIG_MODULE]
    from torchtitan_zephon import train
    from torchtitan_zephon.titan import platform

    platform.apply()
    register()
    train.main()


if __name__ == "__main__":
    main()
