"""Packing whole documents into samples: the best-fit rule and the packing index.

Role: with ``zephon.packing = "best_fit"`` a sample is ``seq_len`` tokens made of whole
documents (each with its EOS, as the store keeps them) and padding. ``pieces_of`` cuts
each document: one piece when it fits ``seq_len``, else ``seq_len``-token pieces and
the rest, a last piece that is packed like a short document. ``best_fit`` packs the
pieces in store order into samples with a best-fit rule over a bounded look-ahead:
each piece goes into the open sample with the least room that still holds it (the
oldest of equals); when none does, a new sample opens, and if ``OPEN_SAMPLES`` are
already open the fullest of them (least room; the oldest of equals) closes first. A
piece of exactly ``seq_len`` tokens is a sample of its own at once, and a sample with
no room left closes at once; at the end of a chunk the open samples close in the order
they opened. Samples are numbered in the order they close. ``pack`` runs the rule over
the store's documents in chunks of ``CHUNK_DOCUMENTS`` (each chunk on its own: the
index is the same for any number of workers) and gives the **packing index**
(``PackedSamples``): per packed sample, its pieces (document, start within the
document, length) in the order they were placed.

Invariants (property-tested):
- Every token of every document is in exactly one piece of exactly one sample, and a
  sample's pieces hold at most ``seq_len`` tokens; what is left is padding, never
  trained.
- A document of at most ``seq_len`` tokens is never split; a longer one is cut into
  ``ceil(length / seq_len)`` pieces, all but the last of exactly ``seq_len`` tokens.
- The index depends only on the documents' lengths, ``seq_len`` and this module's
  constants (``PACKING_FORMAT``), never on workers, DP degree or restarts. It is the
  one O(documents) structure of packing: the order over packed samples is the store
  order's (a keyed permutation per epoch over ``num_samples``), O(1) in the step.

Padding: a sample closes with room r only when a piece longer than r found no open
sample to hold it, so with look-ahead K the padding is small where pieces are short
against ``seq_len`` (under 1 % on the builtin corpus at seq_len 64-2048) and largest
when every document is just over ``seq_len / 2`` (then about half of each sample: no
two fit together); ``PackedSamples.padding_fraction`` says how much a store gets.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

PACKING_METHODS = ("none", "best_fit")
PACKING_FORMAT = 1
"""Version of the rule below: a new rule gets a new number (and a new data config)."""
OPEN_SAMPLES = 64
"""The look-ahead: how many samples may be open (filling) at once."""
PADDING_WARNING = 0.10
"""A store whose packing pads more than this fraction of its samples warns at start."""
CHUNK_DOCUMENTS = 1 << 16
"""Documents packed together; chunks never share a sample (fixed: any worker count
builds the same index)."""


def pieces_of(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pieces of documents of ``lengths`` tokens, in order: (document index, start
    within the document, length) arrays; a document of at most ``seq_len`` tokens is one
    piece, a longer one ``seq_len``-token pieces and its rest."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if lengths.size and int(lengths.min()) < 1:
        raise ValueError("every document holds at least one token (its EOS)")
    counts = (lengths + seq_len - 1) // seq_len
    doc = np.repeat(np.arange(lengths.size, dtype=np.int64), counts)
    first = np.cumsum(counts) - counts  # index of each document's first piece
    k = np.arange(doc.size, dtype=np.int64) - np.repeat(first, counts)
    start = k * seq_len
    length = np.minimum(seq_len, lengths[doc] - start)
    return doc, start, length


def best_fit(
    lengths: Sequence[int], seq_len: int, open_samples: int = OPEN_SAMPLES
) -> list[list[int]]:
    """The packed samples of items of ``lengths`` (each at most ``seq_len``), as lists of
    item indices in the order the samples close (the rule of the module docstring)."""
    if open_samples < 1:
        raise ValueError(f"open_samples must be >= 1, got {open_samples}")
    room: list[tuple[int, int]] = []  # (room left, opening number) of the open samples, sorted
    members: dict[int, list[int]] = {}
    out: list[list[int]] = []
    opened = 0
    for i, n in enumerate(lengths):
        n = int(n)
        if not 1 <= n <= seq_len:
            raise ValueError(f"item {i} has {n} tokens: expected 1 .. seq_len {seq_len}")
        if n == seq_len:
            out.append([i])
            continue
        j = bisect.bisect_left(room, (n, -1))  # least room that still holds n
        if j < len(room):
            left, number = room.pop(j)
            members[number].append(i)
            if left == n:
                out.append(members.pop(number))
            else:
                bisect.insort(room, (left - n, number))
            continue
        if len(room) == open_samples:
            _, number = room.pop(0)  # the fullest closes
            out.append(members.pop(number))
        members[opened] = [i]
        bisect.insort(room, (seq_len - n, opened))
        opened += 1
    out.extend(members[number] for number in sorted(members))
    return out


@dataclass(frozen=True)
class PackedSamples:
    """The packing index: sample ``i`` is ``pieces[starts[i]:starts[i + 1]]``, rows of
    (document, start within the document, length)."""

    seq_len: int
    starts: np.ndarray  # int64 [num_samples + 1]
    pieces: np.ndarray  # int64 [num_pieces, 3]
    recorded: tuple[int, int] | None = None
    """(tokens, split documents) as the index's manifest records them: ``tokens`` and
    ``split_documents`` then read no piece (an index kept with its store is mapped, and
    a job opening it reads nothing in proportion to the corpus)."""
    spans: np.ndarray | None = None
    """int64 [num_pieces, 3], kept with a store's own index (``job.packing.piece_spans``):
    each piece's first token in the store (x2, +1 when it reads one more), its length
    and the checksum of what it reads; None for an index without them."""

    @property
    def num_samples(self) -> int:
        return int(self.starts.size) - 1

    @property
    def num_pieces(self) -> int:
        return int(self.pieces.shape[0])

    def sample(self, i: int) -> np.ndarray:
        """Sample ``i``'s pieces: rows of (document, start, length)."""
        return self.pieces[int(self.starts[i]) : int(self.starts[i + 1])]

    def tokens(self) -> int:
        """Tokens of documents in all samples (the rest of the samples is padding)."""
        if self.recorded is not None:
            return self.recorded[0]
        return int(self.pieces[:, 2].sum()) if self.num_pieces else 0

    def padding_fraction(self) -> float:
        """Padding over all the samples' tokens."""
        total = self.num_samples * self.seq_len
        return (total - self.tokens()) / total if total else 0.0

    def split_documents(self) -> int:
        """Documents cut into more than one piece (longer than ``seq_len``)."""
        if self.recorded is not None:
            return self.recorded[1]
        if not self.num_pieces:
            return 0
        return int(np.count_nonzero(self.pieces[:, 1] == self.seq_len))


