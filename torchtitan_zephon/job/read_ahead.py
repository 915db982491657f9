"""The loader's read-ahead: which steps' byte ranges a store in object storage fetches
before a window asks for them (``_ReadAhead``, a part of ``loader.ZephonLoader``).

Read-ahead (stores in object storage): the loader announces to its data, step by step,
the rank's keys of every step of a window it starts and of the ``read_ahead_steps``
after the window's last step (``JobData.read_ahead``; default: the data's, 0 for local
stores), so their byte ranges are fetched in the background (``store.remote``) before a
window asks for them; a window whose bytes have not arrived waits for them, and that
wait is the trainer's data wait. The effective lead is therefore the steps of the
windows in production (``max(1, num_workers)`` windows of up to ``window`` micro-
batches, and the one being delivered) plus ``read_ahead_steps`` (``lead_steps``). A
reset or a resume drops what was announced and announces again from the first
undelivered step. The first window after a start, a reset or a resume announces its own
steps only, and the next window (started once the first was taken, with ``num_workers``
<= 1) the read-ahead beyond: so the first step after a resume waits only for its own
windows, and the read-ahead of later steps runs behind it. Announcing costs one plan
call per step in the caller's thread; the fetching and checking run on the store's fetch
thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class _ReadAhead:
    """The read-ahead part of ``loader.ZephonLoader`` (module docstring): what the loader
    sets up in its ``__init__`` (``read_ahead_steps``, ``last_step``, ``window``,
    ``_announced``, ...) is read here."""

    _announced: int
    read_ahead_steps: int
    last_step: int | None
    window: int
    num_workers: int
    seq_len: int
    dp_rank: int
    dp_degree: int
    plan: Any
    data: Any
    grad_accumulation_steps: Callable[[int], int]

    @property
    def announced_through(self) -> int:
        """Last step whose keys were announced to the data (the step before the first
        undelivered one when none was since the start, a reset or a resume)."""
        return self._announced - 1

    def lead_steps(self, step: int) -> int:
        """At most how many steps after ``step`` (the step being delivered) have their
        windows announced, with ``step``'s micro-batches per step: the steps of the
        window being delivered and of the windows in production, then
        ``read_ahead_steps`` more (never past ``last_step``)."""
        microbatches = self.window * (max(1, self.num_workers) + 1)
        per_step = self.grad_accumulation_steps(step)
        lead = -(-microbatches // per_step) + self.read_ahead_steps
        if self.last_step is not None:
            lead = max(0, min(lead, self.last_step - step))
        return lead

    def _read_ahead(self, first: int, last: int, ahead: int) -> None:
        """Announce the rank's keys of steps ``first`` .. ``last + ahead`` (at most
        ``last_step``) not yet announced, in step order."""
        end = last + ahead + 1
        if self.last_step is not None:
            end = min(end, self.last_step + 1)
        for s in range(max(self._announced, first), end):
            keys = self.plan.rank_ids(s, self.dp_rank, self.dp_degree)
            self.data.read_ahead(keys, self.seq_len)
        self._announced = max(self._announced, end)
