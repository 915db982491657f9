"""A store read as packed samples (``zephon.packing = "best_fit"``): whole documents in
every sample, labels only where the next token is the same document's.

Role: ``PackedSource`` is a ``job.source.Source`` whose map from sample ids to rows is
the store's packing index (``job.packing``, ``order.packing``): the ids are packed
sample ids, ``windows(ids, seq_len)`` gives each sample's row of ``seq_len + 1`` tokens
(its pieces in order, then EOS as padding; after a piece that does not end its
document, the document's next token) and ``ignored(ids, seq_len)`` the inputs whose
label is not trained: a document's last token (its EOS: the next token is another
document's) and the padding. The loader sets those labels to TorchTitan's
``IGNORE_INDEX``, so the loss of a step is the mean over its labelled tokens. A piece
cut from a longer document trains every token, its last one too: that one's label is
the document's next token, the first of its next piece. ``labelled_tokens(ids)``
counts labels from the index alone.

Invariants:
- A row's inputs are exactly its pieces' tokens then padding; every labelled input's
  label is the next token of the same document (property-tested).
- Padding is EOS, so the per-document positions the loader adds (``job.documents``)
  restart at every document and the padding attends to itself alone: nothing trained
  crosses a document boundary.
- Every token read was checked against the store's chunk checksums first (a store in
  object storage: its block checksums, or the span checksums kept with the index).
"""

from __future__ import annotations

import threading

import numpy as np

from torchtitan_zephon.job.packed_remote import RemoteSpans
from torchtitan_zephon.job.source import Unlabelled
from torchtitan_zephon.job.vocab import store_id_limit, store_out_of_vocab
from torchtitan_zephon.order.packing import PackedSamples
from torchtitan_zephon.store.reader import TokenStore


