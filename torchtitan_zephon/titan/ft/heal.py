"""Healing under torchft: a group that joins a running job takes its peers' state, the
data state and the log records it missed included.

Role: ``Healing`` is registered with torchft's Manager (``register_state_dict_fn``) on
every rank of every group. On a group a quorum heals from, ``save`` gives what the
joining group needs: the model, the optimizers, the LR schedules, the trainer's step,
Zephon's data state with its chain head, and (global rank 0, which writes the log) the
effective records of its sequence log. On the joining group, torchft calls ``load``
while the step's synchronous quorum completes (before any data is drawn); ``apply``
then loads every part, moves the loader to the peers' next step, and appends to this
group's log a ``resume`` event (``"healed": true``) at its own last step followed by the
peers' records after it, so both logs hold one history. The step then trains as any
other (``step.train_step_ft``).

Invariant: after ``apply`` this group is the peers' replica: the same weights,
optimizer and LR state, the same next step and data state, the same chain head; every
record it appends is a peer's record, whose chain links to this log's last one
(``SequenceTracker.missed_lines``: a record that does not link is refused, before
anything is loaded or written, as a log from another run).
"""

from __future__ import annotations

from typing import Any

from torchtitan.components.checkpointer.base import ModelWrapper

from torchtitan_zephon.order.state import DataState
from torchtitan_zephon.tracker import read_log

HEAL_KEY = "zephon"
"""The key of Zephon's state in what torchft sends a healing group."""


class HealingRefused(RuntimeError):
    """torchft healed this group but sent no Zephon state."""


class Healing:
    """What one rank sends to, and takes from, a peer under torchft (module docstring)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.model = ModelWrapper(trainer.model_parts)
        self.received: dict[str, Any] | None = None

    def save(self) -> dict[str, Any]:
        t = self.trainer
        dl = t.dataloader
        log: list[dict[str, Any]] = []
        if dl.tracker.writer and dl.tracker.path.exists():
            records = read_log(dl.tracker.path).records
            log = [records[s] for s in sorted(records) if s <= dl.tracker.step]
        return {
            "model": self.model.state_dict(),
            "optimizer": t.optimizers.state_dict(),
            "lr_scheduler": t.lr_schedulers.state_dict(),
            "train_state": t.state_dict(),
            "data": dl.loader.data_state().to_dict(),
            "head": dl.tracker.head(),
            "log": log,
        }

    def load(self, state: dict[str, Any]) -> None:
        """Called by torchft while the quorum heals this group: kept for ``apply``."""
        self.received = state

    def apply(self) -> int:
        """Make this rank the peers' replica (module docstring); returns the step it
        trains next."""
        state, self.received = self.received, None
        if state is None:
            raise HealingRefused("torchft healed this group but sent no Zephon state")
        t = self.trainer
        dl = t.dataloader
        tracker = dl.tracker
        own_step, head = tracker.step, state["head"]
        lines = tracker.missed_lines(state["log"], head) if tracker.writer else []
        self.model.load_state_dict(state["model"])
        t.optimizers.load_state_dict(state["optimizer"])
        t.lr_schedulers.load_state_dict(state["lr_scheduler"])
        t.load_state_dict(state["train_state"])
        dl.resume(DataState.from_dict(state["data"]), healed=(own_step, lines, head))
        return int(dl.loader.next_step)
