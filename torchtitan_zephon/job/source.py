"""One source of a job's data: a token store and its map from sample ids to rows.

Role: ``Source`` is what a job's data (``job.data.JobData``) reads from each of its
sources, whatever its kind: ``rows(ids, seq_len)`` gives the rows of ``seq_len + 1``
tokens of samples ``ids`` and the inputs among them whose label is not trained
(``Unlabelled``; None when every label is); the accounting asks ``labelled_tokens``,
``documents_started`` and ``padding``; ``zephon show`` and ``where`` ask
``documents`` and ``samples_of_document``; a store in object storage reads ahead
(``read_ahead_steps``, ``read_ahead``, ``drop_read_ahead``). Two maps implement it:
``WindowSource`` (here: sample ``i`` is the window of tokens ``[i * seq_len, (i + 1)
* seq_len]``, every label trained) and ``job.packed.PackedSource`` (whole documents
packed into each sample, ``zephon.packing``). Reading from a bucket is the store's
own business (``store.remote.RemoteTokenStore`` is a ``TokenStore``): a source asks
``store.mapped`` only to pick the cheaper read.

Invariants:
- Row k of ``rows(ids, seq_len)[0]`` is ``windows(ids, seq_len)[k]``, and its trained
  labels are exactly those ``ignored(ids, seq_len)[k]`` leaves False
  (property-tested for both maps).
- ``labelled_tokens(ids)`` counts those labels from the map alone (no token is read).
- Every token read was checked against the store's chunk checksums first (the
  store's own read, or the packed map's checks).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from torchtitan_zephon.job.vocab import store_id_limit, store_out_of_vocab
from torchtitan_zephon.store.reader import TokenStore

Unlabelled = tuple[list[int], list[int], list[int]]
"""``(ends, rows, pads)``, the inputs of a batch [n, seq_len] whose label is not trained:
``ends``, the flat positions (row x seq_len + column) of documents' last tokens;
``rows[k]``'s inputs from column ``pads[k]`` on, padding. Any other input is trained."""

IGNORE_INDEX = -100
"""The label of an input that trains nothing: TorchTitan's ``IGNORE_INDEX`` (its loss
skips it; its step counts the others as the step's tokens)."""

OFFSETS_FETCH_LIMIT = 64 << 20
"""The largest document-offsets file (8 bytes a document: 8 M documents) the accounting
fetches from a store in object storage, whole, once; a larger one is not fetched and
that source's documents started are not counted (-1)."""


class Source(Protocol):
    """One source of a job's data: its store and its map from sample ids to rows."""

    store: TokenStore
    seq_len: int
    available: int  # samples of the map at seq_len
    packing: str  # the data-config field's method: "none" (windows) or "best_fit"

    def rows(self, ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, Unlabelled | None]: ...
    def windows(self, ids: np.ndarray, seq_len: int) -> np.ndarray: ...
    def ignored(self, ids: np.ndarray, seq_len: int) -> np.ndarray: ...
    def labelled_tokens(self, ids: np.ndarray) -> int: ...
    def document_offsets(self, fetch_limit: int = OFFSETS_FETCH_LIMIT) -> np.ndarray | None: ...
    def documents_started(self, ids: np.ndarray) -> int: ...
    def padding(self, ids: np.ndarray) -> int: ...
    def documents(self, key: int) -> list[dict[str, int]]: ...
    def samples_of_document(self, doc: int) -> np.ndarray: ...
    def id_limit(self, vocab_size: int | None) -> int | None: ...
    def out_of_vocab(self, ids: np.ndarray, tokens: np.ndarray, limit: int) -> str: ...
    def read_ahead_steps(self) -> int: ...
    def read_ahead(self, ids: np.ndarray, seq_len: int) -> None: ...
    def drop_read_ahead(self) -> None: ...
    def settle_read_ahead(self, timeout: float = 120.0) -> None: ...


