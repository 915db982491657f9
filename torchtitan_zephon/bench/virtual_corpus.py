"""A virtual corpus: every byte of a sharded token store computed from its file's name
and the offset read, so a store of 10^13 tokens and 10^10 documents costs nothing to
hold (``zephon bench corpus`` serves it on loopback: ``bench.object_server``).

Role: ``VirtualCorpus`` is a store (format 2, one ``manifest.json``, ``shards.json`` and
shards of ``shard_bytes``, ``doc_offsets.bin``, ``checksums.bin``, ``blocks.json`` and
``blocks.bin``, and for each of ``pack_seq_lens`` the packing index kept with it,
``packing/best_fit-L<L>-v1/``, its pieces' spans included) as objects: ``names()``, ``size(name)`` and
``read(name, start, stop)``. The corpus:

- Document lengths (each with its EOS) repeat with a period of ``CHUNK_DOCUMENTS``
  (65,536: what packing packs on its own), one period drawn once from the heavy-tailed
  distribution of ``zephon bench packing`` (a Pareto tail) with a fixed seed, scaled to
  a mean of ``mean_tokens`` (1,000; small test corpora ask for fewer); the store holds
  ``chunks`` periods. So document ``i``'s offset is closed-form, and the packing index
  is one period's index (``order.packing.pack_chunk``) repeated, its document numbers
  and piece offsets shifted by the period: what ``order.packing.pack`` gives for these
  lengths, chunk by chunk.
- Token ``t`` is the tokenizer's EOS where a document ends, else a hash of ``t`` into
  the vocabulary (never the EOS id); token 0 is the largest id, so the content
  section's ``max_token_id`` is ``vocab_size - 1`` without a scan.
- Checksums (chunks of ``CHUNK_TOKENS``, blocks of ``block_tokens`` seeded by the
  fingerprint) are those of these tokens, computed for the range read.

Invariant: with ``computed`` (a corpus small enough to pass over), every file is byte
for byte what Zephon's own writers write for these tokens and documents
(``store.writer.write_derived_store``, then block checksums, the store cut into shards
and the packing index kept beside it: tests/remote/test_virtual_corpus.py), so the
fingerprint is too. Without it, the only fields not computed are the hashes of whole
files (the content section's ``checksums_xxh3_128`` and ``doc_offsets_xxh3_128``,
blocks.json's ``blocks_xxh3_128``, the packing manifests' ``starts_xxh3_128``,
``pieces_xxh3_128`` and ``spans_xxh3_128``) and the source record's sha256: a pass over 40 TB. They hold
``NOT_COMPUTED``; only ``zephon inspect --check`` reads them, never opening a store,
training or the bench. Every other byte is what a real store of these tokens holds.
"""

from __future__ import annotations

import hashlib
import io
import json
from functools import cached_property
from typing import Any

import numpy as np
import xxhash

from torchtitan_zephon.bench.packing import heavy_tailed
from torchtitan_zephon.job.packing import (
    PIECES,
    SPANS,
    STARTS,
    STORE_PACKING,
    index_manifest,
    index_name,
)
from torchtitan_zephon.order.packing import CHUNK_DOCUMENTS, pack_chunk
from torchtitan_zephon.store.format import (
    BLOCKS,
    BLOCKS_INFO,
    CHECKSUMS,
    CHUNK_TOKENS,
    DOC_OFFSETS,
    DTYPES,
    MANIFEST,
    SHARDS,
    block_checksums,
    block_fields,
    block_seed,
    content_checksums,
    content_fields,
    manifest_fingerprint,
    num_blocks,
    num_chunks,
)
from torchtitan_zephon.store.shards import SHARD_BYTES, shard_counts, shard_name, shard_section
from torchtitan_zephon.store.writer import derived_manifest

