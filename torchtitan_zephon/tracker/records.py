"""What the sequence log is made of: its path, record and event formats, digests, chain,
and ``LogProblem``, the first place a log stops being its own proof (the reader finds
them; ``step_order`` and ``links`` report them through it).

Invariant: a step record's line is ``canonical_json(body)`` with ``,"chain":"<hex>"``
spliced in before the closing brace, where ``chain = sha256(previous chain +
canonical_json(body))``. So a reader can recompute the chain from the line's
bytes without re-serialising it (``chain_of_line``), and a line whose bytes
were changed in any way no longer chains.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_zephon.store.format import canonical_json

LOG_NAME = "sequence_log.jsonl"
TRACKER_FORMAT = 2
"""2: step records are bound to the data config (``"v": 2``), events carry the data
config and the chain. 1: unbound records (read; verify calls them unbound)."""

_CHAIN_OPEN = b',"chain":"'
_TAIL = len(_CHAIN_OPEN) + 64 + len(b'"}')


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


def window_digests(inputs: Any, labels: Any) -> bytes:
    """Per-sample digests (``sample_digests``) of a delivered micro-batch: its inputs
    [n, seq_len] and labels (CPU tensors or arrays), each window its inputs then its
    last label."""
    windows = np.concatenate([np.asarray(inputs), np.asarray(labels)[:, -1:]], axis=1)
    return sample_digests(windows)


def tokens_digest(per_sample: bytes) -> str:
    return hashlib.sha256(per_sample).hexdigest()


def chain_next(previous: str, record: dict[str, Any]) -> str:
    body = {k: v for k, v in record.items() if k != "chain"}
    return hashlib.sha256(previous.encode() + canonical_json(body)).hexdigest()


def record_line(previous: str, body: dict[str, Any]) -> tuple[str, bytes]:
    """(chain, line without newline) of a step record ``body`` following ``previous``."""
    raw = canonical_json(body)
    chain = hashlib.sha256(previous.encode() + raw).hexdigest()
    return chain, raw[:-1] + _CHAIN_OPEN + chain.encode() + b'"}'


def chain_of_line(previous: str, line: bytes) -> tuple[str, bool] | None:
    """Fast path for lines written by ``record_line``: (the line's chain, whether it
    follows from ``previous``), or None when the line is not in that layout."""
    if len(line) <= _TAIL or line[-_TAIL : -_TAIL + len(_CHAIN_OPEN)] != _CHAIN_OPEN:
        return None
    chain = line[-66:-2].decode("ascii", "replace")
    body = line[:-_TAIL] + b"}"
    return chain, hashlib.sha256(previous.encode() + body).hexdigest() == chain


RECORD_LINE = re.compile(
    rb'\{"first_position":(\d+),"ids_digest":"([0-9a-f]{64})","num_samples":(\d+),'
    rb'"step":(\d+),(?:"tokens_digest":"([0-9a-f]{64})",)?"v":(\d+),"chain":"([0-9a-f]{64})"\}'
)


def fields_of_line(line: bytes) -> dict[str, Any] | None:
    """The record of a line in ``record_line``'s layout with the keys of format 2,
    without a JSON parser (several times faster); None for any other line."""
    m = RECORD_LINE.fullmatch(line)
    if m is None:
        return None
    first, ids, num, step, tokens, v, chain = m.groups()
    out: dict[str, Any] = {
        "first_position": int(first),
        "ids_digest": ids.decode(),
        "num_samples": int(num),
        "step": int(step),
        "v": int(v),
        "chain": chain.decode(),
    }
    if tokens is not None:
        out["tokens_digest"] = tokens.decode()
    return out


@dataclass
class LogProblem:
    """The first place where a log stops being its own proof."""

    line: int
    step: int | None
    kind: str
    """``chain`` (a record's chain does not follow), ``order`` (a gap, a repeated or
    reordered step), ``event`` (a start, resume or skip event that does not link up),
    ``orphan`` (a step record before any start event)."""
    message: str
