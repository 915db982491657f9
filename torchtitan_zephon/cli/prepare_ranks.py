"""The ranks of a prepare launched by torchrun (or any launcher setting RANK / WORLD_SIZE).

Role: ``ranks_from_env`` gives ``ingest.prepare.prepare_store`` its group of
processes: ``OneProcess`` without a launcher (or with a world of one), else a
torch.distributed gloo group (``GlooRanks``) over the launcher's rendezvous
(MASTER_ADDR / MASTER_PORT, set by torchrun). gloo runs on CPUs only: a prepare
needs no accelerator.

Invariant: the group's collectives wait up to ``TIMEOUT`` (hours: ranks reach a
barrier when they finish their share of the corpus, which can take very different
times); a rank that fails makes every rank fail with its message (``prepare_store``
exchanges errors at each collective), and a rank that dies is reported by the
launcher, which stops the others.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

from torchtitan_zephon.ingest.ranks import OneProcess, Ranks

TIMEOUT = datetime.timedelta(hours=24)


class GlooRanks:
    """This process's place in a torch.distributed gloo group (created on construction)."""

    def __init__(self, timeout: datetime.timedelta = TIMEOUT) -> None:
        import torch.distributed as dist

        self._dist = dist
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timeout)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def barrier(self) -> None:
        self._dist.barrier()

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()


def ranks_from_env() -> Ranks:
    """The group described by RANK / WORLD_SIZE, or this process alone."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        rank = int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        raise ValueError(
            f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} "
            "are not whole numbers; a launcher sets them (torchrun does), or unset both to "
            "prepare in this process alone."
        ) from None
    if world <= 1 or "RANK" not in os.environ:
        return OneProcess()
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside [0, WORLD_SIZE={world}).")
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise ValueError(
            f"RANK / WORLD_SIZE are set (rank {rank} of {world}) but {' and '.join(missing)} "
            "not: the ranks meet at MASTER_ADDR:MASTER_PORT. Launch with torchrun (it sets "
            "all four), set them, or unset RANK / WORLD_SIZE to prepare in this process alone."
        )
    return GlooRanks()
