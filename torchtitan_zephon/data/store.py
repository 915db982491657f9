"""The token store: a prepared corpus, memory-mapped read-only.

Role: give O(1) access to training samples. Sample ``i`` for a given
``seq_len`` is the window ``tokens[i*seq_len : i*seq_len + seq_len + 1]``
(inputs = window[:-1], labels = window[1:]).

Invariants:
- A store that opens is complete and its manifest unmodified: every file has
  the size its manifest promises, the manifest hashes to its recorded
  ``fingerprint`` and checksums.bin hashes to the value the manifest records.
  Opening reads no tokens.
- Every token that ``window``/``windows`` return was checked against the
  content checksums first: tokens.bin is cut into chunks of ``chunk_tokens``
  tokens, each with an xxh3-64 checksum in checksums.bin; a TokenStore hashes a
  chunk the first time it reads from it (once per object, thread-safe) and a
  mismatch is a StoreError naming the store, the file and the chunk, so no
  sample is served from changed content. ``tokens`` itself is the raw map.
- ``max_token_id`` (recorded by prepare) bounds every id the checked reads can
  return, so a vocabulary check against it is exact.
- The fingerprint of a version-2 store hashes the whole manifest, checksums
  included: two such stores with the same fingerprint serve the same samples.

Chunks of 65,536 tokens suit random sample access: hashing one takes ~10-20
microseconds, so the first read of a chunk (128-256 KB) costs little and
an epoch hashes the store once; checksums.bin (8 bytes per chunk,
120 MB for 10^12 tokens) is hashed whole at open. Once every chunk is checked a
read costs nothing more; before that, a read wholly below the lowest unchecked
chunk or above the highest (say, all but held-out samples at the end) costs one
comparison, any other looks up each sample's chunks.

Version-1 stores (written before checksums) still open, with an
``UncheckedStoreWarning``, and their reads are not checked. ``upgrade_store``
(``zephon inspect STORE --upgrade``) adds checksums.bin and content.json (the
content section) beside the unchanged manifest, so the fingerprint, and every
checkpoint and sequence log that names it, stays valid (older zephon versions
still open the store); the checksums then vouch for the content as it was at
the upgrade. ``TokenStore.check`` (``zephon inspect STORE --check``) hashes
everything and reports each bad chunk. The checksums catch corruption and
edits, not a forger who also rewrites checksums.bin and the manifest.

Layout on disk::

    <store>/manifest.json    format, tokenizer, dtype, counts, sources, content, fingerprint
    <store>/tokens.bin       num_tokens tokens, little-endian uint16 or uint32
    <store>/doc_offsets.bin  num_documents int64 start offsets, one per document
    <store>/checksums.bin    one little-endian uint64 xxh3-64 per chunk of tokens.bin
    <store>/content.json     only in a version-1 store upgraded in place: its content section

The content section: ``algorithm`` ("xxh3_64"), ``chunk_tokens``,
``checksums_xxh3_128`` (of checksums.bin), ``doc_offsets_xxh3_128`` (checked by
``check`` only: training does not read document offsets) and ``max_token_id``.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from numpy.lib.stride_tricks import as_strided

FORMAT = "zephon-token-store"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
TOKENS = "tokens.bin"
DOC_OFFSETS = "doc_offsets.bin"
CHECKSUMS = "checksums.bin"
CONTENT = "content.json"
CHUNK_TOKENS = 1 << 16
CHECKSUM_ALGORITHM = "xxh3_64"

_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_REPREPARE = "Re-run `zephon prepare` to rebuild the store."


class StoreError(ValueError):
    """A token store (or the input to build one) is missing, incomplete or invalid."""


class UncheckedStoreWarning(UserWarning):
    """A store without content checksums (format version 1) was opened: its reads are unchecked."""


def manifest_fingerprint(manifest: dict[str, Any]) -> str:
    """Hex sha256 of the canonical JSON of ``manifest`` without its ``fingerprint`` field."""
    body = {k: v for k, v in manifest.items() if k != "fingerprint"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def is_store(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder holding a token store manifest."""
    p = Path(path)
    if not (p / MANIFEST).is_file():
        return False
    try:
        return json.loads((p / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError, RecursionError):  # Recursion: deep JSON
        return False


# ----------------------------------------------------------------------------- checksums


def content_checksums(
    tokens: np.ndarray, chunk_tokens: int = CHUNK_TOKENS
) -> tuple[np.ndarray, np.ndarray]:
    """(xxh3-64 of each chunk's little-endian bytes as uint64, max token id of each chunk).

    Chunk ``c`` is ``tokens[c * chunk_tokens : (c + 1) * chunk_tokens]``; the last may be short.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}.")
    tokens = np.ascontiguousarray(tokens)
    n = -(-tokens.size // chunk_tokens)
    sums = np.empty(n, dtype="<u8")
    maxima = np.empty(n, dtype=np.int64)
    for c in range(n):
        chunk = tokens[c * chunk_tokens : (c + 1) * chunk_tokens]
        sums[c] = xxhash.xxh3_64_intdigest(chunk)
        maxima[c] = int(chunk.max())
    return sums, maxima


def _file_xxh3_128(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_checksums(
    store_dir: str | os.PathLike, manifest: dict[str, Any], *, chunk_tokens: int = CHUNK_TOKENS
) -> dict[str, Any]:
    """Hash the token content of the store files in ``store_dir`` (as ``manifest`` describes
    them), write ``checksums.bin`` and return the manifest's ``content`` section.

    Depends only on the bytes of tokens.bin and doc_offsets.bin (and ``chunk_tokens``).
    """
    root = Path(store_dir)
    tokens = _map(root / TOKENS, _DTYPES[manifest["dtype"]], int(manifest["num_tokens"]))
    sums, maxima = content_checksums(tokens, chunk_tokens)
    tmp = root / f".{CHECKSUMS}.tmp"
    tmp.write_bytes(sums.tobytes())
    os.replace(tmp, root / CHECKSUMS)
    return content_section(root, int(maxima.max()) if maxima.size else -1, chunk_tokens)


def num_chunks(num_tokens: int, chunk_tokens: int = CHUNK_TOKENS) -> int:
    """How many checksum chunks cover ``num_tokens`` tokens (the last may be short)."""
    return -(-num_tokens // chunk_tokens)


def write_chunk_checksums(
    store_dir: str | os.PathLike,
    manifest: dict[str, Any],
    first: int,
    stop: int,
    *,
    chunk_tokens: int = CHUNK_TOKENS,
) -> int:
    """Hash chunks ``[first, stop)`` of tokens.bin and write their checksums at their place
    in ``checksums.bin``, which already has its final size (``num_chunks`` x 8 bytes);
    return the largest token id of these chunks (-1 for none).

    Several processes may each write a disjoint range: together they write the same
    bytes as ``write_checksums``, and ``content_section`` then completes the section.
    """
    root = Path(store_dir)
    tokens = _map(root / TOKENS, _DTYPES[manifest["dtype"]], int(manifest["num_tokens"]))
    sums, maxima = content_checksums(
        tokens[first * chunk_tokens : stop * chunk_tokens], chunk_tokens
    )
    fd = os.open(root / CHECKSUMS, os.O_WRONLY)
    try:
        pwrite_all(fd, sums.tobytes(), first * 8)
    finally:
        os.close(fd)
    return int(maxima.max()) if maxima.size else -1


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Write all of ``data`` to ``fd`` at ``offset`` (``os.pwrite`` may write less)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def content_section(
    store_dir: str | os.PathLike, max_token_id: int, chunk_tokens: int = CHUNK_TOKENS
) -> dict[str, Any]:
    """The manifest's ``content`` section of the store files in ``store_dir``, whose
    ``checksums.bin`` is complete and whose largest token id is ``max_token_id``."""
    root = Path(store_dir)
    return {
        "algorithm": CHECKSUM_ALGORITHM,
        "chunk_tokens": int(chunk_tokens),
        "checksums_xxh3_128": _file_xxh3_128(root / CHECKSUMS),
        "doc_offsets_xxh3_128": _file_xxh3_128(root / DOC_OFFSETS),
        "max_token_id": int(max_token_id),
    }


@dataclass
class ContentReport:
    """Result of ``TokenStore.check``: each finding, and the chunks whose checksum differs."""

    chunks: int
    chunk_tokens: int | None
    max_token_id: int | None  # the largest id actually found
    bad_chunks: list[dict[str, int]] = field(default_factory=list)  # index, start, stop
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "chunks": self.chunks,
            "chunk_tokens": self.chunk_tokens,
            "max_token_id": self.max_token_id,
            "bad_chunks": self.bad_chunks,
            "problems": self.problems,
        }


# ----------------------------------------------------------------------------- the store


class TokenStore:
    """A validated, memory-mapped token store. Build one with ``TokenStore.open``."""

    def __init__(
        self,
        path: Path,
        manifest: dict[str, Any],
        tokens: np.ndarray,
        doc_offsets: np.ndarray,
        content: dict[str, Any] | None = None,
        checksums: np.ndarray | None = None,
        *,
        verify: bool = True,
    ) -> None:
        self.path = path
        self.manifest = manifest
        self.fingerprint: str = manifest["fingerprint"]
        self.version: int = int(manifest["version"])
        self.tokens = tokens
        self.doc_offsets = doc_offsets
        self.num_tokens: int = int(manifest["num_tokens"])
        self.num_documents: int = int(manifest["num_documents"])
        self.eos_id: int = int(manifest["eos_id"])
        self.vocab_size: int = int(manifest["tokenizer"]["vocab_size"])
        self.tokenizer_hash: str = manifest["tokenizer"]["sha256"]
        self.dtype = tokens.dtype
        self.content = content  # the content section (manifest, or content.json for version 1)
        self.checksums = checksums
        # Plain ndarray views of the same maps: slicing them is cheaper than slicing a memmap.
        self._token_array = tokens.view(np.ndarray)
        self._sums = None if checksums is None else checksums.view(np.ndarray)
        self.chunk_tokens: int | None = int(content["chunk_tokens"]) if content else None
        self.max_token_id: int | None = int(content["max_token_id"]) if content else None
        self.num_chunks = 0 if checksums is None else int(checksums.size)
        self.verifies = bool(verify) and checksums is not None
        # One flag per chunk: checked by this object. Flags only go 0 -> 1, under the lock.
        # A bytearray (fast to test from Python) with a numpy view of the same memory.
        self._checked = bytearray(self.num_chunks)
        self._checked_np = np.frombuffer(self._checked, dtype=np.bool_)
        self._unverified = self.num_chunks if self.verifies else 0
        # Every chunk below the lowest unchecked one and above the highest is checked: a
        # read within those ranges needs no per-sample lookup. Both only move inwards,
        # under the lock, so a stale read of either is merely conservative.
        self._lowest_unchecked = 0 if self._unverified else self.num_chunks
        self._highest_unchecked = self.num_chunks - 1 if self._unverified else -1
        self._verify_lock = threading.Lock()
        self._views: dict[int, np.ndarray] = {}

    def __repr__(self) -> str:
        return (
            f"TokenStore({str(self.path)!r}, tokens={self.num_tokens}, "
            f"documents={self.num_documents}, fingerprint={self.fingerprint[:12]})"
        )

    @classmethod
    def open(cls, path: str | os.PathLike, *, verify: bool = True) -> TokenStore:
        """Open and validate the store at ``path``; raise StoreError if it is not usable.

        Cheap: reads the manifest and checksums.bin, maps the rest. With ``verify``
        (the default) every read checks the chunks it touches (see the module
        docstring); ``verify=False`` serves unchecked tokens (benchmarks only).
        """
        root = Path(path)
        if not root.exists():
            raise StoreError(
                f"token store {str(root)!r} does not exist. Expected a folder made by "
                "`zephon prepare INPUT... --tokenizer DIR --output STORE`."
            )
        if not root.is_dir():
            raise StoreError(
                f"token store {str(root)!r} is a file, expected a folder made by `zephon prepare`."
            )
        mpath = root / MANIFEST
        if not mpath.is_file():
            raise StoreError(
                f"token store {str(root)!r} has no {MANIFEST}; it is not a store or its "
                f"preparation did not finish. {_REPREPARE}"
            )
        try:
            manifest = json.loads(mpath.read_text())
        except (OSError, ValueError, RecursionError) as e:  # RecursionError: deep JSON
            raise StoreError(f"cannot read {str(mpath)!r}: {e}. {_REPREPARE}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise StoreError(
                f"{str(mpath)!r} is not a token store manifest (expected format {FORMAT!r})."
            )
        version = manifest.get("version")
        if version not in READABLE_VERSIONS:
            raise StoreError(
                f"{str(mpath)!r} has store format version {version!r}, this "
                f"version of zephon reads versions {list(READABLE_VERSIONS)}. {_REPREPARE}"
            )
        try:
            expected = manifest["fingerprint"]
            if not isinstance(expected, str):
                raise TypeError(f"fingerprint is a {type(expected).__name__}, not text")
            dtype = _DTYPES[manifest["dtype"]]
            num_tokens = int(manifest["num_tokens"])
            num_docs = int(manifest["num_documents"])
            if num_docs < 0:
                raise ValueError(f"num_documents is {num_docs}")
            int(manifest["tokenizer"]["vocab_size"]), manifest["tokenizer"]["sha256"]
            int(manifest["eos_id"])
            if version >= 2:
                manifest["content"]
            _check_sources(manifest.get("sources", []))
        except (KeyError, TypeError, ValueError, OverflowError) as e:  # Overflow: 1e400
            raise StoreError(
                f"{str(mpath)!r} is missing or has an invalid field ({e}). {_REPREPARE}"
            ) from None
        actual = manifest_fingerprint(manifest)
        if actual != expected:
            raise StoreError(
                f"{str(mpath)!r} was modified after preparation: recorded fingerprint "
                f"{expected[:16]}..., contents hash to {actual[:16]}.... {_REPREPARE}"
            )
        if num_tokens < 1:
            raise StoreError(f"token store {str(root)!r} holds no tokens. {_REPREPARE}")
        tokens = _map(root / TOKENS, dtype, num_tokens)
        doc_offsets = _map(root / DOC_OFFSETS, np.dtype("<i8"), num_docs)
        if version >= 2:
            content, where = manifest["content"], mpath
        else:
            content, where = _read_content(root), root / CONTENT
        checksums = None
        if content is None:
            warnings.warn(
                f"token store {str(root)!r} has no content checksums (store format version 1): "
                "changed or corrupt tokens cannot be detected when it is read. Add them in "
                f"place, keeping its fingerprint, with `zephon inspect {root} --upgrade`.",
                UncheckedStoreWarning,
                stacklevel=2,
            )
        else:
            checksums = _map_checksums(root, content, where, num_tokens)
        return cls(root, manifest, tokens, doc_offsets, content, checksums, verify=verify)

    def num_samples(self, seq_len: int) -> int:
        """Number of whole samples of ``seq_len`` (+1 label token) in the store."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}.")
        return (self.num_tokens - 1) // seq_len

    def window(self, i: int, seq_len: int) -> np.ndarray:
        """Tokens of sample ``i``: ``seq_len + 1`` values in the store dtype (checked)."""
        n = self.num_samples(seq_len)
        if not 0 <= i < n:
            raise IndexError(f"sample {i} outside [0, {n}) for seq_len {seq_len}.")
        start = int(i) * seq_len
        if self._unverified:
            self._check_samples(np.array([i], dtype=np.int64), seq_len)
        return np.array(self.tokens[start : start + seq_len + 1])

    def windows(self, ids: np.ndarray, seq_len: int) -> np.ndarray:
        """Gather samples ``ids``: array [len(ids), seq_len + 1] in the store dtype (checked)."""
        ids = np.asarray(ids, dtype=np.int64).ravel()
        n = self.num_samples(seq_len)
        if ids.size:
            if ids.size <= 64:  # a micro-batch: plain Python beats numpy's per-call overhead
                listed = ids.tolist()
                lo, hi = min(listed), max(listed)
            else:
                lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= n:
                raise IndexError(
                    f"sample ids must lie in [0, {n}) for seq_len {seq_len}, "
                    f"found values in [{lo}, {hi}]."
                )
            # _unverified is 0 once every chunk was checked (or checks are off)
            if self._unverified and not self._checked_span(lo * seq_len, hi * seq_len + seq_len):
                self._check_samples(ids, seq_len)
        return self._sample_view(seq_len, n)[ids]

    # ------------------------------------------------------------------ content checks

    @property
    def unchecked_chunks(self) -> int:
        """Chunks this object would still hash before serving from them (0: checks off)."""
        return self._unverified

    def _checked_span(self, first: int, last: int) -> bool:
        """True when tokens [first, last] lie wholly below the lowest unchecked chunk or
        above the highest (a sufficient test: False says nothing)."""
        c = self.chunk_tokens
        return last // c < self._lowest_unchecked or first // c > self._highest_unchecked

    def _check_samples(self, ids: np.ndarray, seq_len: int) -> None:
        """Check every chunk that the windows of samples ``ids`` touch, unless this object
        checked it before."""
        c = self.chunk_tokens
        if seq_len <= c and ids.size <= 64:
            # A window touches at most two chunks. For a micro-batch, plain Python on the
            # bytearray is several times faster than numpy's per-call overhead.
            flags = self._checked
            missing = []
            for i in ids.tolist():
                start = i * seq_len
                first, last = start // c, (start + seq_len) // c
                if not (flags[first] and flags[last]):
                    missing += (first, last)
            if not missing:
                return
        else:
            lo = ids * seq_len // c
            hi = (ids * seq_len + seq_len) // c
            width = seq_len // c + 2  # chunks one window can touch, at most
            grid = lo[:, None] + np.arange(width)[None, :]
            need = grid[grid <= hi[:, None]]
            missing = need[~self._checked_np[need]].tolist()
        for chunk in sorted(set(missing)):
            if not self._checked[chunk]:  # another thread may have checked it meanwhile
                self._verify_chunk(chunk)

    def _chunk_range(self, chunk: int) -> tuple[int, int]:
        start = chunk * self.chunk_tokens
        return start, min(start + self.chunk_tokens, self.num_tokens)

    def _verify_chunk(self, chunk: int) -> None:
        start, stop = self._chunk_range(chunk)
        found = xxhash.xxh3_64_intdigest(self._token_array[start:stop])
        if found != int(self._sums[chunk]):
            raise StoreError(
                f"token store {str(self.path)!r}: chunk {chunk} of {TOKENS} (tokens "
                f"[{start}, {stop})) does not match its checksum in {CHECKSUMS}; the file was "
                "changed or corrupted after preparation. Run `zephon inspect "
                f"{self.path} --check` to list every bad chunk. {_REPREPARE}"
            )
        self._mark_checked(chunk)

    def _mark_checked(self, chunk: int) -> None:
        with self._verify_lock:
            if not self._checked[chunk]:
                self._checked[chunk] = 1
                self._unverified -= 1
                flags, lo, hi = self._checked, self._lowest_unchecked, self._highest_unchecked
                while lo < self.num_chunks and flags[lo]:
                    lo += 1
                while hi >= 0 and flags[hi]:
                    hi -= 1
                self._lowest_unchecked, self._highest_unchecked = lo, hi

    def check(self) -> ContentReport:
        """Hash and check everything (``zephon inspect STORE --check``); never raises on
        bad content, reports it. Chunks found intact count as checked for later reads."""
        report = ContentReport(self.num_chunks, self.chunk_tokens, None)
        content = self.content
        if content is None:
            report.problems.append(
                f"no content checksums (store format version {self.version}): the tokens "
                "cannot be verified. Add checksums with `zephon inspect "
                f"{self.path} --upgrade` (keeps the fingerprint)."
            )
            maxima = content_checksums(self.tokens, CHUNK_TOKENS)[1]
        else:
            sums, maxima = content_checksums(self.tokens, self.chunk_tokens)
            for chunk in np.flatnonzero(sums != np.asarray(self.checksums)).tolist():
                start, stop = self._chunk_range(chunk)
                report.bad_chunks.append({"index": chunk, "start": start, "stop": stop})
                report.problems.append(
                    f"chunk {chunk} (tokens [{start}, {stop})) of {TOKENS} does not match its "
                    f"checksum; its largest token id is {int(maxima[chunk])}"
                )
            if self.verifies:
                for chunk in np.flatnonzero(sums == np.asarray(self.checksums)).tolist():
                    self._mark_checked(chunk)
            found = _file_xxh3_128(self.path / DOC_OFFSETS)
            if found != content["doc_offsets_xxh3_128"]:
                report.problems.append(
                    f"{DOC_OFFSETS} does not match its recorded checksum (document "
                    "boundaries were changed after preparation)"
                )
        report.max_token_id = int(maxima.max())
        if content is not None and report.max_token_id != self.max_token_id:
            report.problems.append(
                f"the largest token id is {report.max_token_id}, the manifest records "
                f"max_token_id {self.max_token_id}"
            )
        report.problems.extend(self._structure_problems(report.max_token_id))
        return report

    def _structure_problems(self, max_token_id: int) -> list[str]:
        """What prepare guarantees about any store: ids within the tokenizer's vocabulary,
        document offsets increasing from 0, and EOS ending every document."""
        problems = []
        if max_token_id >= self.vocab_size:
            problems.append(
                f"token id {max_token_id} is outside the tokenizer's vocabulary of "
                f"{self.vocab_size} ids"
            )
        offs = np.asarray(self.doc_offsets)
        if offs.size and (offs[0] != 0 or (np.diff(offs) < 1).any() or offs[-1] >= self.num_tokens):
            problems.append(
                f"{DOC_OFFSETS} is not an increasing list of offsets from 0 below {self.num_tokens}"
            )
        else:
            ends = np.append(offs[1:], self.num_tokens) - 1
            missing = int(np.count_nonzero(self.tokens[ends] != self.eos_id))
            if missing:
                problems.append(
                    f"{missing} of {offs.size} documents do not end with the EOS id {self.eos_id}"
                )
        return problems

    def _sample_view(self, seq_len: int, n: int) -> np.ndarray:
        """Read-only [n, seq_len + 1] view of overlapping windows (no copy).

        Indexing its first axis with an id array gathers whole rows in C, which
        is the fastest gather numpy offers (~1 G tokens/s on one core).
        """
        view = self._views.get(seq_len)
        if view is None:
            item = self.tokens.dtype.itemsize
            view = as_strided(
                self.tokens, shape=(n, seq_len + 1), strides=(seq_len * item, item), writeable=False
            )
            self._views[seq_len] = view
        return view

    def document_ids(self, start: int, stop: int) -> np.ndarray:
        """Index of the document each token in [start, stop) belongs to (for doc masks)."""
        return np.searchsorted(self.doc_offsets, np.arange(start, stop), side="right") - 1

    def describe(self) -> dict[str, Any]:
        """Summary for ``zephon inspect``."""
        m = self.manifest
        return {
            "kind": "store",
            "path": str(self.path),
            "fingerprint": self.fingerprint,
            "format_version": self.version,
            "num_tokens": self.num_tokens,
            "num_documents": self.num_documents,
            "dtype": m["dtype"],
            "eos_id": self.eos_id,
            "vocab_size": self.vocab_size,
            "max_token_id": self.max_token_id,
            "chunk_tokens": self.chunk_tokens,
            "num_chunks": self.num_chunks,
            "tokenizer_sha256": self.tokenizer_hash,
            "text_field": m.get("text_field"),
            "size_bytes": self.num_tokens * self.tokens.dtype.itemsize
            + self.num_documents * 8
            + self.num_chunks * 8,
            "sources": m.get("sources", []),
        }


