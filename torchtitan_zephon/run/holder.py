"""The lock file of a run folder and what it says.

Role: ``<dump_folder>/zephon/owner.lock`` (``lock_path``) holds one ``Holder`` as
JSON: the process of the holding job's global rank 0, the torchrun agents of all
its ranks, its torchrun run id, its lease period and a heartbeat counter that a
thread of the holder increments every ``lease / 6`` seconds (``lock``).
``lease_seconds`` reads the lease period (``ZEPHON_LOCK_LEASE_S``).

Invariant: ``Holder.from_json(h.to_json()) == h``; a missing or unreadable lock
file reads as no holder (``read_holder``), never as an error.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from torchtitan_zephon.run.process import Process

LOCK_NAME = "owner.lock"
LEASE_ENV = "ZEPHON_LOCK_LEASE_S"
DEFAULT_LEASE_S = 30.0


def lock_path(dump_folder: str | os.PathLike) -> Path:
    return Path(dump_folder) / "zephon" / LOCK_NAME


def lease_seconds() -> float:
    """The lease period: ``ZEPHON_LOCK_LEASE_S`` (seconds, > 0), default 30."""
    raw = os.environ.get(LEASE_ENV, "")
    if not raw:
        return DEFAULT_LEASE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{LEASE_ENV}={raw!r}: expected a number of seconds > 0 (default 30)")
    return value


# ---------------------------------------------------------------- the lock file


@dataclass
class Holder:
    """The contents of a lock file."""

    token: str
    process: Process
    agents: list[Process] = field(default_factory=list)
    run_id: str | None = None
    restart_count: int = 0
    lease_s: float = DEFAULT_LEASE_S
    beat: int = 0
    acquired: str = ""
    """When it was acquired (the holder's clock, for people only)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Holder:
        d = json.loads(text)
        return cls(
            token=str(d["token"]),
            process=Process(**d["process"]),
            agents=[Process(**a) for a in d.get("agents", [])],
            run_id=d.get("run_id"),
            restart_count=int(d.get("restart_count", 0)),
            lease_s=float(d.get("lease_s", DEFAULT_LEASE_S)),
            beat=int(d.get("beat", 0)),
            acquired=str(d.get("acquired", "")),
        )

    def describe(self) -> str:
        job = f", torchrun run id {self.run_id}" if self.run_id else ""
        since = f", since {self.acquired}" if self.acquired else ""
        return f"{self.process.describe()}{job}{since}"


def read_holder(dump_folder: str | os.PathLike) -> Holder | None:
    """The holder named by a run folder's lock (None: no lock, or an unreadable one)."""
    try:
        return Holder.from_json(lock_path(dump_folder).read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError):
        return None
