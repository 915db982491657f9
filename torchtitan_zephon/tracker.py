"""Global Sequence Tracker: the append-only log that proves which data each step saw.

``<dump_folder>/zephon/sequence_log.jsonl`` holds one JSON object per line:

* a step record ``{"v": 2, "step", "first_position", "num_samples", "ids_digest",
  ["tokens_digest"], "chain"}`` per completed step. ``ids_digest`` hashes the
  step's ordered sample ids *bound to what governed the step*: the data config's
  order key (store content, tokenizer, seq_len, held-out split, seed, order
  format; see ``data.state.DataConfig.order_key``) and the step's first
  position (its size is the number of ids). ``chain`` is ``sha256(previous chain
  + canonical JSON of the record without "chain")``;
* an event ``{"event": "start" | "resume", "from_step": k, "chain", "data_config",
  "data_config_fingerprint", "world_size", "dp_degree", "nnodes", ...}`` whenever a
  job starts; a start's chain is ``genesis(data_config_fingerprint)``, a resume's
  is the checkpoint's chain head. Step records after ``k`` written before that
  event are superseded (never rewritten): the *effective history* is what
  remains after applying the events in order.

Invariants:
- The chain of the effective history at step ``s`` depends only on the data
  config, the audit level and the sample ids (and token digests) of steps
  ``1..s``, never on the topology or the restarts that produced it.
- Two bound records (``"v": 2``) of a step have equal ``ids_digest`` exactly when
  the step read the same samples of the same content under the same order key at
  the same positions; ``zephon verify`` compares these per-step digests, so runs
  with different audit levels or a schedule extended later still compare.
- ``read_log`` recomputes every record's chain from the one before it (the event
  that opened its job gives the first) and reports the first record whose chain,
  step order or resume link is wrong: a deleted, inserted, reordered or edited
  record never goes unnoticed. The chain is an unkeyed hash: it catches
  accidents, bugs, careless edits and foreign logs, not a forger who recomputes
  every later chain value.

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

from torchtitan_zephon.data.digest import canonical_json, fingerprint
from torchtitan_zephon.data.state import DataConfig

LOG_NAME = "sequence_log.jsonl"
TRACKER_FORMAT = 2
"""2: step records are bound to the data config (``"v": 2``), events carry the data
config and the chain. 1: unbound records (read; verify calls them unbound)."""


class TrackerError(ValueError):
    """The sequence log is missing, corrupt, or disagrees with a checkpoint."""


def log_path(dump_folder: str | os.PathLike) -> Path:
    return Path(dump_folder) / "zephon" / LOG_NAME


def genesis(data_config_fingerprint: str) -> str:
    """The chain value before step 1: a function of the data config only."""
    return hashlib.sha256(
        f"zephon-tracker-v{TRACKER_FORMAT}:{data_config_fingerprint}".encode()
    ).hexdigest()


def ids_digest(ids: np.ndarray, order_key: str, first_position: int) -> str:
    """Digest of a step's ordered global sample ids (int64 little endian), bound to the
    data config's order key and the step's first position."""
    h = hashlib.sha256(f"zephon-ids-v2:{order_key}:{int(first_position)}:".encode())
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


def chain_next(previous: str, record: dict[str, Any]) -> str:
    body = {k: v for k, v in record.items() if k != "chain"}
    return hashlib.sha256(previous.encode() + canonical_json(body)).hexdigest()


# ---------------------------------------------------------------- reading


@dataclass
class LogProblem:
    """The first place where a log stops being its own proof."""

    line: int
    step: int | None
    kind: str
    """``chain`` (a record's chain does not follow), ``order`` (a gap, a repeated or
    reordered step), ``event`` (a start or resume event that does not link up),
    ``orphan`` (a step record before any start event)."""
    message: str


@dataclass
class LogContents:
    """A sequence log resolved to its effective history, with its integrity checked."""

    path: Path
    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Effective step records by step."""
    events: list[dict[str, Any]] = field(default_factory=list)
    """Start and resume events in log order."""
    truncated_tail: bool = False
    """The last line was cut short (a crash mid-write); it was ignored."""
    problems: list[LogProblem] = field(default_factory=list)
    """Integrity problems in log order (empty: every chain, step order and link checks)."""
    notes: list[str] = field(default_factory=list)
    """Things that are not errors but limit what the log proves (e.g. a resume that
    ignored a log mismatch, start events of tracker format 1)."""

    def steps(self) -> list[int]:
        return sorted(self.records)

    def unbound_steps(self) -> list[int]:
        """Effective steps whose records do not bind the data config (tracker format 1)."""
        return [s for s, r in sorted(self.records.items()) if r.get("v", 1) < 2]

    def event_for(self, step: int) -> dict[str, Any] | None:
        """The start / resume event of the job that wrote the effective record of ``step``."""
        chosen = None
        for e in self.events:
            if int(e.get("from_step", 0)) < step:
                chosen = e
        return chosen


def _lines(path: Path) -> Iterator[tuple[int, str, bool]]:
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    last = len(lines) - 1
    for i, line in enumerate(lines):
        if line.strip():
            yield i + 1, line, i == last  # no newline after it: possibly cut short