class PackedSource:
    """A store read as its packed samples (``job.source.Source``)."""

    packing = "best_fit"

    def __init__(self, store: TokenStore, packed: PackedSamples) -> None:
        self.store = store
        self.packed = packed
        self.seq_len = int(packed.seq_len)
        self.available = int(packed.num_samples)
        # A local store's offsets: its map (no copy); a store in object storage: read by
        # page, only those looked up (``store.paged``), never the whole file.
        self._doc_offsets = (
            np.asarray(store.doc_offsets, dtype=np.int64) if store.mapped else store.paged_offsets()
        )
        # A local store: plain views of the maps (slicing them is cheaper than slicing a
        # memmap). One in object storage: its pieces read by range (``job.packed_remote``).
        self._remote = None if store.mapped else RemoteSpans(store)
        self._tokens = store.token_array
        self._padding: dict[int, np.ndarray] = {}
        # Maps (as plain views: cheaper to index), or arrays read by page (``store.paged``).
        self._starts, self._pieces = (
            np.asarray(a) if isinstance(a, np.ndarray) else a
            for a in (packed.starts, packed.pieces)
        )
        # Kept with a store's own index (``job.packing.piece_spans``): a store in object
        # storage reads each piece exactly by its span, checked by the span's own sum,
        # and looks up no document offset.
        self._kept_spans = None if store.mapped else packed.spans
        # The read plans of samples read ahead, each used once by its read (``_spans``).
        self._plans: dict[int, _Plan] = {}
        self._plans_lock = threading.Lock()
        # Nothing here is built per document or per sample: what a read needs of the
        # index, the document offsets and lengths is looked up for its samples alone.

    def __repr__(self) -> str:
        return f"PackedSource({self.store!r}, seq_len={self.seq_len})"

    def _lengths(self, docs: np.ndarray) -> np.ndarray:
        """Tokens of documents ``docs`` (each with its EOS), from their offsets."""
        docs = np.asarray(docs, dtype=np.int64)
        offsets, last = self._doc_offsets, self._doc_offsets.size - 1
        ends = np.where(
            docs < last, offsets[np.minimum(docs + 1, last)], np.int64(self.store.num_tokens)
        )
        return ends - offsets[docs]

    def _windows_at(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For packed samples ``keys``: where each starts in the store when it is one
        seq_len piece of a longer document (a plain window there, every label trained;
        0 for the others: a row of the gather that is written over), and whether it is."""
        first = self._pieces[self._starts[keys]]
        window = (self._starts[keys + 1] - self._starts[keys] == 1) & (first[:, 2] == self.seq_len)
        window &= first[:, 1] + self.seq_len < self._lengths(first[:, 0])
        return np.where(window, self._doc_offsets[first[:, 0]] + first[:, 1], 0), window

    def _bounds(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Samples ``keys``' pieces: (row of each piece, its index in the packing index),
        in row order (one lookup of ``starts``: a sample's two bounds are neighbours)."""
        keys = np.asarray(keys, dtype=np.int64).ravel()
        if keys.size and (int(keys.min()) < 0 or int(keys.max()) >= self.packed.num_samples):
            raise IndexError(
                f"packed sample ids must lie in [0, {self.packed.num_samples}), found "
                f"[{int(keys.min())}, {int(keys.max())}]."
            )
        bounds = np.asarray(self.packed.starts[np.stack([keys, keys + 1], axis=1)])
        bounds = bounds.reshape(-1, 2)
        counts = bounds[:, 1] - bounds[:, 0]
        first = np.repeat(bounds[:, 0], counts) + _ranks_within(counts)
        return np.repeat(np.arange(keys.size, dtype=np.int64), counts), first

    def _pieces_of(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Pieces of samples ``keys``: (row of each piece, its index in the packing
        index, its (document, start, length) row), in row order."""
        rows, first = self._bounds(keys)
        return rows, first, np.asarray(self.packed.pieces[first]).reshape(-1, 3)

    def _rows(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Pieces of samples ``keys``: (row of each piece, its first token in the store,
        its length, in row order)."""
        rows, _, piece = self._pieces_of(keys)
        return rows, self._doc_offsets[piece[:, 0]] + piece[:, 1], piece

    def _read_plan(self, keys: np.ndarray) -> _Plan:
        """What reading samples ``keys`` takes (``_Plan``): from the spans kept with the
        index when there are (two lookups: ``starts`` and ``spans``, no document offset),
        else from the pieces and the document offsets. The plan a read-ahead made for a
        sample is used once by its read (no lookup twice)."""
        keys = np.asarray(keys, dtype=np.int64).ravel()
        with self._plans_lock:
            held = [self._plans.pop(k, None) for k in keys.tolist()]
        if keys.size and all(p is not None for p in held):
            return _Plan.join(held)  # type: ignore[arg-type]
        if self._kept_spans is None:
            rows, begin, piece = self._rows(keys)
            return _Plan(rows, begin, piece[:, 2], self._ends_doc(piece), None)
        rows, first = self._bounds(keys)
        spans = np.asarray(self._kept_spans[first]).reshape(-1, 3)
        return _Plan(rows, spans[:, 0] >> 1, spans[:, 1], (spans[:, 0] & 1) == 0, spans[:, 2])

    def windows(self, keys: np.ndarray, seq_len: int) -> np.ndarray:
        """Rows [len(keys), seq_len + 1] in the store dtype: each sample's pieces, then
        EOS padding; after a piece that does not end its document, that document's next
        token (the label of the piece's last token)."""
        if self._remote is not None:
            self._remote.wait_for(keys)  # their step's read-ahead, if it is on its way
            return self._windows_of(np.size(keys), self._read_plan(keys), seq_len)
        rows, begin, piece = self._rows(keys)
        plan = _Plan(rows, begin, piece[:, 2], self._ends_doc(piece), None)
        return self._windows_of(np.size(keys), plan, seq_len)

    def _windows_of(self, n: int, plan: _Plan, seq_len: int) -> np.ndarray:
        """``windows`` of ``n`` samples from their read plan."""
        take = plan.take()
        tokens = self._read(plan.begin, take, plan.sums)
        out = np.full((n, seq_len + 1), self.store.eos_id, dtype=self.store.dtype)
        col = _ranks_within_rows(plan.rows, take, plan.length)
        out[np.repeat(plan.rows, take), col] = tokens
        return out

    def _ends_doc(self, piece: np.ndarray) -> np.ndarray:
        """Whether each piece ends its document (two offset lookups a piece)."""
        return piece[:, 1] + piece[:, 2] == self._lengths(piece[:, 0])

    def unlabelled(self, keys: np.ndarray, seq_len: int) -> Unlabelled | None:
        """``rows``' inputs of samples ``keys`` that train no label, from the
        index alone (no token is read): each document's last token, then the padding of
        each row that has some (None: every label trained)."""
        rows, _, piece = self._rows(keys)
        plan = _Plan(rows, piece[:, 0], piece[:, 2], self._ends_doc(piece), None)
        return self._unlabelled_of(np.size(keys), plan, seq_len)

    def _unlabelled_of(self, n: int, plan: _Plan, seq_len: int) -> Unlabelled | None:
        """``unlabelled`` of ``n`` samples from their read plan."""
        rows, length, ends_doc = plan.rows, plan.length, plan.ends
        last = rows * seq_len + _piece_offsets(rows, length) + length - 1
        used = np.bincount(rows, weights=length, minlength=n).astype(np.int64)
        padded = np.flatnonzero(used < seq_len)
        if not ends_doc.any() and not padded.size:
            return None
        return last[ends_doc].tolist(), padded.tolist(), used[padded].tolist()

    def ignored(self, keys: np.ndarray, seq_len: int) -> np.ndarray:
        """bool [len(keys), seq_len]: the inputs whose label is not trained (a document's
        last token, the padding)."""
        rows, _, piece = self._rows(keys)
        length = piece[:, 2]
        ends_doc = piece[:, 1] + length == self._lengths(piece[:, 0])
        out = np.ones((np.size(keys), seq_len), dtype=bool)
        col = _ranks_within_rows(rows, length, length)
        out[np.repeat(rows, length), col] = False
        last = col.reshape(-1)[np.cumsum(length) - 1]  # each piece's last input column
        out[rows[ends_doc], last[ends_doc]] = True
        return out

    def rows(self, keys: np.ndarray, seq_len: int) -> tuple[np.ndarray, Unlabelled | None]:
        """``windows`` of samples ``keys`` and their inputs that train no label, in one
        pass: the loader's path (the vectorized ``windows`` and ``ignored`` are its
        reference). A sample that is one seq_len piece of a longer document (most, where
        documents are long) is a window at its first token, every label trained: one
        gather for all of them. The others are whole documents then padding, one copy
        per piece; what they leave untrained comes back as ``Unlabelled`` (None: every
        sample a window)."""
        keys = np.asarray(keys, dtype=np.int64).ravel()
        if seq_len != self.packed.seq_len:
            raise ValueError(f"{self!r} holds packed samples of seq_len {self.packed.seq_len}")
        if not keys.size:
            return np.zeros((0, seq_len + 1), self.store.dtype), None
        if keys.size <= 64:  # a micro-batch: plain Python beats numpy's per-call overhead
            listed = keys.tolist()
            lo, hi = min(listed), max(listed)
        else:
            lo, hi = int(keys.min()), int(keys.max())
        if lo < 0 or hi >= self.packed.num_samples:
            self._rows(keys)  # raises, naming the range
        if self._remote is not None:  # read by range: the vectorized rows, checked
            self._remote.wait_for(keys)  # their step's read-ahead, if it is on its way
            plan = self._read_plan(keys)  # once, for both
            return (
                self._windows_of(keys.size, plan, seq_len),
                self._unlabelled_of(keys.size, plan, seq_len),
            )
        begin, window = self._windows_at(keys)
        check = self.store.unchecked_chunks > 0
        if check:
            for b in begin[window].tolist():
                self._check(b, seq_len + 1)
        out = self.store.token_rows(begin, seq_len + 1)  # one gather; others written over
        if np.count_nonzero(window) == keys.size:  # every sample a window, every label trained
            return out, None
        # The others hold whole documents (every piece ends its document: a piece that
        # does not is seq_len long, alone in its sample, a window), then EOS padding.
        others = [r for r, w in enumerate(window.tolist()) if not w]
        starts, pieces, offsets = self._starts, self._pieces, self._doc_offsets
        tokens, padding = self._tokens, self._padding_row(seq_len)
        ends: list[int] = []
        pads: list[int] = []
        for r in others:  # few rows, few pieces each: one copy per piece
            key, parts, used = int(keys[r]), [], r * seq_len
            for doc, start, n in pieces[starts[key] : starts[key + 1]].tolist():
                b = int(offsets[doc]) + start
                if check:
                    self._check(b, n)
                parts.append(tokens[b : b + n])
                used += n
                ends.append(used - 1)  # a document's last token: no label
            used -= r * seq_len
            parts.append(padding[: seq_len + 1 - used])
            np.concatenate(parts, out=out[r])
            pads.append(used)
        return out, (ends, others, pads)

    def _padding_row(self, seq_len: int) -> np.ndarray:
        """seq_len + 1 EOS tokens (read-only, kept): the padding a row ends with."""
        row = self._padding.get(seq_len)
        if row is None:
            row = np.full(seq_len + 1, self.store.eos_id, dtype=self.store.dtype)
            row.flags.writeable = False
            self._padding[seq_len] = row
        return row

    def id_limit(self, vocab_size: int | None) -> int | None:
        return store_id_limit(self.store, vocab_size)

    def out_of_vocab(self, keys: np.ndarray, tokens: np.ndarray, limit: int) -> str:
        return store_out_of_vocab(self.store, keys, tokens, self.seq_len, limit, packed=True)

    def labelled_tokens(self, keys: np.ndarray) -> int:
        """Labels trained in samples ``keys`` (from the index: no token is read)."""
        _, first, piece = self._pieces_of(keys)
        if self._kept_spans is not None:
            ends_doc = (np.asarray(self._kept_spans[first]).reshape(-1, 3)[:, 0] & 1) == 0
        else:
            ends_doc = piece[:, 1] + piece[:, 2] == self._lengths(piece[:, 0])
        return int(piece[:, 2].sum() - ends_doc.sum())

    def documents(self, key: int) -> list[dict[str, int]]:
        """Packed sample ``key``'s documents in order, in ``zephon show``'s shape: the
        document, its tokens [start, stop) in the sample, its length (a whole document:
        start 0, stop = length)."""
        return [
            {
                "document": doc,
                "start": start,
                "stop": start + length,
                "length": int(self._lengths(np.array([doc]))[0]),
            }
            for doc, start, length in np.asarray(self.packed.sample(key)).tolist()
        ]

    def document_offsets(self, fetch_limit: int = 0) -> None:
        """None: packed samples are not windows of the document offsets (the accounting
        asks ``documents_started``)."""
        return None

    def documents_started(self, keys: np.ndarray) -> int:
        """Documents whose first token is in samples ``keys`` (the per-step accounting)."""
        _, _, piece = self._pieces_of(keys)
        return int(np.count_nonzero(piece[:, 1] == 0))

    def padding(self, keys: np.ndarray) -> int:
        """Padding inputs of samples ``keys`` (the per-step accounting; from the index)."""
        _, _, piece = self._pieces_of(keys)
        return int(np.size(keys)) * self.seq_len - int(piece[:, 2].sum())

    def samples_of_document(self, doc: int) -> np.ndarray:
        """The packed samples holding a piece of document ``doc``, ascending (one, or
        for a document longer than seq_len one per piece). O(pieces), vectorized."""
        index = np.flatnonzero(np.asarray(self.packed.pieces[:, 0]) == doc)
        return np.unique(np.searchsorted(self.packed.starts, index, side="right") - 1)

    def _check(self, begin: int, length: int) -> None:
        """Check the store's chunks under tokens [begin, begin + length)."""
        c = self.store.chunk_tokens
        for chunk in range(begin // c, (begin + length - 1) // c + 1):
            self.store.check_chunk(chunk)

    def _read(
        self, begin: np.ndarray, length: np.ndarray, sums: np.ndarray | None = None
    ) -> np.ndarray:
        """The store's tokens of spans [begin, begin + length), concatenated (checked;
        ``sums``: each span's own checksum, a store in object storage)."""
        if self._remote is not None:
            return self._remote.read(begin, length, sums)
        store = self.store
        if store.unchecked_chunks:
            c = store.chunk_tokens
            ends = begin + length - 1
            chunks: set[int] = set()
            for a, e in zip((begin // c).tolist(), (ends // c).tolist(), strict=True):
                chunks.update(range(a, e + 1))
            for chunk in sorted(chunks):
                store.check_chunk(chunk)
        index = np.repeat(begin, length) + _ranks_within(length)
        return np.asarray(store.tokens[index])

    def read_ahead_steps(self) -> int:
        """Steps the loader announces ahead: the store's for one in object storage (its
        pieces fetched in the background, ``job.packed_remote``), else 0."""
        return 0 if self._remote is None else int(self.store.read_ahead_steps)

    def read_ahead(self, keys: np.ndarray, seq_len: int) -> None:
        """Fetch the pieces of one future step's samples ``keys`` in the background (a
        store in object storage; nothing for a local one)."""
        if self._remote is not None:
            self._remote.announce_later(keys, self._spans)

    def _spans(self, keys: np.ndarray) -> tuple[np.ndarray, ...]:
        """The token spans samples ``keys`` read: (first token, tokens) of each piece,
        and the checksum of each when the index keeps them. Each sample's plan is held
        for its read (``_read_plan``), at most ``PLANS_HELD`` samples."""
        keys = np.asarray(keys, dtype=np.int64).ravel()
        plan = self._read_plan(keys)
        with self._plans_lock:
            for k, one in zip(keys.tolist(), plan.split(keys.size), strict=True):
                self._plans[k] = one
            while len(self._plans) > PLANS_HELD:
                self._plans.pop(next(iter(self._plans)))
        take = plan.take()
        return (plan.begin, take) if plan.sums is None else (plan.begin, take, plan.sums)

    def drop_read_ahead(self) -> None:
        if self._remote is not None:
            self._remote.drop()
        with self._plans_lock:
            self._plans.clear()

    def settle_read_ahead(self, timeout: float = 120.0) -> None:
        """Wait until every step read ahead has landed (what a bench counts as fetched)."""
        if self._remote is not None:
            self._remote.settle(timeout)


PLANS_HELD = 1 << 16
"""Samples whose read plans a packed source holds between their read-ahead and read."""


class _Plan:
    """How samples' pieces are read: the row of each piece, its first token in the
    store, its length in the sample, whether it ends its document (else one token more
    is read: the label of its last), and the checksum of what it reads (or None)."""

    def __init__(
        self,
        rows: np.ndarray,
        begin: np.ndarray,
        length: np.ndarray,
        ends: np.ndarray,
        sums: np.ndarray | None,
    ) -> None:
        self.rows, self.begin, self.length, self.ends, self.sums = rows, begin, length, ends, sums

    def take(self) -> np.ndarray:
        """Tokens read for each piece: its own, and one more unless it ends its document."""
        return self.length + ~self.ends

    def split(self, n: int) -> list[_Plan]:
        """One plan per sample (rows 0 .. n - 1), each of row 0."""
        cuts = np.searchsorted(self.rows, np.arange(1, n))
        zero = np.zeros(0, dtype=np.int64)
        return [
            _Plan(
                np.zeros(b - a, dtype=np.int64),
                self.begin[a:b],
                self.length[a:b],
                self.ends[a:b],
                None if self.sums is None else self.sums[a:b],
            )
            if b > a
            else _Plan(
                zero, zero, zero, np.zeros(0, dtype=bool), None if self.sums is None else zero
            )
            for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), self.rows.size], strict=True)
        ]

    @staticmethod
    def join(plans: list[_Plan]) -> _Plan:
        """The plan of samples read together, in order (each of its own row)."""
        rows = np.concatenate(
            [np.full(p.rows.size, k, dtype=np.int64) for k, p in enumerate(plans)]
        )
        sums = (
            None if any(p.sums is None for p in plans) else np.concatenate([p.sums for p in plans])
        )  # type: ignore[misc]
        return _Plan(
            rows,
            np.concatenate([p.begin for p in plans]),
            np.concatenate([p.length for p in plans]),
            np.concatenate([p.ends for p in plans]),
            sums,
        )


def _ranks_within(counts: np.ndarray) -> np.ndarray:
    """0, 1, ..., counts[0] - 1, 0, 1, ..., counts[1] - 1, ... (int64)."""
    total = int(counts.sum())
    ends = np.cumsum(counts)
    return np.arange(total, dtype=np.int64) - np.repeat(ends - counts, counts)


def _piece_offsets(rows: np.ndarray, length: np.ndarray) -> np.ndarray:
    """The column of each piece's first token in its row (rows ascending): the sum of
    the ``length`` of the row's pieces before it."""
    before = np.cumsum(length) - length  # tokens of all earlier pieces
    row_start = np.zeros(rows.size, dtype=np.int64)
    if rows.size:
        first_of_row = np.r_[True, rows[1:] != rows[:-1]]
        row_start = np.maximum.accumulate(np.where(first_of_row, before, 0))
    return before - row_start


def _ranks_within_rows(rows: np.ndarray, take: np.ndarray, length: np.ndarray) -> np.ndarray:
    """The column of each token of each piece (``take`` tokens of a piece placed at its
    offset in its row)."""
    return np.repeat(_piece_offsets(rows, length), take) + _ranks_within(take)
