"""The data state: the record a checkpoint holds about the data, to and from JSON.

Role: ``DataState`` is the world-size-free record of a checkpoint: the data config
(``order.data_config``), the next step, the consumed positions, the position
anchor and the tracker's chain head; DCP stores its JSON under ``dataloader.zephon``
(``RECORD_KEY``). The loader, the TorchTitan adapter, run-folder readers,
``inspect`` and ``bench`` ask this module instead of knowing the JSON; whether a
state may continue under another config is ``order.resume``'s to say.

Invariants: ``DataState.from_dict(s.to_dict()) == s``, the record is identical on
every rank, and records of format 1 (written before this module existed) load
with the defaults they implied; a record that does not parse raises
``DataStateMismatch`` naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torchtitan_zephon.order.data_config import (
    DataConfig,
    DataStateMismatch,
    config_text,
    saved_int,
)
from torchtitan_zephon.store.format import fingerprint

STATE_FORMAT = 2
"""2: the config carries ``order_format``. 1: the first release (still read)."""

RECORD_KEY = "zephon"
"""The key of the JSON record in the dataloader's state dict; DCP stores it under
``dataloader.zephon`` (TorchTitan's ``dataloader`` checkpoint entry)."""


@dataclass(frozen=True)
class DataState:
    """The data side of a checkpoint: one record, identical on every rank."""

    config: DataConfig
    next_step: int
    """First step not yet completely delivered."""
    consumed_positions: int
    """Positions of the global stream used by steps < next_step."""
    position_anchor: tuple[int, int] = (1, 0)
    """(step, position): the current schedule counts positions from here (a resume
    that accepted a schedule change moves it)."""
    tracker: Mapping[str, Any] | None = field(default=None, compare=True)
    """The sequence tracker's chain head ``{"step", "chain"}`` (None: audit off)."""

    def __post_init__(self) -> None:
        if self.next_step < 1 or self.consumed_positions < 0:
            raise DataStateMismatch(
                f"data state has next_step={self.next_step}, consumed_positions="
                f"{self.consumed_positions}; expected next_step >= 1 and consumed_positions "
                ">= 0. The checkpoint's data state is corrupt."
            )

    def with_tracker(self, head: Mapping[str, Any] | None) -> DataState:
        return DataState(
            self.config, self.next_step, self.consumed_positions, self.position_anchor, head
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": STATE_FORMAT,
            "store_fingerprint": self.config.store_fingerprint,
            "data_config": self.config.to_dict(),
            "data_config_fingerprint": self.config.fingerprint,
            "next_step": self.next_step,
            "consumed_positions": self.consumed_positions,
            "position_anchor": list(self.position_anchor),
        }
        if self.tracker is not None:
            out["tracker"] = dict(self.tracker)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Any) -> DataState:
        """Parse a saved record (format 1 or 2); DataStateMismatch names what is wrong."""
        if not isinstance(d, Mapping):
            raise DataStateMismatch(
                f"the data state is {config_text(d)}, not a JSON object; the checkpoint's data "
                "state is corrupt or was written by another tool."
            )
        found = d.get("format")
        if isinstance(found, bool) or found not in (1, STATE_FORMAT):
            raise DataStateMismatch(
                f"unsupported data state format {config_text(found)}; expected {STATE_FORMAT} "
                "(or 1). The checkpoint was written by an incompatible version of zephon."
            )
        raw = d.get("data_config")
        if not isinstance(raw, Mapping):
            raise DataStateMismatch("data state has no data_config; the checkpoint is corrupt.")
        config = DataConfig.from_dict(raw)
        if found == STATE_FORMAT and d.get("data_config_fingerprint") != fingerprint(dict(raw)):
            raise DataStateMismatch(
                "data state is corrupt: its data_config does not hash to its recorded "
                "data_config_fingerprint (edited after it was saved?)."
            )
        if d.get("store_fingerprint", config.store_fingerprint) != config.store_fingerprint:
            raise DataStateMismatch(
                "data state is corrupt: its store_fingerprint disagrees with its data_config."
            )
        what = "the data state"
        tracker = d.get("tracker")
        anchor = d.get("position_anchor", [1, 0])
        if not isinstance(anchor, list) or len(anchor) != 2:
            raise DataStateMismatch(
                f"{what} has an invalid field 'position_anchor': {config_text(anchor)}, "
                "expected [step, position]; the checkpoint is corrupt."
            )
        if tracker is not None and not (isinstance(tracker, Mapping) and "chain" in tracker):
            raise DataStateMismatch(
                f"{what} has an invalid field 'tracker': {config_text(tracker)}, expected "
                '{ step = N, chain = "..." }; the checkpoint is corrupt.'
            )
        anchors = {"step": anchor[0], "position": anchor[1]}
        at = "the data state's position_anchor"
        head = None
        if tracker is not None:
            step = saved_int(tracker, "step", "the data state's tracker")
            head = {"step": step, "chain": str(tracker["chain"])}
        return cls(
            config,
            saved_int(d, "next_step", what),
            saved_int(d, "consumed_positions", what),
            (saved_int(anchors, "step", at), saved_int(anchors, "position", at)),
            head,
        )

    @classmethod
    def from_json(cls, text: str) -> DataState:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise DataStateMismatch(f"data state is not valid JSON ({e}); it is corrupt.") from None
