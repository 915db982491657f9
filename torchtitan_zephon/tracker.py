"""Global Sequence Tracker: the append-only log that proves which data each step saw.

``<dump_folder>/zephon/sequence_log.jsonl`` holds one JSON object per line:

* a step record ``{"step", "first_position", "num_samples", "ids_digest",
  ["tokens_digest"], "chain"}`` per completed step, where ``chain`` is
  ``sha256(previous chain + canonical JSON of the record without "chain")``;
* an event ``{"event": "start" | "resume", "from_step": k, "world_size", "dp_degree",
  "nnodes", ...}`` whenever a job starts. Step records after ``k`` written before
  that event are superseded (never rewritten): the *effective history* is what
  remains after applying the events in order.

Invariant: the chain of the effective history at step ``s`` depends only on the
data config, the audit level and the sample ids (and token digests) of steps
``1..s``, never on the topology or the restarts that produced it. Two runs with
the same audit level saw the same data up to step ``s`` exactly when their
chains at ``s`` agree (``zephon verify`` compares the per-step digests, so runs
with different audit levels can be compared too).

No torch.distributed here: the trainer decides who writes (global rank 0).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

LOG_NAME = "sequence_log.jsonl"
TRACKER_FORMAT = 1


class TrackerError(ValueError):
    """The sequence log is missing, corrupt, or disagrees with a checkpoint."""


def log_path(dump_folder: str | os.PathLike) -> Path:
    return Path(dump_folder) / "zephon" / LOG_NAME


def genesis(data_config_fingerprint: str) -> str:
    """The chain value before step 1: a function of the data config only."""
    return hashlib.sha256(
        f"zephon-tracker-v{TRACKER_FORMAT}:{data_config_fingerprint}".encode()
    ).hexdigest()


def ids_digest(ids: np.ndarray, store_fingerprint: str) -> str:
    """Digest of a step's ordered global sample ids (int64 little endian) and the store."""
    h = hashlib.sha256(store_fingerprint.encode())
    h.update(np.ascontiguousarray(ids, dtype="<i8").tobytes())
    return h.hexdigest()


def sample_digests(windows: np.ndarray) -> bytes:
    """16-byte blake2b digest of each sample window (rows of int64 tokens), concatenated.

    Per-sample digests make the step's token digest independent of how the step
    was cut into ranks and micro-batches: concatenate them in global order.
    """
    rows = np.ascontiguousarray(windows, dtype="<i8")
    return b"".join(hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in rows)


def tokens_digest(per_sample: bytes) -> str:
    return hashlib.sha256(per_sample).hexdigest()