def pack_chunk(
    lengths: np.ndarray, first_document: int, seq_len: int, open_samples: int = OPEN_SAMPLES
) -> tuple[np.ndarray, np.ndarray]:
    """One chunk's samples: (pieces per sample, pieces rows) with document numbers
    counted from ``first_document``."""
    doc, start, length = pieces_of(lengths, seq_len)
    samples = best_fit(length.tolist(), seq_len, open_samples)
    order = np.fromiter((i for s in samples for i in s), dtype=np.int64, count=doc.size)
    sizes = np.fromiter((len(s) for s in samples), dtype=np.int64, count=len(samples))
    rows = np.stack([doc[order] + first_document, start[order], length[order]], axis=1)
    return sizes, rows


def chunks(num_documents: int, chunk_documents: int = CHUNK_DOCUMENTS) -> list[tuple[int, int]]:
    """The [first, stop) document ranges packed on their own."""
    return [
        (a, min(a + chunk_documents, num_documents))
        for a in range(0, num_documents, chunk_documents)
    ]


def pack(
    lengths: np.ndarray,
    seq_len: int,
    *,
    open_samples: int = OPEN_SAMPLES,
    chunk_documents: int = CHUNK_DOCUMENTS,
    map_fn: Callable[..., Iterable[tuple[np.ndarray, np.ndarray]]] = map,
) -> PackedSamples:
    """The packing index of documents of ``lengths`` tokens; ``map_fn`` (e.g. a process
    pool's ``map``) packs the chunks, in any number of workers, with one result."""
    lengths = np.asarray(lengths, dtype=np.int64)
    spans = chunks(int(lengths.size), chunk_documents)
    results = list(
        map_fn(
            pack_chunk,
            [lengths[a:b] for a, b in spans],
            [a for a, _ in spans],
            [seq_len] * len(spans),
            [open_samples] * len(spans),
        )
    )
    sizes = np.concatenate([s for s, _ in results]) if results else np.zeros(0, np.int64)
    rows = np.concatenate([r for _, r in results]) if results else np.zeros((0, 3), np.int64)
    starts = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    return PackedSamples(seq_len=int(seq_len), starts=starts, pieces=rows)


def padding_warning(packed: PackedSamples, store: str) -> str | None:
    """The start's warning when packing pads more than ``PADDING_WARNING`` of the samples
    of ``store`` (None otherwise)."""
    fraction = packed.padding_fraction()
    if fraction <= PADDING_WARNING:
        return None
    return (
        f"zephon.packing = best_fit pads {fraction:.1%} of the samples of {store} at seq_len "
        f"{packed.seq_len} (more than {PADDING_WARNING:.0%}): its documents pack poorly into "
        "seq_len tokens (for example, most just over seq_len / 2); consider another seq_len."
    )


def packing_field(method: str) -> dict[str, int | str] | None:
    """The data-config field of a packing method: None for ``none`` (the field is then
    absent, so every config, plan and digest is what it was before packing existed),
    else the method and every constant the index depends on. ValueError names the
    setting for an unknown method."""
    if method not in PACKING_METHODS:
        raise ValueError(
            f"zephon.packing = {method!r}: expected one of {', '.join(PACKING_METHODS)}"
        )
    if method == "none":
        return None
    return {
        "method": method,
        "format": PACKING_FORMAT,
        "open_samples": OPEN_SAMPLES,
        "chunk_documents": CHUNK_DOCUMENTS,
    }
