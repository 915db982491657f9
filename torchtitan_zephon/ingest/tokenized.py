"""Tokenized units: a prepare's tokens of each work unit, kept in a staging folder beside
the output.

Role: a prepare (``prepare.py``) tokenizes each work unit (``units.py``) into
``<parent>/.<name>.prepare/parts/`` (the folder keeps its first name, so a prepare
killed by an older version is still reused): ``KEY.tokens`` (the unit's tokens in
the store's dtype), ``KEY.docs`` (its documents' start offsets, from 0, int64) and
``KEY.json``, the tokenized unit's record, written last. The staging folder's
``store/`` is where the tokenized units are assembled into the store's files (each at
its offset, by any number of processes; in a sharded store each tokenized unit is one
or more shards, one of one shard linked, not copied) before the store is renamed to
the output.

Invariants:
- A tokenized unit whose record exists is finished: the record is written atomically
  (a temporary file renamed) after both of its files, and names their sizes and xxh3
  hashes, the unit it came from (source, range, tokenizer, text field, dtype) and
  the xxh3 of the input bytes it was read from.
- ``load_tokenized`` returns a record only if all of that still holds: the same unit,
  files that hash as recorded, and input bytes that still hash the same; so a
  reused tokenized unit is exactly what tokenizing its unit again would write.
- The key of a tokenized unit is a hash of its unit's description alone, so those of
  units that did not change are found again whatever else changed among the inputs.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from torchtitan_zephon.store.format import (
    CHECKSUMS,
    DOC_OFFSETS,
    SHARD_FOLDER,
    TOKENS,
    StoreError,
    canonical_json,
)
from torchtitan_zephon.store.shards import shard_counts, shard_name
from torchtitan_zephon.store.writer import pwrite_all

TOKENIZED = "parts"
"""The staging subfolder of tokenized units (its first name, kept: see above)."""
ASSEMBLY = "store"
RANKS_FILE = "ranks.json"
_BLOCK = 1 << 24


def staging_folder(output: Path) -> Path:
    """The staging folder of a prepare writing ``output``: a hidden sibling of it."""
    return output.parent / f".{output.name}.prepare"


class WriterLock:
    """Rank 0's exclusive ``flock`` on ``.<name>.prepare.lock`` beside the output, held
    for a whole prepare, so two prepares never write one staging folder or output
    (the second is refused, naming the holder). The file is removed on release (a
    locker checks it still holds the file at that path, so the removal cannot let
    two in). Where the filesystem refuses locks, nothing is locked."""

    def __init__(self, output: Path) -> None:
        self.output = output
        self.path = output.parent / f".{output.name}.prepare.lock"
        self._fh: Any = None

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(
                f"cannot create the folder of the output {self.output} ({e.strerror}: "
                f"{e.filename}); choose an output in a folder this process can create and "
                "write."
            ) from None
        while True:
            try:
                fh = open(self.path, "a+")  # noqa: SIM115 - kept open while locked
            except OSError as e:
                raise StoreError(
                    f"cannot write beside the output {self.output} ({e.strerror}: "
                    f"{e.filename}); choose an output in a folder this process can write."
                ) from None
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.seek(0)
                holder = fh.read().strip() or "another process"
                fh.close()
                raise StoreError(
                    f"another prepare ({holder}) is writing {self.output}; wait for it to "
                    f"finish, or stop it first (its lock: {self.path})."
                ) from None
            except OSError:  # no locks on this filesystem
                fh.close()
                self.path.unlink(missing_ok=True)
                return
            try:
                same = os.stat(self.path).st_ino == os.fstat(fh.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            fh.close()  # the holder before us removed it: lock the new file
        fh.seek(0)
        fh.truncate()
        fh.write(f"{socket.gethostname()} pid {os.getpid()}\n")
        fh.flush()
        self._fh = fh

    def release(self) -> None:
        if self._fh is not None:
            self.path.unlink(missing_ok=True)
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None


def unit_key(identity: dict[str, Any]) -> str:
    """The file name stem of the tokenized unit ``identity`` describes."""
    return xxhash.xxh3_128_hexdigest(canonical_json(identity))


def _paths(folder: Path, key: str) -> tuple[Path, Path, Path]:
    return folder / f"{key}.tokens", folder / f"{key}.docs", folder / f"{key}.json"


def finished_units(staging: Path) -> int:
    """How many finished tokenized units (records) the staging folder holds."""
    folder = staging / TOKENIZED
    return sum(1 for _ in folder.glob("*.json")) if folder.is_dir() else 0


class TokenizedWriter:
    """Writes one tokenized unit: its tokens and document starts as chunks arrive, then its record."""

    def __init__(self, folder: Path, key: str, dtype: np.dtype) -> None:
        self.key = key
        self.dtype = dtype
        self._final = _paths(folder, key)
        self._tmp = [p.with_name(f"{p.name}.tmp-{os.getpid()}") for p in self._final]
        self._tokens = open(self._tmp[0], "wb")  # noqa: SIM115 - closed in finish/abort
        self._docs = open(self._tmp[1], "wb")  # noqa: SIM115
        self._h_tokens = xxhash.xxh3_128()
        self._h_docs = xxhash.xxh3_128()
        self.num_tokens = 0
        self.num_docs = 0
        self.max_token_id = -1

    def add(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        """Append a chunk: ``flat`` tokens (each document followed by EOS), ``lengths``."""
        if not lengths.size:
            return
        starts = self.num_tokens + np.concatenate(([0], np.cumsum(lengths)[:-1]))
        blob_docs = starts.astype("<i8").tobytes()
        blob_tokens = flat.astype(self.dtype).tobytes()
        self._docs.write(blob_docs)
        self._tokens.write(blob_tokens)
        self._h_docs.update(blob_docs)
        self._h_tokens.update(blob_tokens)
        self.num_tokens += int(flat.size)
        self.num_docs += int(lengths.size)
        self.max_token_id = max(self.max_token_id, int(flat.max()))

    def finish(self, identity: dict[str, Any], input_hash: str) -> dict[str, Any]:
        """Close the unit's files, move them into place, then write the record; return it."""
        self._tokens.close()
        self._docs.close()
        record = {
            "key": self.key,
            "identity": identity,
            "input_xxh3_128": input_hash,
            "tokens": self.num_tokens,
            "documents": self.num_docs,
            "max_token_id": self.max_token_id,
            "tokens_xxh3_128": self._h_tokens.hexdigest(),
            "docs_xxh3_128": self._h_docs.hexdigest(),
        }
        os.replace(self._tmp[0], self._final[0])
        os.replace(self._tmp[1], self._final[1])
        self._tmp[2].write_text(json.dumps(record, sort_keys=True) + "\n")
        os.replace(
            self._tmp[2], self._final[2]
        )  # last: from here on the tokenized unit is finished
        return record

    def abort(self) -> None:
        """Drop what was written (the tokenized unit stays unfinished)."""
        self._tokens.close()
        self._docs.close()
        for p in self._tmp:
            p.unlink(missing_ok=True)