NOT_COMPUTED = "not computed: a virtual corpus (zephon bench corpus)"
"""What the fields that hash a whole file hold when the corpus is too large to pass over."""
VOCAB_SIZE = 128_256
"""Llama 3's vocabulary: tokens are uint32."""
EOS_ID = 128_001
"""Llama 3's ``<|end_of_text|>``."""
TOKENIZER = {
    "tokenizer": {
        "eos_token": "<|end_of_text|>",
        "sha256": hashlib.sha256(b"zephon bench corpus: Llama 3 vocabulary").hexdigest(),
        "vocab_size": VOCAB_SIZE,
    },
    "dtype": "uint32",
    "eos_id": EOS_ID,
}
"""What the store's manifest says of its tokenizer (no tokenizer file: nothing is
tokenized; the vocabulary is Llama 3's size, so tokens are uint32)."""
SEED = 45
LARGE = 152_588
"""Periods of the bench's virtual corpus: 10,000,007,168 documents, about 10^13 tokens."""
_MIX = np.uint64(0x9E3779B97F4A7C15)
_BATCH = 1 << 24
"""Tokens generated at once when a read spans more."""
_SPAN_ROWS = 1 << 12
"""Pieces whose spans are hashed from one run of computed tokens."""


class VirtualCorpus:
    """A store whose bytes are computed (see the module docstring)."""

    def __init__(
        self,
        chunks: int = LARGE,
        *,
        mean_tokens: int = 1000,
        block_tokens: int = 512,
        shard_bytes: int = SHARD_BYTES,
        pack_seq_lens: tuple[int, ...] = (),
        computed: bool = False,
    ) -> None:
        if chunks < 1 or mean_tokens < 2:
            raise ValueError(
                f"chunks must be >= 1 and mean_tokens >= 2, got {chunks} and {mean_tokens}."
            )
        self.chunks, self.mean_tokens = int(chunks), int(mean_tokens)
        self.block_tokens, self.pack_seq_lens = int(block_tokens), tuple(pack_seq_lens)
        self.computed = bool(computed)
        self.dtype = DTYPES["uint32"]
        drawn = heavy_tailed(CHUNK_DOCUMENTS, SEED)
        scaled = np.rint(drawn * (self.mean_tokens * CHUNK_DOCUMENTS / drawn.sum()))
        self.lengths = np.maximum(2, scaled).astype(np.int64)
        self.period_tokens = int(self.lengths.sum())
        self.period_starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        self.period_ends = self.period_starts + self.lengths - 1  # each document's EOS
        self.num_documents = self.chunks * CHUNK_DOCUMENTS
        self.num_tokens = self.chunks * self.period_tokens
        self.shard_tokens = max(1, int(shard_bytes) // self.dtype.itemsize)
        self.counts = shard_counts(self.num_tokens, self.shard_tokens)

    # ------------------------------------------------------------------ tokens

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` (uint32)."""
        start, stop = max(0, int(start)), min(int(stop), self.num_tokens)
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        if stop - start > _BATCH:
            return np.concatenate(
                [self.tokens(a, min(a + _BATCH, stop)) for a in range(start, stop, _BATCH)]
            )
        t = np.arange(start, stop, dtype=np.uint64)
        v = ((t * _MIX) >> np.uint64(32)) % np.uint64(VOCAB_SIZE - 1)
        out = v.astype(np.int64)
        out += out >= EOS_ID  # never the EOS id
        if start == 0:
            out[0] = VOCAB_SIZE - 1
        for c in range(start // self.period_tokens, (stop - 1) // self.period_tokens + 1):
            base = c * self.period_tokens
            ends = self.period_ends
            lo = np.searchsorted(ends, start - base)
            hi = np.searchsorted(ends, stop - base)
            out[ends[lo:hi] + base - start] = EOS_ID
        return out.astype(self.dtype)

    def offsets(self, first: int, stop: int) -> np.ndarray:
        """Start offsets (int64) of documents ``[first, stop)``."""
        i = np.arange(max(0, first), min(stop, self.num_documents), dtype=np.int64)
        c, k = np.divmod(i, CHUNK_DOCUMENTS)
        return c * self.period_tokens + self.period_starts[k]

    # ------------------------------------------------------------------ packing

    @cached_property
    def _period_packing(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Per packed seq_len: one period's (starts within the period, piece rows)."""
        out = {}
        for seq_len in self.pack_seq_lens:
            sizes, rows = pack_chunk(self.lengths, 0, seq_len)
            starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            out[seq_len] = (starts, rows.astype(np.int64))
        return out

    def _starts(self, seq_len: int, first: int, stop: int) -> np.ndarray:
        starts, rows = self._period_packing[seq_len]
        per = starts.size - 1
        i = np.arange(first, min(stop, self.chunks * per + 1), dtype=np.int64)
        c, j = np.divmod(i, per)
        return c * rows.shape[0] + starts[j]

    def _spans(self, seq_len: int, first: int, stop: int) -> np.ndarray:
        """Rows ``[first, stop)`` of spans.npy (``job.packing.piece_spans``): each
        piece's first token (x2, +1 when it reads one more), its length and the xxh3-64 of
        what it reads, hashed from the tokens computed for a few thousand pieces at a time."""
        seed = block_seed(self.fingerprint)
        out = []
        for a in range(first, stop, _SPAN_ROWS):
            piece = self._pieces(seq_len, a, min(stop, a + _SPAN_ROWS))
            c, j = np.divmod(piece[:, 0], CHUNK_DOCUMENTS)
            begin = c * self.period_tokens + self.period_starts[j] + piece[:, 1]
            extra = (piece[:, 1] + piece[:, 2] < self.lengths[j]).astype(np.int64)
            take = piece[:, 2] + extra
            if not begin.size:
                continue
            lo = int(begin.min())
            tokens = self.tokens(lo, int((begin + take).max()))
            sums = [
                xxhash.xxh3_64_intdigest(tokens[b - lo : b - lo + t], seed)
                for b, t in zip(begin.tolist(), take.tolist(), strict=True)
            ]
            rows = np.empty((begin.size, 3), dtype=np.int64)
            rows[:, 0] = begin * 2 + extra
            rows[:, 1] = piece[:, 2]
            rows[:, 2] = np.array(sums, dtype=np.uint64).view(np.int64)
            out.append(rows)
        return np.concatenate(out) if out else np.zeros((0, 3), dtype=np.int64)

    def _pieces(self, seq_len: int, first: int, stop: int) -> np.ndarray:
        _, rows = self._period_packing[seq_len]
        q = rows.shape[0]
        k = np.arange(first, min(stop, self.chunks * q), dtype=np.int64)
        c, j = np.divmod(k, q)
        out = rows[j].copy()
        out[:, 0] += c * CHUNK_DOCUMENTS
        return out

    class _Counts:
        def __init__(self, corpus: VirtualCorpus, seq_len: int) -> None:
            starts, rows = corpus._period_packing[seq_len]
            n = corpus.chunks
            self.seq_len = seq_len
            self.num_samples = n * (starts.size - 1)
            self.num_pieces = n * rows.shape[0]
            self._tokens = n * int(rows[:, 2].sum())
            self._split = n * int(np.count_nonzero(rows[:, 1] == seq_len))

        def tokens(self) -> int:
            return self._tokens

        def padding_fraction(self) -> float:
            total = self.num_samples * self.seq_len
            return (total - self._tokens) / total if total else 0.0

        def split_documents(self) -> int:
            return self._split

    # ------------------------------------------------------------------ files

    def _npy_header(self, shape: tuple[int, ...]) -> bytes:
        f = io.BytesIO()
        d = {"descr": "<i8", "fortran_order": False, "shape": shape}
        np.lib.format.write_array_header_1_0(f, d)
        return f.getvalue()

    @cached_property
    def _files(self) -> dict[str, tuple[int, Any]]:
        """name -> (size, read(start, stop) -> bytes) of every file."""
        files: dict[str, tuple[int, Any]] = {}

        def array(count: int, item: int, values: Any, header: bytes = b"") -> tuple[int, Any]:
            def read(a: int, b: int) -> bytes:
                h = header[a:b]
                a, b = max(a, len(header)) - len(header), b - len(header)
                if b <= a:
                    return h
                first, stop = a // item, -(-b // item)
                data = np.ascontiguousarray(values(first, stop)).tobytes()
                return h + data[a - first * item : b - first * item]

            return len(header) + count * item, read

        itemsize = self.dtype.itemsize
        for k, count in enumerate(self.counts):
            base = k * self.shard_tokens
            files[shard_name(k)] = array(
                count, itemsize, lambda a, b, base=base: self.tokens(base + a, base + b)
            )
        files[DOC_OFFSETS] = array(self.num_documents, 8, self.offsets)
        n_chunks = num_chunks(self.num_tokens, CHUNK_TOKENS)
        files[CHECKSUMS] = array(n_chunks, 8, self._chunk_sums)
        n_blocks = num_blocks(self.num_tokens, self.block_tokens)
        files[BLOCKS] = array(n_blocks, 8, self._block_sums)
        for seq_len in self.pack_seq_lens:
            counts = self._Counts(self, seq_len)
            folder = f"{STORE_PACKING}/{index_name(seq_len)}"
            n = counts.num_samples + 1
            files[f"{folder}/{STARTS}"] = array(
                n, 8, lambda a, b, s=seq_len: self._starts(s, a, b), self._npy_header((n,))
            )
            q = counts.num_pieces
            files[f"{folder}/{PIECES}"] = array(
                q, 24, lambda a, b, s=seq_len: self._pieces(s, a, b), self._npy_header((q, 3))
            )
            files[f"{folder}/{SPANS}"] = array(
                q, 24, lambda a, b, s=seq_len: self._spans(s, a, b), self._npy_header((q, 3))
            )
        # The small JSON files, last: their hashes are of the files above.
        files[SHARDS] = self._text(
            json.dumps(shard_section(self.fingerprint, self.counts), indent=1)
        )
        files[BLOCKS_INFO] = self._text(
            json.dumps(self._block_info(files), indent=2, sort_keys=True)
        )
        for seq_len in self.pack_seq_lens:
            folder = f"{STORE_PACKING}/{index_name(seq_len)}"
            hashes = (
                self._hash(files, f"{folder}/{STARTS}"),
                self._hash(files, f"{folder}/{PIECES}"),
                self._hash(files, f"{folder}/{SPANS}"),
            )
            info = index_manifest(
                self.fingerprint, self.num_documents, self._Counts(self, seq_len), hashes
            )
            files[f"{folder}/{MANIFEST}"] = self._text(json.dumps(info, indent=1, sort_keys=True))
        files[MANIFEST] = self._text(json.dumps(self.manifest, indent=2, sort_keys=True))
        return files

    @staticmethod
    def _text(text: str) -> tuple[int, Any]:
        data = (text + "\n").encode()
        return len(data), lambda a, b: data[a:b]

    def _hash(self, files: dict[str, tuple[int, Any]], name: str) -> str:
        """The xxh3-128 of the whole file ``name`` (``NOT_COMPUTED`` unless computed)."""
        if not self.computed:
            return NOT_COMPUTED
        size, read = files[name]
        h = xxhash.xxh3_128()
        for a in range(0, size, 1 << 26):
            h.update(read(a, min(size, a + (1 << 26))))
        return h.hexdigest()

    def _chunk_sums(self, first: int, stop: int) -> np.ndarray:
        step = max(1, _BATCH // CHUNK_TOKENS)  # chunks a batch of tokens at a time
        sums = [
            content_checksums(
                self.tokens(c * CHUNK_TOKENS, min((c + step) * CHUNK_TOKENS, self.num_tokens)),
                CHUNK_TOKENS,
            )[0]
            for c in range(first, min(stop, num_chunks(self.num_tokens, CHUNK_TOKENS)), step)
        ]
        return np.concatenate(sums) if sums else np.zeros(0, dtype="<u8")

    def _block_sums(self, first: int, stop: int) -> np.ndarray:
        bt, seed = self.block_tokens, block_seed(self.fingerprint)
        step = max(1, _BATCH // bt)  # blocks a batch of tokens at a time
        last = min(stop, num_blocks(self.num_tokens, bt))
        sums = [
            block_checksums(
                self.tokens(b * bt, min(min(b + step, last) * bt + 1, self.num_tokens)), seed, bt
            )
            for b in range(first, last, step)
        ]
        return np.concatenate(sums) if sums else np.zeros(0, dtype="<u8")

    def _block_info(self, files: dict[str, tuple[int, Any]]) -> dict[str, Any]:
        blocks_hash = self._hash(files, BLOCKS)
        return block_fields(self.fingerprint, self.num_tokens, self.block_tokens, blocks_hash)

    @cached_property
    def manifest(self) -> dict[str, Any]:
        """The store's manifest, fingerprint included."""
        tokens_file = {
            DOC_OFFSETS: (self.num_documents * 8, lambda a, b: self._bytes(DOC_OFFSETS, a, b)),
        }
        source: dict[str, Any] = {
            "name": self.describe(),
            "kind": "bench",
            "sha256": NOT_COMPUTED,
            "size": self.num_tokens * self.dtype.itemsize,
        }
        if self.computed:
            h = hashlib.sha256()
            for a in range(0, self.num_tokens, _BATCH):
                h.update(self.tokens(a, a + _BATCH).tobytes())
            source["sha256"] = h.hexdigest()
        checksums = (
            num_chunks(self.num_tokens, CHUNK_TOKENS) * 8,
            lambda a, b: self._bytes(CHECKSUMS, a, b),
        )
        hashes = {DOC_OFFSETS: tokens_file[DOC_OFFSETS], CHECKSUMS: checksums}
        manifest = derived_manifest(TOKENIZER, self.num_tokens, self.num_documents, source)
        content_hashes = (self._hash(hashes, CHECKSUMS), self._hash(hashes, DOC_OFFSETS))
        manifest["content"] = content_fields(VOCAB_SIZE - 1, CHUNK_TOKENS, content_hashes)
        manifest["fingerprint"] = manifest_fingerprint(manifest)
        return manifest

    def _bytes(self, name: str, a: int, b: int) -> bytes:
        """Bytes of the files the manifest hashes (before ``_files`` exists)."""
        if name == DOC_OFFSETS:
            first, stop = a // 8, -(-b // 8)
            return self.offsets(first, stop).tobytes()[a - first * 8 : b - first * 8]
        first, stop = a // 8, -(-b // 8)
        return self._chunk_sums(first, stop).tobytes()[a - first * 8 : b - first * 8]

    @property
    def fingerprint(self) -> str:
        return str(self.manifest["fingerprint"])

    def describe(self) -> str:
        return (
            f"virtual corpus: {self.chunks} x {CHUNK_DOCUMENTS} documents of heavy-tailed "
            f"lengths (seed {SEED}, mean {self.mean_tokens} tokens)"
        )

    # ------------------------------------------------------------------ as objects

    def names(self) -> list[str]:
        return list(self._files)

    def size(self, name: str) -> int | None:
        """The file's size in bytes (None: the store has no such file)."""
        entry = self._files.get(name)
        return None if entry is None else entry[0]

    def read(self, name: str, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of the file ``name`` (KeyError: no such file)."""
        size, read = self._files[name]
        return bytes(read(max(0, start), min(stop, size)))
