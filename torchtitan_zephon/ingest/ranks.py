"""The processes that share one prepare, and the two collectives it needs.

Role: ``Ranks`` is what ``prepare_store`` asks of a group of processes: its
``rank`` and ``world_size``, a ``barrier`` and ``all_gather_object``. ``OneProcess``
is the group of one; a torch.distributed (gloo) group lives outside ``ingest/``
(``torchtitan_zephon/cli/prepare_ranks.py``), so the engine stays free of it.

Invariant: ``all_gather_object`` returns every rank's object in rank order, the
same list on every rank; with ``OneProcess`` that is ``[obj]``.
"""

from __future__ import annotations

from typing import Any, Protocol


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