def _file_hash(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def load_tokenized(
    folder: Path, key: str, identity: dict[str, Any], input_hash: str, itemsize: int
) -> dict[str, Any] | None:
    """The record of the finished tokenized unit ``key`` if it is intact and still matches its unit
    (``identity``) and input (``input_hash``); None if it must be made again."""
    tokens, docs, rec_path = _paths(folder, key)
    try:
        record = json.loads(rec_path.read_text())
        if (
            not isinstance(record, dict)
            or record.get("identity") != identity
            or record.get("input_xxh3_128") != input_hash
            or tokens.stat().st_size != int(record["tokens"]) * itemsize
            or docs.stat().st_size != int(record["documents"]) * 8
            or _file_hash(tokens) != record["tokens_xxh3_128"]
            or _file_hash(docs) != record["docs_xxh3_128"]
        ):
            return None
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    return record


def create_store_files(
    store: Path,
    num_tokens: int,
    num_docs: int,
    num_chunks: int,
    itemsize: int,
    *,
    sharded: bool = False,
):
    """Create the assembled store's files at their final sizes (holes, filled by the tokenized units);
    a sharded store's tokens folder instead of tokens.bin (``sharded``)."""
    store.mkdir(parents=True, exist_ok=True)
    files = [(DOC_OFFSETS, num_docs * 8), (CHECKSUMS, num_chunks * 8)]
    if sharded:
        (store / SHARD_FOLDER).mkdir()
    else:
        files.insert(0, (TOKENS, num_tokens * itemsize))
    for name, size in files:
        with open(store / name, "wb") as fh:
            fh.truncate(size)


def write_unit_into_store(
    store: Path,
    folder: Path,
    record: dict[str, Any],
    token_start: int,
    doc_start: int,
    itemsize: int,
) -> None:
    """Copy a tokenized unit's tokens to ``token_start`` of tokens.bin and its document starts,
    shifted by ``token_start``, to document ``doc_start`` of doc_offsets.bin."""
    tokens, _, _ = _paths(folder, record["key"])
    fd = os.open(store / TOKENS, os.O_WRONLY)
    try:
        offset = token_start * itemsize
        with open(tokens, "rb") as fh:
            for block in iter(lambda: fh.read(_BLOCK), b""):
                pwrite_all(fd, block, offset)
                offset += len(block)
    finally:
        os.close(fd)
    write_unit_documents(store, folder, record, token_start, doc_start)


def unit_shards(record: dict[str, Any], shard_tokens: int) -> list[int]:
    """The tokens of each shard a tokenized unit becomes in a sharded store: all of it when
    it holds at most ``shard_tokens`` tokens, else cut into shards of ``shard_tokens``
    (the last shorter); none for a unit without tokens."""
    n = int(record["tokens"])
    return shard_counts(n, shard_tokens) if n else []


def write_unit_shards(
    store: Path,
    folder: Path,
    record: dict[str, Any],
    first_shard: int,
    shard_tokens: int,
    itemsize: int,
) -> None:
    """A tokenized unit's tokens as shards ``first_shard``, ... of a sharded store (``store.shards``):
    one that is one shard is linked (a second name of its file: its tokens are not
    written again), a larger one cut into shards (written)."""
    tokens, _, _ = _paths(folder, record["key"])
    counts = unit_shards(record, shard_tokens)
    if len(counts) == 1:
        target = store / shard_name(first_shard)
        target.unlink(missing_ok=True)
        os.link(tokens, target)
        return
    with open(tokens, "rb") as fh:
        for k, count in enumerate(counts):
            (store / shard_name(first_shard + k)).write_bytes(fh.read(count * itemsize))


def write_unit_documents(
    store: Path, folder: Path, record: dict[str, Any], token_start: int, doc_start: int
) -> None:
    """A tokenized unit's document starts, shifted by ``token_start``, at document ``doc_start`` of
    doc_offsets.bin."""
    _, docs, _ = _paths(folder, record["key"])
    fd = os.open(store / DOC_OFFSETS, os.O_WRONLY)
    try:
        offset = doc_start * 8
        with open(docs, "rb") as fh:
            for block in iter(lambda: fh.read(_BLOCK), b""):
                shifted = np.frombuffer(block, dtype="<i8") + token_start
                pwrite_all(fd, shifted.astype("<i8").tobytes(), offset)
                offset += len(block)
    finally:
        os.close(fd)
