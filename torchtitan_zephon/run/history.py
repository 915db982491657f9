"""A run's history of data configs (``zephon show``, ``where`` and ``spikes`` ask it): the
jobs of its effective history (the start and resume events of its sequence log from the
last start on, each with the data config it trained under and its position anchor), the
last trained step, and, for a trained step, the job that trained it and the ids digest
the log recorded for it.

Invariant: reading only. A trained step belongs to the job whose event precedes its
effective record (``LogReader.event_for``): it is described under that job's data
config, never under one a later resume accepted (``zephon.allow_changes``: another
seed, packing turned on, a batch schedule change), and what is recomputed for it can
be checked against the digest the log holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan_zephon.order.data_config import DataConfig, DataStateMismatch
from torchtitan_zephon.order.layout import Layout
from torchtitan_zephon.run import recorded as runs
from torchtitan_zephon.run.recorded import RunError
from torchtitan_zephon.tracker import read_log
from torchtitan_zephon.tracker.index import LogIndex


@dataclass(frozen=True)
class TrainedUnder:
    """One job of the run's history: its start or resume event, the data config it
    trained under and the position anchor of that config."""

    event: dict[str, Any]
    config: DataConfig
    anchor: tuple[int, int]

    @property
    def key(self) -> tuple[str, tuple[int, int]]:
        """Jobs with one key describe their steps the same way."""
        return self.config.fingerprint, self.anchor

    @property
    def dp_degree(self) -> int | None:
        """The DP degree the event records (None: not recorded)."""
        dp = self.event.get("dp_degree")
        return dp if type(dp) is int and dp >= 1 else None


class RunHistory:
    """The jobs of a run's effective history, newest last."""

    def __init__(self, run: Path) -> None:
        self.run = run
        self.reader = runs.log_reader(run)
        events = [e for e in self.reader.events if e.get("event") in ("start", "resume")]
        events = [e for e in events if isinstance(e.get("data_config"), dict)]
        if not events:
            raise RunError(
                f"the run {run} has no start or resume event with a data config in its "
                "sequence log (zephon/sequence_log.jsonl): it was not trained with Zephon's "
                "tracker (zephon.audit off?). Name the data instead: a store with --seq-len, "
                "--global-batch-size and --seed."
            )
        starts = [i for i, e in enumerate(events) if e.get("event") == "start"]
        history = events[starts[-1] :] if starts else events  # a start begins a new history
        self.jobs: list[TrainedUnder] = []
        for i, event in enumerate(history):
            try:
                config = DataConfig.from_dict(event["data_config"])
            except DataStateMismatch as e:
                raise RunError(
                    f"the run {run}'s sequence log holds a bad data config: {e}"
                ) from None
            self.jobs.append(TrainedUnder(event, config, _anchor(history[: i + 1])))
        self.trained_last = _last_trained(self.reader.path)
        self._records: dict[int, dict[str, Any]] | None = None
        self._quorums: dict[int, dict[str, Any] | None] = {}

    @property
    def newest(self) -> TrainedUnder:
        return self.jobs[-1]

    def job_of(self, step: int) -> TrainedUnder:
        """The job that trained ``step`` (a step not trained yet: the newest)."""
        if step > self.trained_last:
            return self.newest
        event = self.reader.event_for(step)
        for job in self.jobs:
            if job.event is event:
                return job
        return self.jobs[0]  # an event before the history's start: not effective

    def quorum_at(self, step: int) -> dict[str, Any] | None:
        """The torchft quorum that trained ``step``, as this replica group's log records
        it (its ``quorum`` event: ``groups``, this group's ``part``, the ``members``'
        replica ids in part order), or None: not trained under torchft, or trained by
        the peers while this group was away (records it received when it healed)."""
        if step in self._quorums:  # asked once per sample of a step: walked once
            return self._quorums[step]
        current = None
        for e in self.reader.events:
            kind = e.get("event")
            if kind in ("start", "resume") and _int(e.get("from_step")) < step:
                current = None  # this step was trained (again) after it
            elif kind == "quorum" and _int(e.get("step")) <= step:
                current = e
        self._quorums[step] = current if step <= self.trained_last else None
        return self._quorums[step]

    def logged_ids_digest(self, step: int) -> str | None:
        """The ids digest of ``step``'s effective record (None: the log has none). The
        sidecar index finds it in O(1); a log without one is read once."""
        found = LogIndex(self.reader.path).record(step)
        if found is not None:
            return json.loads(found[1]).get("ids_digest")
        if self._records is None:
            self._records = read_log(self.reader.path).records
        return self._records.get(step, {}).get("ids_digest")


def _last_trained(path: Path) -> int:
    """The last step of the log's effective history, from its last whole line: a record
    (its step) or an event (its from_step: the steps after it are superseded). Records
    are appended in step order after the event they follow, so the tail decides; O(1)
    in the log's length (the chain is ``zephon verify``'s to check)."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        block = 1 << 16
        while True:
            f.seek(max(0, size - block))
            lines = f.read(block).split(b"\n")
            if size > block:
                lines = lines[1:]  # the first may be cut
            for raw in reversed(lines):
                try:
                    entry = json.loads(raw)
                except (ValueError, RecursionError):
                    continue  # blank, or a last line cut short by a crash
                if isinstance(entry, dict):
                    key = "from_step" if "event" in entry else "step"
                    if type(entry.get(key)) is int:
                        return int(entry[key])
            if block >= size:
                return 0
            block *= 4


def _anchor(history: list[dict[str, Any]]) -> tuple[int, int]:
    """The position anchor of the last job's data config, from the run's history (its
    start and resume events from the last start on). Only a resume that accepted a batch
    schedule change moves it (``accepted_changes`` names "schedule", ``order.resume``):
    to (k + 1, the first position of step k + 1 under the job that trained step k), k
    its from_step; any other resume keeps that job's anchor."""
    anchors: list[tuple[int, int]] = []
    for i, e in enumerate(history):
        k = e.get("from_step")
        if i == 0 or e.get("event") == "start" or not isinstance(k, int) or k < 1:
            anchors.append((1, 0))
            continue
        j = max((j for j in range(i) if _int(history[j].get("from_step")) < k), default=0)
        anchor = anchors[j]  # the job that trained step k
        accepted = e.get("accepted_changes")
        if isinstance(accepted, list) and "schedule" in accepted:
            schedule = DataConfig.from_dict(history[j]["data_config"]).batch_schedule()
            anchor = (k + 1, Layout(schedule, anchor).step_positions(k + 1)[0])
        anchors.append(anchor)
    return anchors[-1]


def _int(value: Any) -> int:
    return value if isinstance(value, int) else 0
