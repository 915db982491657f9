"""Writing the sequence log: the chain head every rank keeps, the lines rank 0 appends.

Invariants:
- Every rank advances the same chain, so the head a checkpoint saves is identical
  on all ranks; only the writer (global rank 0) touches the files.
- A line reaches the log before its index entry (``index.LogIndex``), and a
  record a checkpoint names is fsynced before the checkpoint is written.
- A skip entry (S, N) of the data config is logged once per time it takes effect: a
  ``skip`` event just before the record of step S (``SequenceTracker.record``), after
  a rollback as on a fresh run.
- Finding the checkpoint's record on resume costs O(1) in the log's length
  through the index; when the index cannot answer (missing, stale, a log of
  another layout) the whole log is read once and the index rebuilt. A resume
  checks the record it continues from; corruption elsewhere in the log is
  ``zephon verify``'s to find.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_zephon.order.data_config import DataConfig
from torchtitan_zephon.order.skips import SkipSteps
from torchtitan_zephon.tracker.index import LogIndex
from torchtitan_zephon.tracker.links import ANNOTATIONS
from torchtitan_zephon.tracker.reader import LogReader
from torchtitan_zephon.tracker.records import (
    TRACKER_FORMAT,
    TrackerError,
    genesis,
    ids_digest,
    record_line,
    tokens_digest,
)


class SequenceTracker:
    """Keeps the chain head and (on the writer) appends to the log."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        config: DataConfig,
        writer: bool,
        enabled: bool = True,
    ) -> None:
        self.path = Path(path)
        self.config = config  # the skip entries follow it (a resume may replace it)
        self.writer = writer and enabled
        self.enabled = enabled
        self.step = 0
        self.chain = genesis(config.fingerprint)
        self.index = LogIndex(self.path)
        self._checked_tail = False

    @property
    def config(self) -> DataConfig:
        return self._config

    @config.setter
    def config(self, config: DataConfig) -> None:
        self._config = config
        self._skip_at = dict(config.skip_steps.entries)  # S -> N: a skip event before S

    def _config_fields(self) -> dict[str, Any]:
        return {
            "tracker_format": TRACKER_FORMAT,
            "data_config": self.config.to_dict(),
            "data_config_fingerprint": self.config.fingerprint,
        }

    # -- state ------------------------------------------------------------
    def head(self) -> dict[str, Any]:
        return {"step": self.step, "chain": self.chain}

    def _append(
        self, line: bytes, *, step: int | None = None, from_step: int | None = None
    ) -> None:
        """Append one line; note it in the index (a record's ``step`` or an event's
        ``from_step``)."""
        if not self.writer:
            return
        if not self._checked_tail:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _drop_partial_line(self.path)
            self._checked_tail = True
        with open(self.path, "ab") as f:
            offset = f.tell()
            if (
                from_step is not None
            ):  # before the line: a crash leaves a stale entry, never a missing one
                self.index.note_event(offset, from_step)
            f.write(line + b"\n")
        if from_step is not None:
            self.sync()
        if step is not None:
            self.index.note_record(step, offset, len(line))

    def _event(self, entry: dict[str, Any]) -> None:
        self._append(json.dumps(entry, sort_keys=True).encode(), from_step=int(entry["from_step"]))

    def sync(self) -> None:
        """Force the log to stable storage (the writer only). Called whenever a checkpoint
        takes the chain head: the record it names must survive the loss of the node that
        wrote it. Per-step appends are only flushed to the OS, which survives a killed
        process; a truncated last line is tolerated and cut on the next append."""
        if not self.writer or not self.path.exists():
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def start(self, topology: dict[str, Any]) -> None:
        """A job starts from step 0: supersedes whatever an earlier job left."""
        self.step, self.chain = 0, genesis(self.config.fingerprint)
        self._event(
            {
                "event": "start",
                "from_step": 0,
                "chain": self.chain,
                **self._config_fields(),
                **topology,
            }
        )

    def cannot_continue(self, head: dict[str, Any], *, repair_index: bool = True) -> str | None:
        """Why the log cannot continue from the checkpoint's chain ``head`` (None: it can).

        The writer looks the record up through the index (O(1) in the log's length)
        and reads the whole log only when the index cannot confirm it, then rewrites
        the index unless ``repair_index`` is false (a check that must write nothing,
        e.g. the trainer's preflight); other ranks answer None.
        """
        step, chain = int(head["step"]), str(head["chain"])
        if not self.writer or step == 0:
            return None
        found = self.index.record(step)
        if found is not None:
            offset, line = found
            if (
                json.loads(line).get("chain") == chain
                and self.index.superseded_after(offset, step) is False
            ):
                return None
        return self._cannot_continue_by_reading(step, chain, repair_index)

    def _cannot_continue_by_reading(self, step: int, chain: str, repair: bool = True) -> str | None:
        """The full read: authoritative, and it rebuilds the index."""
        if not self.path.is_file():
            return f"no sequence log at {self.path}"
        try:
            reader = LogReader(self.path)
            rec = None
            for r in reader.records():
                if int(r["step"]) == step:
                    rec = r
        except TrackerError as e:
            return str(e)
        if repair:
            self._rebuild_index()
        return head_problem(step, chain, None if rec is None else rec["chain"])

    def _rebuild_index(self) -> None:
        """Write the index and events files anew from the log's bytes."""
        self.index.reset()
        offset = 0
        with open(self.path, "rb") as f:
            for raw in f:
                if raw.endswith(b"\n") and raw.strip():
                    try:
                        entry = json.loads(raw)
                    except ValueError:
                        entry = None
                    if isinstance(entry, dict) and "event" in entry:
                        self.index.note_event(offset, int(entry.get("from_step", 0)))
                    elif isinstance(entry, dict) and isinstance(entry.get("step"), int):
                        self.index.note_record(entry["step"], offset, len(raw) - 1)
                offset += len(raw)

    def resume(
        self,
        head: dict[str, Any],
        topology: dict[str, Any],
        *,
        ignore_mismatch: bool = False,
        details: dict[str, Any] | None = None,
    ) -> str | None:
        """Continue from a checkpoint's chain head; the log must contain it.

        Raises TrackerError when the log is missing or its effective record at the
        checkpoint's step has another chain value (a log from another run, or a
        checkpoint restored into a foreign run folder), unless ``ignore_mismatch``;
        then the problem is returned and recorded in the resume event.
        """
        step, chain = int(head["step"]), str(head["chain"])
        problem = self.cannot_continue(head)
        extra = dict(details or {})
        if problem is not None:
            msg = (
                f"the sequence log {self.path} does not match the checkpoint of step {step}: "
                f"{problem}. The log belongs to another run or was edited. Restore the run's "
                "own log, or set --zephon.ignore_log_mismatch to continue and restart the "
                "chain from the checkpoint."
            )
            if not ignore_mismatch:
                raise TrackerError(msg)
            extra["log_mismatch_ignored"] = problem
        self.step, self.chain = step, chain
        self._event(
            {
                "event": "resume",
                "from_step": step,
                "chain": chain,
                **self._config_fields(),
                **extra,
                **topology,
            }
        )
        return problem

    def restart(
        self, step: int, topology: dict[str, Any], details: dict[str, Any] | None = None
    ) -> None:
        """Continue after step ``step`` from a checkpoint that holds no chain head for it
        (written with audit "off"): the chain restarts there, which the event says.
        ``details`` (accepted changes, notes) go into the event as in ``resume``."""
        self.step = int(step)
        self.chain = hashlib.sha256(f"zephon-restart:{step}:{self.chain}".encode()).hexdigest()
        self._event(
            {
                "event": "resume",
                "from_step": self.step,
                "chain": self.chain,
                "chain_restart": True,
                **self._config_fields(),
                **(details or {}),
                **topology,
            }
        )

    def continue_from(
        self,
        head: dict[str, Any] | None,
        done: int,
        topology: dict[str, Any],
        *,
        ignore_mismatch: bool = False,
        details: dict[str, Any] | None = None,
    ) -> str | None:
        """Continue the log after step ``done``, the last step of the checkpoint a job
        resumes from, whose data state holds the chain ``head``: from that head
        (``resume``), or, when the checkpoint holds none for step ``done`` (written with
        audit "off"), with the chain restarted there (``restart``). Returns what the
        trainer warns of (None: nothing); TrackerError as ``resume`` says."""
        if head is not None and int(head["step"]) == done:
            problem = self.resume(head, topology, ignore_mismatch=ignore_mismatch, details=details)
            if problem is None:
                return None
            return (
                f"the sequence log does not match the checkpoint of step {done} "
                f"({problem}); continuing because zephon.ignore_log_mismatch is set. The "
                "resume event records it, and the chain is not linked at this step."
            )
        self.restart(done, topology, details)
        if not self.enabled:
            return None
        return (
            f"the checkpoint of step {done} holds no sequence-log chain head (it was written "
            "with zephon.audit = 'off'); the log's chain restarts here"
        )

    def missed_lines(self, records: list[dict[str, Any]], head: dict[str, Any]) -> list[bytes]:
        """The log lines of a peer's effective ``records`` after this tracker's step (torchft
        healing), checked to link to this log's chain and to end at the peer's ``head``;
        TrackerError, with nothing written, when they do not (another history)."""
        chain, lines = self.chain, []
        for rec in records:
            if int(rec["step"]) <= self.step:
                continue
            body = {k: v for k, v in rec.items() if k != "chain"}
            chain, line = record_line(chain, body)
            if chain != rec["chain"]:
                raise TrackerError(
                    f"the peers' record of step {rec['step']} does not continue the sequence "
                    f"log {self.path} (its chain at step {self.step} differs): the groups' run "
                    "folders hold two histories. Start this group in a new run folder."
                )
            lines.append(line)
        if chain != str(head["chain"]) or self.step + len(lines) != int(head["step"]):
            raise TrackerError(
                f"the peers' sequence log does not reach their chain head at step "
                f"{head['step']} from this log's step {self.step}"
            )
        return lines

    def healed(
        self,
        own_step: int,
        lines: list[bytes],
        head: dict[str, Any],
        topology: dict[str, Any],
    ) -> None:
        """Under torchft, this group healed from a peer at its step ``own_step``: a
        ``resume`` event there (``"healed": true``), then the peers' record ``lines``
        after it (already checked to link), and the peers' chain ``head``. A rank that
        does not write the log only takes the head; a disabled tracker (audit "off")
        takes nothing."""
        if not self.enabled:
            return
        self._event(
            {
                "event": "resume",
                "from_step": int(own_step),
                "chain": self.chain,
                "healed": True,
                **self._config_fields(),
                **topology,
            }
        )
        for line in lines:
            self._append(line, step=int(json.loads(line)["step"]))
        self.step, self.chain = int(head["step"]), str(head["chain"])
        self.sync()

    def record(
        self,
        step: int,
        first_position: int,
        ids: np.ndarray | None = None,
        tokens: bytes | None = None,
        *,
        digest: str | None = None,
        num_samples: int | None = None,
    ) -> dict[str, Any]:
        """Append the record of a completed step and advance the chain.

        Pass the step's global ``ids``, or their ``digest`` (``ids_digest`` under this
        tracker's config, computed off the training thread) and ``num_samples``.
        """
        if step != self.step + 1:
            raise TrackerError(
                f"tracker expected step {self.step + 1}, got {step}: steps must be recorded in order"
            )
        if digest is None:
            if ids is None:
                raise ValueError("record() needs the step's ids or their digest")
            key = self.config.step_key(step)
            digest, num_samples = ids_digest(ids, key, first_position), len(ids)
        rec: dict[str, Any] = {
            "v": TRACKER_FORMAT,
            "step": step,
            "first_position": int(first_position),
            "num_samples": int(num_samples),
            "ids_digest": digest,
        }
        if tokens is not None:
            rec["tokens_digest"] = tokens_digest(tokens)
        chain, line = record_line(self.chain, rec)
        rec["chain"] = chain
        if self.enabled and step in self._skip_at:
            self._skip(step, self._skip_at[step])
        self.step, self.chain = step, chain
        if self.enabled:
            self._append(line, step=step)
        return rec

    def _skip(self, step: int, count: int) -> None:
        """The skip entry (step, count) takes effect: its event goes just before the
        record of ``step`` (``annotate``)."""
        (text,) = SkipSteps([(step, count)]).describe(self.config.batch_schedule().gbs)
        self.annotate("skip", step, {"steps": count, "text": text})

    def annotate(self, kind: str, step: int, fields: dict[str, Any]) -> None:
        """An annotation (``links.ANNOTATIONS``) of the step after the last record,
        ``step``: an event naming the record it follows (``from_step`` = step - 1 and that
        record's chain), so it supersedes nothing and links like the records do. Under
        torchft: ``quorum`` (the groups that train the step) and ``retry`` (the step was
        not committed and is trained again: never a second record)."""
        if kind not in ANNOTATIONS:
            raise ValueError(f"annotation {kind!r}: expected one of {ANNOTATIONS}")
        if step != self.step + 1:
            raise ValueError(
                f"a {kind} event for step {step} after the record of step {self.step}: an "
                "annotation names the step after the last record"
            )
        if not self.enabled:
            return
        self._event(
            {"event": kind, "from_step": step - 1, "chain": self.chain, "step": step, **fields}
        )