class WindowSource:
    """A store read as windows: sample ``i`` is tokens ``[i * seq_len, (i + 1) *
    seq_len]`` (the last one the next sample's first), every label trained."""

    packing = "none"

    def __init__(self, store: TokenStore, seq_len: int) -> None:
        self.store = store
        self.seq_len = int(seq_len)
        self.available = int(store.num_samples(seq_len))
        self._offsets: np.ndarray | None | bool = False  # False: not fetched yet

    def __repr__(self) -> str:
        return f"WindowSource({self.store!r}, seq_len={self.seq_len})"

    def rows(self, ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, Unlabelled | None]:
        return self.store.windows(ids, seq_len), None  # the store checks what it reads

    def windows(self, ids: np.ndarray, seq_len: int) -> np.ndarray:
        return self.store.windows(ids, seq_len)

    def ignored(self, ids: np.ndarray, seq_len: int) -> np.ndarray:
        return np.zeros((np.size(ids), seq_len), dtype=bool)

    def labelled_tokens(self, ids: np.ndarray) -> int:
        return int(np.size(ids)) * self.seq_len

    def document_offsets(self, fetch_limit: int = OFFSETS_FETCH_LIMIT) -> np.ndarray | None:
        """The store's document offsets (token index of every document's first token). A
        local store's are mapped; a store in object storage fetches its offsets file
        whole, once, only when it is at most ``fetch_limit`` bytes (None otherwise: a
        store of 10^10 documents holds 80 GB of offsets)."""
        remote = not self.store.mapped  # store.remote.RemoteTokenStore
        if remote and int(self.store.num_documents) * 8 > fetch_limit:
            return None
        return np.asarray(self.store.doc_offsets, dtype=np.int64)

    def documents_started(self, ids: np.ndarray) -> int:
        """Documents whose first token is in samples ``ids``, with multiplicity (-1: not
        counted, ``document_offsets``)."""
        if self._offsets is False:
            self._offsets = self.document_offsets()
        if self._offsets is None:
            return -1
        return starts_in_windows(self._offsets, np.asarray(ids), self.seq_len)  # type: ignore[arg-type]

    def padding(self, ids: np.ndarray) -> int:
        return 0

    def documents(self, key: int) -> list[dict[str, int]]:
        raise ValueError(f"{self!r} reads windows: a sample is not a list of documents")

    def samples_of_document(self, doc: int) -> np.ndarray:
        """The samples holding a token of document ``doc``, ascending."""
        offsets = self.store.doc_offsets
        first = int(offsets[doc])
        end = int(offsets[doc + 1]) if doc + 1 < len(offsets) else int(self.store.num_tokens)
        return np.arange(first // self.seq_len, (end - 1) // self.seq_len + 1, dtype=np.int64)

    def id_limit(self, vocab_size: int | None) -> int | None:
        return store_id_limit(self.store, vocab_size)

    def out_of_vocab(self, ids: np.ndarray, tokens: np.ndarray, limit: int) -> str:
        return store_out_of_vocab(self.store, ids, tokens, self.seq_len, limit)

    def read_ahead_steps(self) -> int:
        """Steps a loader reads ahead of the store: a remote store's setting, 0 for a map."""
        return 0 if self.store.mapped else int(getattr(self.store, "read_ahead_steps", 0))

    def read_ahead(self, ids: np.ndarray, seq_len: int) -> None:
        if not self.store.mapped:
            self.store.read_ahead(ids, seq_len)

    def drop_read_ahead(self) -> None:
        if not self.store.mapped:
            self.store.drop_read_ahead()

    def settle_read_ahead(self, timeout: float = 120.0) -> None:
        """Wait until every step read ahead has landed (what a bench counts as fetched)."""
        if not self.store.mapped:
            self.store.settle(timeout)


def starts_in_windows(offsets: np.ndarray, ids: np.ndarray, seq_len: int) -> int:
    """Documents (``offsets``: each one's first token) that start inside the windows of
    samples ``ids``, with multiplicity: two sorted ``searchsorted`` over the offsets."""
    if not np.size(ids):
        return 0
    length = np.int64(seq_len)
    starts = np.sort(np.asarray(ids, dtype=np.int64).ravel()) * length  # sorted queries
    hi = np.searchsorted(offsets, starts + length, side="left")
    lo = np.searchsorted(offsets, starts, side="left")
    return int((hi - lo).sum())


def unlabel(labels: Any, unlabelled: Unlabelled | None) -> None:
    """Set the labels [n, seq_len] (a contiguous numpy array or torch tensor) of the
    inputs ``unlabelled`` names to ``IGNORE_INDEX``, in place."""
    if unlabelled is None:
        return
    ends, rows, pads = unlabelled
    labels.reshape(-1)[ends] = IGNORE_INDEX
    for row, pad in zip(rows, pads, strict=True):
        labels[row, pad:] = IGNORE_INDEX
