"""The token store reader: a prepared corpus, memory-mapped read-only.

Role: give O(1) access to training samples. Sample ``i`` for a given
``seq_len`` is the window ``tokens[i*seq_len : i*seq_len + seq_len + 1]``
(inputs = window[:-1], labels = window[1:]). The files and the manifest are
``format``'s; what opening a store checks is ``opening``'s.

Invariants:
- A store that opens is complete and its manifest unmodified: every file has
  the size its manifest promises, the manifest hashes to its recorded
  ``fingerprint`` and checksums.bin hashes to the value the manifest records
  (``opening``). Opening reads no tokens.
- Every token that ``window``/``windows`` return was checked against the
  content checksums first: tokens.bin is cut into chunks of ``chunk_tokens``
  tokens, each with an xxh3-64 checksum in checksums.bin; a TokenStore hashes a
  chunk the first time it reads from it (once per object, thread-safe) and a
  mismatch is a StoreError naming the store, the file and the chunk, so no
  sample is served from changed content. ``tokens`` itself is the raw map.
- ``max_token_id`` (recorded by prepare) bounds every id the checked reads can
  return, so a vocabulary check against it is exact.

Chunks of 65,536 tokens suit random sample access: hashing one takes ~10-20
microseconds, so the first read of a chunk (128-256 KB) costs little and
an epoch hashes the store once; checksums.bin (8 bytes per chunk,
120 MB for 10^12 tokens) is hashed whole at open. Once every chunk is checked a
read costs nothing more; before that, a read wholly below the lowest unchecked
chunk or above the highest (say, all but held-out samples at the end) costs one
comparison, any other looks up each sample's chunks.

Version-1 stores (written before checksums) still open, with an
``UncheckedStoreWarning``, and their reads are not checked. ``migrate.old_stores.upgrade_store``
(``zephon inspect STORE --upgrade``) adds checksums.bin and content.json (the
content section) beside the unchanged manifest, so the fingerprint, and every
checkpoint and sequence log that names it, stays valid (older zephon versions
still open the store); the checksums then vouch for the content as it was at
the upgrade. ``migrate.old_stores.add_block_checksums`` (also ``--upgrade``) adds the finer
block checksums (``format``) that reads from object storage check; a local store's
reads keep checking whole chunks and never open them. ``TokenStore.check`` (``zephon
inspect STORE --check``) hashes everything and reports each bad chunk (and block). The checksums catch corruption and
edits, not a forger who also rewrites checksums.bin and the manifest.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from numpy.lib.stride_tricks import as_strided

from torchtitan_zephon.store.format import (
    BLOCKS,
    BLOCKS_INFO,
    CHECKSUMS,
    CHUNK_TOKENS,
    DOC_OFFSETS,
    DTYPES,
    REPREPARE,
    SHARDS,
    TOKENS,
    ContentReport,
    StoreError,
    UncheckedStoreWarning,
    block_checksums,
    block_seed,
    block_span,
    content_checksums,
    file_xxh3_128,
    map_file,
)
from torchtitan_zephon.store.opening import (
    map_checksums,
    open_manifest,
    read_blocks_info,
    read_content,
)
from torchtitan_zephon.store.shards import ShardedTokens, open_shards, read_shards
from torchtitan_zephon.store.urls import is_url, parse_url, refuse_mistyped_url


class TokenStore:
    """A validated, memory-mapped token store. Build one with ``TokenStore.open``."""

    # Opens object-storage URLs: the subclass declared reads_object_urls (store/__init__).
    _object_url_class: type[TokenStore] | None = None

    def __init_subclass__(cls, *, reads_object_urls: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if reads_object_urls:
            TokenStore._object_url_class = cls

    def __init__(
        self,
        path: Path | str,
        manifest: dict[str, Any],
        tokens: np.ndarray | ShardedTokens | None,
        doc_offsets: np.ndarray | None,
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
        self.dtype = np.dtype(DTYPES[manifest["dtype"]])
        self.mapped = tokens is not None  # False: read by range (``remote.RemoteTokenStore``)
        self.shards = len(tokens.arrays) if isinstance(tokens, ShardedTokens) else 0
        """Shard files holding the tokens (``store.shards``; 0: one tokens.bin)."""
        self.content = content  # the content section (manifest, or content.json for version 1)
        self.checksums = checksums
        # Plain ndarray views of the same maps: slicing them is cheaper than slicing a memmap.
        self._token_array = (
            tokens if not isinstance(tokens, np.ndarray) else tokens.view(np.ndarray)
        )
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
    def open(
        cls, path: str | os.PathLike, *, verify: bool = True, remote: Any = None
    ) -> TokenStore:
        """Open and validate the store at ``path``; raise StoreError if it is not usable.

        Cheap: reads the manifest and checksums.bin, maps the rest. With ``verify``
        (the default) every read checks the chunks it touches (see the module
        docstring); ``verify=False`` serves unchecked tokens (benchmarks only).
        ``path`` may be an object-storage URL (``s3://``, ``gs://``, ``az://``: a
        ``remote.RemoteTokenStore``, read by range with ``remote``, a
        ``remote.RemoteOptions``) or a ``file://`` URL (a local folder).
        """
        refuse_mistyped_url(path, "the store")
        if is_url(path):
            found = parse_url(str(path))
            if not isinstance(found, str):
                opener: Any = TokenStore._object_url_class
                return opener.open_url(found, verify=verify, options=remote)
            path = found
        root = Path(path)
        manifest = open_manifest(root)
        num_tokens = int(manifest["num_tokens"])
        shards = read_shards(root, manifest)
        if shards is None:
            tokens: np.ndarray | ShardedTokens = map_file(
                root / TOKENS, DTYPES[manifest["dtype"]], num_tokens
            )
        elif (root / TOKENS).exists():
            raise StoreError(
                f"token store {str(root)!r} holds both {TOKENS} and {SHARDS}: its tokens "
                f"are one or the other. Remove the one a copy left behind. {REPREPARE}"
            )
        else:
            tokens = open_shards(root, shards, DTYPES[manifest["dtype"]])
        doc_offsets = map_file(root / DOC_OFFSETS, np.dtype("<i8"), int(manifest["num_documents"]))
        content, where = read_content(root, manifest)
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
            checksums = map_checksums(root, content, where, num_tokens)
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
        if self.shards:
            return self.tokens.rows(ids * seq_len, seq_len + 1)
        return self._sample_view(seq_len, n)[ids]

    @property
    def token_array(self) -> np.ndarray | ShardedTokens | None:
        """The tokens as the cheapest array to slice (None: read by range): a plain view
        of the one map, or the shards (``shards.ShardedTokens``), unchecked."""
        return self._token_array

    def token_rows(self, starts: np.ndarray, width: int) -> np.ndarray:
        """Rows ``[len(starts), width]`` of tokens from ``starts`` (any token index, each
        row within the store), unchecked: the caller checks their chunks (packed samples,
        ``job.packed``). A local store only."""
        starts = np.asarray(starts, dtype=np.int64).ravel()
        if self.shards:
            return self.tokens.rows(starts, width)
        view = self._views.get(-width)  # keyed apart from the sample views
        if view is None:
            item = self.tokens.dtype.itemsize
            rows = max(self.num_tokens - width + 1, 0)
            view = as_strided(
                self.tokens, shape=(rows, width), strides=(item, item), writeable=False
            )
            self._views[-width] = view
        if not view.shape[0]:
            return np.empty((starts.size, width), self.dtype)
        return view[starts]

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
            raise self.chunk_mismatch(chunk)
        self._mark_checked(chunk)

    def chunk_mismatch(self, chunk: int) -> StoreError:
        """The error for chunk ``chunk`` of tokens.bin not matching its checksum."""
        start, stop = self._chunk_range(chunk)
        return StoreError(
            f"token store {str(self.path)!r}: chunk {chunk} of {TOKENS} (tokens "
            f"[{start}, {stop})) does not match its checksum in {CHECKSUMS}; the file was "
            "changed or corrupted after preparation. Run `zephon inspect "
            f"{self.path} --check` to list every bad chunk. {REPREPARE}"
        )

    def check_chunk(self, chunk: int) -> None:
        """Hash chunk ``chunk`` unless this store checked it already (StoreError naming the
        store and the chunk when it differs): what a reader across stores
        (``group.StoreGroup``) asks before serving rows from it."""
        if not self._checked[chunk]:
            self._verify_chunk(chunk)

    def checked_flags(self) -> np.ndarray:
        """One bool per chunk, True where this store checked it (a copy: flags only go
        from unchecked to checked, so a copy is at worst conservative)."""
        return self._checked_np.copy()

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
            maxima = content_checksums(self.all_tokens(), CHUNK_TOKENS)[1]
        else:
            sums, maxima = content_checksums(self.all_tokens(), self.chunk_tokens)
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
            found = self.doc_offsets_xxh3_128()
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
        report.problems.extend(self.structure_problems(report.max_token_id))
        report.problems.extend(self._block_problems())
        return report

    def _block_problems(self) -> list[str]:
        """What ``check`` finds wrong with the store's block checksums (none: it has none)."""
        try:
            info, sums = self.block_checksums()
        except StoreError as e:
            return [str(e)]
        if info is None:
            return []
        problems = []
        if xxhash.xxh3_128_hexdigest(sums) != info["blocks_xxh3_128"]:
            problems.append(f"{BLOCKS} does not match the xxh3-128 {BLOCKS_INFO} records")
        size = int(info["block_tokens"])
        found = block_checksums(self.all_tokens(), block_seed(self.fingerprint), size)
        bad = np.flatnonzero(found != sums).tolist()
        for block in bad[:10]:
            start, stop = block_span(block, self.num_tokens, size)
            problems.append(
                f"block {block} (tokens [{start}, {stop})) of {TOKENS} does not match its "
                f"checksum in {BLOCKS}"
            )
        if len(bad) > 10:
            problems.append(f"... and {len(bad) - 10} more blocks that do not match")
        return problems

    def block_checksums(self) -> tuple[dict[str, Any] | None, np.ndarray]:
        """(blocks.json, blocks.bin) of the store, checked as opening checks them, or
        (None, empty) when it has none (``check``: a local store's reads check chunks)."""
        info = read_blocks_info(Path(self.path), self.manifest)
        if info is None:
            return None, np.zeros(0, dtype="<u8")
        return info, np.fromfile(Path(self.path) / BLOCKS, dtype="<u8")

    def all_tokens(self) -> np.ndarray:
        """Every token, unchecked (``check``, ``structure_problems``): the map itself."""
        return self.tokens

    def doc_offsets_xxh3_128(self) -> str:
        """Hex xxh3-128 of doc_offsets.bin (``check``)."""
        return file_xxh3_128(Path(self.path) / DOC_OFFSETS)

    def structure_problems(self, max_token_id: int) -> list[str]:
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
            missing = int(np.count_nonzero(self.all_tokens()[ends] != self.eos_id))
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
            "size_bytes": self.num_tokens * self.dtype.itemsize
            + self.num_documents * 8
            + self.num_chunks * 8,
            "sources": m.get("sources", []),
            **({"shards": self.shards} if self.shards else {}),
        }