def upgrade_store(path: str | os.PathLike) -> tuple[TokenStore, bool]:
    """Add content checksums to a version-1 store in place; (the store, whether it changed).

    Writes checksums.bin and content.json; the manifest, hence the fingerprint, stays
    byte for byte the same. The content is first checked as far as it can be without
    checksums (ids within the vocabulary, document offsets, EOS at document ends); a
    store failing that is refused and left as it was. A store that already has
    checksums is left alone.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UncheckedStoreWarning)
        store = TokenStore.open(path)
    if store.checksums is not None:
        return store, False
    content = write_checksums(store.path, store.manifest)
    problems = store._structure_problems(content["max_token_id"])
    if problems:
        (store.path / CHECKSUMS).unlink(missing_ok=True)
        raise StoreError(
            f"token store {str(store.path)!r} was not upgraded: its content is already "
            f"inconsistent ({'; '.join(problems)}), and checksums would vouch for it. "
            f"Nothing was changed. {_REPREPARE}"
        )
    tmp = store.path / f".{CONTENT}.tmp"
    tmp.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, store.path / CONTENT)  # last: until here the store is unchanged
    return TokenStore.open(store.path), True


def _map_checksums(root: Path, content: dict[str, Any], where: Path, num_tokens: int) -> np.ndarray:
    """Map checksums.bin after checking the content section (from ``where``) and the file's
    own hash against it."""
    try:
        chunk_tokens = int(content["chunk_tokens"])
        int(content["max_token_id"])
        recorded = str(content["checksums_xxh3_128"])
        str(content["doc_offsets_xxh3_128"])
        if content["algorithm"] != CHECKSUM_ALGORITHM or chunk_tokens < 1:
            raise ValueError(
                f"algorithm {content['algorithm']!r}, chunk_tokens {chunk_tokens}; expected "
                f"{CHECKSUM_ALGORITHM!r} and >= 1"
            )
    except (KeyError, TypeError, ValueError) as e:
        raise StoreError(
            f"{str(where)!r}: the content section is missing or has an invalid field ({e}). "
            f"{_REPREPARE}"
        ) from None
    checksums = _map(root / CHECKSUMS, np.dtype("<u8"), -(-num_tokens // chunk_tokens))
    found = xxhash.xxh3_128_hexdigest(checksums)
    if found != recorded:
        raise StoreError(
            f"store file {str(root / CHECKSUMS)!r} was modified after preparation: "
            f"{where.name} records xxh3-128 {recorded[:16]}..., the file hashes to "
            f"{found[:16]}.... {_REPREPARE}"
        )
    return checksums


def _read_content(root: Path) -> dict[str, Any] | None:
    """The content section a version-1 store gained by ``upgrade_store``, if any."""
    path = root / CONTENT
    if not path.exists():
        return None
    try:
        content = json.loads(path.read_text())
        if not isinstance(content, dict):
            raise ValueError(f"expected a JSON object, found {type(content).__name__}")
    except (OSError, ValueError) as e:
        raise StoreError(
            f"cannot read {str(path)!r}: {e}. Delete it and run `zephon inspect {root} "
            "--upgrade` again."
        ) from None
    return content


def _check_sources(sources: Any) -> None:
    """Source records as prepare writes them (inspect prints these fields)."""
    if not isinstance(sources, list) or not all(
        isinstance(s, dict)
        and isinstance(s.get("name"), str)
        and isinstance(s.get("sha256"), str)
        and isinstance(s.get("size"), int)
        and "kind" in s
        for s in sources
    ):
        raise TypeError("sources is not a list of {name, kind, sha256, size} records")


def _map(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    """Memory-map ``count`` values of ``dtype`` from ``path`` read-only, checking its size."""
    if not path.is_file():
        raise StoreError(f"store file {str(path)!r} is missing. {_REPREPARE}")
    expected = count * dtype.itemsize
    actual = path.stat().st_size
    if actual != expected:
        state = "empty" if actual == 0 else ("truncated" if actual < expected else "too long")
        raise StoreError(
            f"store file {str(path)!r} is {state}: expected {expected} bytes "
            f"({count} x {dtype.name}), found {actual}. {_REPREPARE}"
        )
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def write_derived_store(
    folder: Path, like: TokenStore, blob: bytes, doc_offsets: np.ndarray, source: dict[str, Any]
) -> None:
    """Write a store into the existing folder ``folder`` from tokens already prepared:
    ``blob`` (tokens in ``like``'s dtype), its document starts, and the one manifest
    source record naming where they came from (sha256 and size added here); tokenizer,
    dtype and EOS are ``like``'s. Checksums and fingerprint are computed fresh."""
    (folder / TOKENS).write_bytes(blob)
    (folder / DOC_OFFSETS).write_bytes(np.asarray(doc_offsets).astype("<i8").tobytes())
    m = like.manifest
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tokenizer": m["tokenizer"],
        "dtype": m["dtype"],
        "eos_id": m["eos_id"],
        "num_tokens": len(blob) // like.dtype.itemsize,
        "num_documents": int(np.asarray(doc_offsets).size),
        "text_field": m.get("text_field", "text"),
        "sources": [{**source, "sha256": hashlib.sha256(blob).hexdigest(), "size": len(blob)}],
    }
    manifest["content"] = write_checksums(folder, manifest)
    manifest["fingerprint"] = manifest_fingerprint(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def slice_store(source: TokenStore, start: int, stop: int, output: str | os.PathLike) -> TokenStore:
    """Write the whole documents of ``source`` that lie within tokens ``[start, stop)``
    as a store of their own (same tokenizer and dtype, fresh checksums) and open it.

    A mixture's sources for tests and benchmarks, built in milliseconds without
    tokenizing; the manifest names the slice (``sources``), so slices of different
    ranges or stores have different fingerprints.
    """
    start, stop = int(start), int(stop)
    offsets = np.asarray(source.doc_offsets, dtype=np.int64)
    ends = np.append(offsets[1:], source.num_tokens)
    inside = np.nonzero((offsets >= start) & (ends <= stop))[0]
    if not 0 <= start < stop <= source.num_tokens or not inside.size:
        raise StoreError(
            f"slice [{start}, {stop}) holds no whole document of the {source.num_tokens} "
            f"tokens of {str(source.path)!r}; give a wider range."
        )
    out = Path(output)
    if out.exists():
        raise StoreError(f"output {str(out)!r} already exists; choose another path.")
    start, stop = int(offsets[inside[0]]), int(ends[inside[-1]])
    inside = offsets[inside] - start
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    blob = np.asarray(source.tokens[start:stop]).tobytes()
    write_derived_store(
        tmp,
        source,
        blob,
        inside,
        {
            "name": f"tokens [{start}, {stop}) of store {source.fingerprint[:16]}",
            "kind": "slice",
            "slice_of": source.fingerprint,
            "start": start,
            "stop": stop,
        },
    )
    os.rename(tmp, out)
    return TokenStore.open(out)


class StoreGroup:
    """Several stores of one dtype read together: a mixture's samples, most rows of a
    window from a different store, gathered by one fancy index whatever the number of
    stores.

    Row k of ``windows(sources, ids, seq_len)`` is the window of sample ``ids[k]`` of
    ``stores[sources[k]]``, equal to ``stores[sources[k]].windows([ids[k]], seq_len)[0]``
    and checked like it: every chunk a row touches is hashed before any row is served.

    Mechanics: the stores' token maps stay at fixed addresses. One read-only view
    (``as_strided``) starts at the lowest map and reaches the end of the highest, with a
    window of ``seq_len + 1`` tokens at every token offset; sample ``j`` of store ``i``
    is the window at the store's offset (in tokens) plus ``j x seq_len``. The view
    spans the gaps between the maps too, so memory safety rests on one invariant: the
    group reads only rows wholly inside one store's map. Every (source, id) pair is
    checked against ``[0, stores) x [0, num_samples)`` before the gather, and the group
    holds every store (so every map) for its lifetime. The content checks keep one flag
    per (store, chunk) in one array, a cache of the stores' own flags (which only go from
    unchecked to checked), so "is every chunk these rows touch checked" is a few
    vectorized operations across all stores, and nothing once every chunk is checked.
    """

    def __init__(self, stores: list[TokenStore]) -> None:
        if not stores:
            raise StoreError("a store group needs at least one store, found none.")
        if len({st.dtype for st in stores}) > 1:
            raise StoreError(
                "a store group needs stores of one token dtype, found "
                f"{sorted({str(st.dtype) for st in stores})}."
            )
        self.stores = list(stores)
        self.dtype = self.stores[0].dtype
        arrays = [st._token_array for st in self.stores]
        addresses = [int(a.__array_interface__["data"][0]) for a in arrays]
        low, item = min(addresses), self.dtype.itemsize
        if any((a - low) % item for a in addresses):  # maps are page-aligned: never
            raise StoreError(f"a store group needs token maps aligned to {item} bytes.")
        self._base = arrays[addresses.index(low)]
        self._offsets = np.array([(a - low) // item for a in addresses], dtype=np.int64)
        end = max(a + x.nbytes for a, x in zip(addresses, arrays, strict=True))
        self._span = (end - low) // item  # tokens from the lowest map to the end of the highest
        self._num_stores = np.uint64(len(self.stores))
        self._rows: dict[int, np.ndarray] = {}
        self._limits: dict[int, np.ndarray] = {}
        # One flag per chunk of a checked store; a store that is not checked (no checksums,
        # or verify=False) has one flag, always set, and a chunk longer than any store.
        flags = [st._checked_np if st.verifies else np.ones(1, dtype=np.bool_) for st in stores]
        self._flag_starts = np.cumsum([0] + [f.size for f in flags]).tolist()
        self._flag_base = np.array(self._flag_starts[:-1], dtype=np.int64)
        self._chunk_tokens = np.array(
            [st.chunk_tokens if st.verifies else 1 << 62 for st in stores], dtype=np.int64
        )
        self._flags = np.concatenate(flags)  # a copy: set here only after the store checked
        self._unchecked = int(self._flags.size - np.count_nonzero(self._flags))
        self._lock = threading.Lock()

    def windows(self, sources: Any, ids: Any, seq_len: int) -> np.ndarray:
        """``sources`` and ``ids``: integer arrays (or lists) of equal length."""
        src = np.asarray(sources, dtype=np.int64).ravel()
        idv = np.asarray(ids, dtype=np.int64).ravel()
        if src.shape != idv.shape:
            raise ValueError(f"{src.size} sources for {idv.size} sample ids; give one each.")
        limits = self._limits.get(seq_len)
        if limits is None:
            counts = [st.num_samples(seq_len) for st in self.stores]
            limits = self._limits[seq_len] = np.array(counts, dtype=np.uint64)
        if not src.size:
            return np.empty((0, seq_len + 1), dtype=self.dtype)
        # Bounds first (the class invariant). As unsigned, a negative value is huge, so one
        # comparison each tests 0 <= source < stores and 0 <= id < num_samples;
        # count_nonzero is the cheapest reduction on a window's few rows.
        if np.count_nonzero(src.view(np.uint64) >= self._num_stores):
            lo, hi = int(src.min()), int(src.max())
            raise IndexError(
                f"sample keys name sources in [{lo}, {hi}], the mixture has "
                f"{len(self.stores)} sources."
            )
        if np.count_nonzero(idv.view(np.uint64) >= limits[src]):
            k = int(np.argmax(idv.view(np.uint64) >= limits[src]))
            i = int(src[k])
            raise IndexError(
                f"sample id {int(idv[k])} outside [0, {int(limits[i])}) for seq_len {seq_len} "
                f"in {str(self.stores[i].path)!r}."
            )
        if self._unchecked:  # 0 once every chunk of every store was checked (or checks off)
            self._check(src, idv * seq_len, seq_len)
        rows = self._rows.get(seq_len)
        if rows is None:
            item = self.dtype.itemsize
            rows = self._rows[seq_len] = as_strided(
                self._base,
                shape=(max(self._span - seq_len, 0), seq_len + 1),
                strides=(item, item),
                writeable=False,
            )
        # Every row lies inside one store's map: checked above (the class invariant).
        return rows[self._offsets[src] + idv * seq_len]

    def _check(self, src: np.ndarray, starts: np.ndarray, seq_len: int) -> None:
        """Hash every unchecked chunk these windows touch, before any is served."""
        chunk = self._chunk_tokens[src]
        first = starts // chunk
        last = (starts + seq_len) // chunk  # the chunk of the label token
        base = self._flag_base[src]
        reach = int((last - first).max())
        if reach <= 1:
            need = np.concatenate([base + first, base + last])
        else:  # windows longer than a chunk
            grid = first[:, None] + np.arange(reach + 1)
            need = (base[:, None] + grid)[grid <= last[:, None]]
        missing = need[~self._flags[need]]
        if not missing.size:
            return
        starts_of = self._flag_starts
        for flag in np.unique(missing).tolist():
            i = bisect.bisect_right(starts_of, flag) - 1
            st, c = self.stores[i], flag - starts_of[i]
            if not st._checked[c]:  # a read through the store itself may have checked it
                st._verify_chunk(c)  # StoreError naming the store and the chunk
            with self._lock:
                if not self._flags[flag]:
                    self._flags[flag] = True
                    self._unchecked -= 1