def _canonical(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def chain_next(previous: str, record: dict[str, Any]) -> str:
    body = {k: v for k, v in record.items() if k != "chain"}
    return hashlib.sha256(previous.encode() + _canonical(body)).hexdigest()


# ---------------------------------------------------------------- reading


@dataclass
class LogContents:
    """A sequence log resolved to its effective history."""

    path: Path
    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Effective step records by step."""
    events: list[dict[str, Any]] = field(default_factory=list)
    """Start and resume events in log order."""
    truncated_tail: bool = False
    """The last line was cut short (a crash mid-write); it was ignored."""

    def steps(self) -> list[int]:
        return sorted(self.records)


def _lines(path: Path) -> Iterator[tuple[int, str, bool]]:
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    last = len(lines) - 1
    for i, line in enumerate(lines):
        if line.strip():
            yield i + 1, line, i == last  # no newline after it: possibly cut short


def read_log(path: str | os.PathLike) -> LogContents:
    """Parse a sequence log and apply its events. Raises TrackerError on bad input.

    A truncated final line (no trailing newline, invalid JSON) is tolerated and
    reported; corruption anywhere else is an error naming the line.
    """
    path = Path(path)
    if path.is_dir():
        path = log_path(path) if not (path / LOG_NAME).exists() else path / LOG_NAME
    if not path.is_file():
        raise TrackerError(
            f"no sequence log at {path}: expected <dump_folder>/zephon/{LOG_NAME}, "
            "written by runs with zephon.audit = 'ids' or 'tokens'"
        )
    out = LogContents(path=path)
    entries = []
    for lineno, line, is_last in _lines(path):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            if is_last:
                out.truncated_tail = True
                break
            raise TrackerError(
                f"{path}:{lineno}: not valid JSON ({e.msg}); the log is corrupt"
            ) from None
        if not isinstance(entry, dict) or not (
            "event" in entry or ("step" in entry and "chain" in entry)
        ):
            raise TrackerError(f"{path}:{lineno}: neither a step record nor an event: {line[:120]}")
        entries.append(entry)
    out.records = effective_records(entries)
    out.events = [e for e in entries if "event" in e]
    return out


# ---------------------------------------------------------------- writing


class SequenceTracker:
    """Keeps the chain head and (on the writer) appends to the log.

    Every rank holds the same head, so the checkpointed record is identical on all
    ranks; only the writer (global rank 0) touches the file.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        store_fingerprint: str,
        data_config_fingerprint: str,
        writer: bool,
        enabled: bool = True,
    ) -> None:
        self.path = Path(path)
        self.store_fingerprint = store_fingerprint
        self.data_config_fingerprint = data_config_fingerprint
        self.writer = writer and enabled
        self.enabled = enabled
        self.step = 0
        self.chain = genesis(data_config_fingerprint)

    # -- state ------------------------------------------------------------
    def head(self) -> dict[str, Any]:
        return {"step": self.step, "chain": self.chain}

    def _append(self, entry: dict[str, Any]) -> None:
        if not self.writer:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _drop_partial_line(self.path)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")
        if "event" in entry:
            self.sync()

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
        self._append({"event": "start", "from_step": 0, **topology})

    def resume(
        self, head: dict[str, Any], topology: dict[str, Any], *, ignore_mismatch: bool = False
    ) -> None:
        """Continue from a checkpoint's chain head; the log must contain it.

        Raises TrackerError when the log is missing or its effective record at the
        checkpoint's step has another chain value (a log from another run, or a
        checkpoint restored into a foreign run folder), unless ``ignore_mismatch``.
        """
        step, chain = int(head["step"]), str(head["chain"])
        if self.writer and step > 0:
            problem = None
            try:
                contents = read_log(self.path)
                rec = contents.records.get(step)
                if rec is None:
                    problem = f"it has no record of step {step}"
                elif rec["chain"] != chain:
                    problem = (
                        f"its record of step {step} has chain {rec['chain'][:16]}..., "
                        f"the checkpoint has {chain[:16]}..."
                    )
            except TrackerError as e:
                problem = str(e)
            if problem is not None:
                msg = (
                    f"the sequence log {self.path} does not match the checkpoint of step {step}: "
                    f"{problem}. The log belongs to another run or was edited. Restore the run's "
                    "own log, or set --zephon.ignore_log_mismatch to continue and restart the "
                    "chain from the checkpoint."
                )
                if not ignore_mismatch:
                    raise TrackerError(msg)
        self.step, self.chain = step, chain
        self._append({"event": "resume", "from_step": step, "chain": chain, **topology})

    def restart(self, step: int, topology: dict[str, Any]) -> None:
        """Continue after step ``step`` from a checkpoint that holds no chain head for it
        (written with audit "off"): the chain restarts there, which the event says."""
        self.step = int(step)
        self.chain = hashlib.sha256(f"zephon-restart:{step}:{self.chain}".encode()).hexdigest()
        self._append(
            {
                "event": "resume",
                "from_step": self.step,
                "chain": self.chain,
                "chain_restart": True,
                **topology,
            }
        )

    def record(
        self,
        step: int,
        first_position: int,
        ids: np.ndarray,
        tokens: bytes | None = None,
    ) -> dict[str, Any]:
        """Append the record of a completed step and advance the chain."""
        if step != self.step + 1:
            raise TrackerError(
                f"tracker expected step {self.step + 1}, got {step}: steps must be recorded in order"
            )
        rec: dict[str, Any] = {
            "step": step,
            "first_position": int(first_position),
            "num_samples": len(ids),
            "ids_digest": ids_digest(ids, self.store_fingerprint),
        }
        if tokens is not None:
            rec["tokens_digest"] = tokens_digest(tokens)
        rec["chain"] = chain_next(self.chain, rec)
        self.step, self.chain = step, rec["chain"]
        if self.enabled:
            self._append(rec)
        return rec


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


def effective_records(entries: Iterable[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Apply events to a sequence of parsed log entries (used by tests and tools)."""
    records: dict[int, dict[str, Any]] = {}
    for e in entries:
        if "event" in e:
            k = int(e.get("from_step", 0))
            for s in [s for s in records if s > k]:
                del records[s]
        else:
            records[int(e["step"])] = e
    return records