class _ChainCheck:
    """Replays a log's entries in order, recomputing chains and step order."""

    def __init__(self, out: LogContents) -> None:
        self.out = out
        self.prev_chain: str | None = None  # chain the next record must follow from
        self.prev_step: int | None = None  # step the next record must follow
        self.history: dict[int, str] = {}  # effective chain by step so far

    def problem(self, line: int, step: int | None, kind: str, message: str) -> None:
        self.out.problems.append(LogProblem(line, step, kind, message))

    def event(self, lineno: int, e: dict[str, Any]) -> None:
        k = int(e.get("from_step", 0))
        for s in [s for s in self.history if s > k]:
            del self.history[s]
        self.prev_step = k
        chain = e.get("chain")
        if e.get("event") == "start":
            self.history.clear()
            fp = e.get("data_config_fingerprint")
            if chain is None:  # tracker format 1: the genesis is not recorded
                self.prev_chain = None
                self.out.notes.append(
                    f"line {lineno}: a start event of tracker format 1 (no data config): the "
                    "first record after it cannot be linked"
                )
                return
            if fp is None or fingerprint(e.get("data_config")) != fp or genesis(fp) != chain:
                self.problem(
                    lineno,
                    None,
                    "event",
                    f"line {lineno}: the start event's chain is not the genesis of its data "
                    "config (the event or its data config was edited)",
                )
        elif e.get("event") == "resume" and k > 0:
            linked = self.history.get(k)
            if e.get("chain_restart") or e.get("log_mismatch_ignored"):
                why = "audit was off" if e.get("chain_restart") else "ignore_log_mismatch"
                self.out.notes.append(
                    f"line {lineno}: resume from step {k} restarted the chain ({why}): steps "
                    f"up to {k} and after it are not linked"
                )
            elif linked is None:
                self.problem(
                    lineno,
                    k,
                    "event",
                    f"line {lineno}: resume from step {k}, but the log has no record of step {k} "
                    "before it (records deleted?)",
                )
            elif linked != chain:
                self.problem(
                    lineno,
                    k,
                    "event",
                    f"line {lineno}: resume from step {k} names chain {str(chain)[:16]}..., the "
                    f"log's record of step {k} has {linked[:16]}...",
                )
        self.prev_chain = chain

    def record(self, lineno: int, r: dict[str, Any]) -> None:
        step = int(r["step"])
        if self.prev_step is None:
            self.problem(
                lineno, step, "orphan", f"line {lineno}: step {step} before any start event"
            )
        elif step > self.prev_step + 1:  # the first bad step is the first missing one
            gap = self.prev_step + 1
            what = f"step {gap} is" if gap == step - 1 else f"steps {gap}..{step - 1} are"
            self.problem(
                lineno,
                gap,
                "order",
                f"line {lineno}: {what} missing before the record of step {step} (deleted?)",
            )
        elif step <= self.prev_step:
            self.problem(
                lineno,
                step,
                "order",
                f"line {lineno}: record of step {step} follows step {self.prev_step} "
                "(repeated or out of order)",
            )
        if self.prev_chain is not None and chain_next(self.prev_chain, r) != r["chain"]:
            self.problem(
                lineno,
                step,
                "chain",
                f"line {lineno}: record of step {step}: its chain does not follow from the "
                "record before it (a record was edited, inserted or deleted)",
            )
        self.prev_step, self.prev_chain = step, r["chain"]
        self.history[step] = r["chain"]


def read_log(path: str | os.PathLike) -> LogContents:
    """Parse a sequence log, apply its events and check its chain. Raises TrackerError
    on unreadable input; integrity problems are listed in ``problems``.

    A truncated final line (no trailing newline, invalid JSON) is tolerated and
    reported; unparsable lines anywhere else are an error naming the line.
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
    check = _ChainCheck(out)
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
        try:
            if "event" in entry:
                check.event(lineno, entry)
            else:
                check.record(lineno, entry)
        except (TypeError, ValueError) as e:
            raise TrackerError(
                f"{path}:{lineno}: a field has the wrong type ({e}); the log is corrupt"
            ) from None
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
        config: DataConfig,
        writer: bool,
        enabled: bool = True,
    ) -> None:
        self.path = Path(path)
        self.config = config
        self.writer = writer and enabled
        self.enabled = enabled
        self.step = 0
        self.chain = genesis(config.fingerprint)

    def _config_fields(self) -> dict[str, Any]:
        return {
            "tracker_format": TRACKER_FORMAT,
            "data_config": self.config.to_dict(),
            "data_config_fingerprint": self.config.fingerprint,
        }

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
        self.step, self.chain = 0, genesis(self.config.fingerprint)
        self._append(
            {
                "event": "start",
                "from_step": 0,
                "chain": self.chain,
                **self._config_fields(),
                **topology,
            }
        )

    def check_resume(self, head: dict[str, Any]) -> str | None:
        """Why the log cannot continue from the checkpoint's chain ``head`` (None: it can).

        Reads the log (the writer only; other ranks answer None).
        """
        step, chain = int(head["step"]), str(head["chain"])
        if not self.writer or step == 0:
            return None
        try:
            rec = read_log(self.path).records.get(step)
        except TrackerError as e:
            return str(e)
        if rec is None:
            return f"it has no record of step {step}"
        if rec["chain"] != chain:
            return (
                f"its record of step {step} has chain {rec['chain'][:16]}..., "
                f"the checkpoint has {chain[:16]}..."
            )
        return None

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
        checkpoint restored into a foreign run folder), unless ``ignore_mismatch``.
        """
        step, chain = int(head["step"]), str(head["chain"])
        problem = self.check_resume(head)
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
        self._append(
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
                **self._config_fields(),
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
            "v": TRACKER_FORMAT,
            "step": step,
            "first_position": int(first_position),
            "num_samples": len(ids),
            "ids_digest": ids_digest(ids, self.config.order_key, first_position),
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