def head_problem(step: int, chain: str, found: str | None) -> str | None:
    """Why a log whose effective record of ``step`` has chain ``found`` (None: no record)
    does not hold a checkpoint's chain head ``(step, chain)``; None when it does. The one
    wording of the resume check and of ``zephon verify``'s check of checkpoints."""
    if found is None:
        return f"it has no record of step {step}"
    if found != chain:
        return (
            f"its record of step {step} has chain {found[:16]}..., "
            f"the checkpoint has {chain[:16]}..."
        )
    return None


def _drop_partial_line(path: Path) -> None:
    """Cut a final line that a crash left without its newline, so appends stay valid JSONL."""
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            f.seek(max(0, size - (1 << 20)))
            tail = f.read()
            cut = tail.rfind(b"\n")
            f.truncate(size - len(tail) + cut + 1 if cut >= 0 else 0)
    except FileNotFoundError:
        return


class StepDigests:
    """The ids digests of upcoming steps, computed by a background thread.

    ``ahead(s)`` starts computing step ``s``'s (first position, number of samples,
    ids digest) from ``plan()`` (a ``DataPlan`` or another source's plan: O(global
    batch) work), bound to ``step_key(s)`` (``DataConfig.step_key``); ``take(s)``
    returns it, so the training thread only collects a result.
    """

    def __init__(self, plan: Callable[[], Any], step_key: Callable[[int], str]) -> None:
        self.plan = plan
        self.step_key = step_key
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zephon-ids-digest")
        self._pending: dict[int, Future] = {}

    def _compute(self, step: int) -> tuple[int, int, str]:
        plan = self.plan()
        first, count = plan.step_positions(step)
        ids = plan.ids_for_positions(first, count)
        return first, count, ids_digest(ids, self.step_key(step), first)

    def ahead(self, step: int) -> None:
        if step not in self._pending:
            self._pending[step] = self._pool.submit(self._compute, step)
            for old in [s for s in self._pending if s < step - 2]:
                del self._pending[old]

    def take(self, step: int) -> tuple[int, int, str]:
        self.ahead(step)
        return self._pending.pop(step).result()

    def reset(self) -> None:
        """Forget everything computed so far (the plan changed)."""
        for f in self._pending.values():
            f.cancel()
        self._pending.clear()

    def close(self) -> None:
        self.reset()
        self._pool.shutdown(wait=True, cancel_futures=True)
