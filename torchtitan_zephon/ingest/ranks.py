"""The processes that share one prepare, the two collectives it needs, and failing together.

Role: ``Ranks`` is what ``prepare_store`` asks of a group of processes: its
``rank`` and ``world_size``, a ``barrier`` and ``all_gather_object``. ``OneProcess``
is the group of one; a torch.distributed (gloo) group lives outside ``ingest/``
(``torchtitan_zephon/cli/prepare_ranks.py``), so the engine stays free of it.

``together`` runs one step of a prepare on every rank and gathers the results.

Invariants: ``all_gather_object`` returns every rank's object in rank order, the
same list on every rank; with ``OneProcess`` that is ``[obj]``. A step that fails
on any rank fails on every rank (``together``), with the error of the earliest
unit, so no rank is left waiting and the error is the one a single process gives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torchtitan_zephon.store.format import StoreError


class Ranks(Protocol):
    rank: int
    world_size: int

    def barrier(self) -> None: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...


class OneProcess:
    """A group of one process: a prepare without a launcher."""

    rank = 0
    world_size = 1

    def barrier(self) -> None:
        pass

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]


class PrepareFailed(StoreError):
    """A prepare failed (on this rank or another): the message says why and, when finished
    tokenized units were kept, where they are and how to continue."""


def together(ranks: Ranks, step: Callable[[], Any]) -> list[Any]:
    """Run ``step`` on every rank and gather the results; if any rank failed, raise its
    error on every rank (the failure of the earliest unit first, so the error is the one
    a single process would report), instead of leaving the others waiting."""
    try:
        mine: tuple[str, Any] = ("ok", step())
    except Exception as e:
        failure = e
        mine = ("failed", (getattr(e, "unit_index", -1), ranks.rank, f"{e}"))
    else:
        failure = None
    gathered = ranks.all_gather_object(mine)
    failed = sorted(v for k, v in gathered if k == "failed")
    if not failed:
        return [v for _, v in gathered]
    _, rank, message = failed[0]
    if ranks.world_size == 1:
        assert failure is not None
        raise failure
    if rank == ranks.rank and failure is not None:
        raise PrepareFailed(f"{message} (rank {rank} of {ranks.world_size})") from failure
    raise PrepareFailed(f"{message} (rank {rank} of {ranks.world_size})")
