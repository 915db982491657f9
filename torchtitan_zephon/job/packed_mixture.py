"""A mixture read as packed samples (``zephon.packing = "best_fit"`` with
``zephon.mixture``): each source packs its own documents.

Role: ``PackedMixtureData`` is ``MixtureData`` whose sources' samples are their own
stores' packed samples (``job.packed.PackedStoreData`` over each store's packing index,
``job.packing``): key ``i << 40 | id`` is packed sample ``id`` of the ``i``-th source in
name order. Each source's sample count is its packed samples less its held-out ones,
so the mixture plan, its exact proportions and its resume are the mixture's own;
rows, labels, labelled tokens (torchft), documents and padding per source (the
accounting) and held-out samples (validation) are each key's source's.

Invariant: row k of ``packed_rows(keys)`` and of ``windows(keys)`` is what the source
of ``keys[k]`` gives for its packed sample id (property-tested); nothing here reads a
token itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from torchtitan_zephon.job.data import Heldout, MixtureData
from torchtitan_zephon.job.packed import PackedStoreData, Unlabelled, packed_extra
from torchtitan_zephon.job.packing import open_packing, packing_note
from torchtitan_zephon.order.data_config import DataConfig
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.mixture.config import MixtureConfig
from torchtitan_zephon.order.mixture.spec import MixtureSpec, resolve_mixture
from torchtitan_zephon.order.packing import PackedSamples, padding_warning
from torchtitan_zephon.order.stream import split_keys
from torchtitan_zephon.store.reader import TokenStore


class PackedMixtureData(MixtureData):
    """Several stores drawn by a mixture plan, each source's samples its own store's
    packed samples (each source packs its own documents; ``PackedStoreData``): key
    ``i << 40 | id`` is packed sample ``id`` of the ``i``-th source in name order. The
    plan, its exact proportions and its resume are the mixture's; only what a key names
    is a packed sample."""

    def __init__(
        self,
        spec: MixtureSpec,
        stores: Mapping[str, TokenStore],
        seq_len: int,
        *,
        packed: Mapping[str, PackedSamples],
        path: str = "mixture",
    ) -> None:
        super().__init__(spec, stores, seq_len, path=path)
        self.sources = [
            PackedStoreData(stores[s.name], packed[s.name], num_samples=int(s.num_samples))
            for s in spec.sources
        ]

    @classmethod
    def of_stores(  # type: ignore[override]
        cls,
        config: MixtureConfig,
        stores: Mapping[str, TokenStore],
        seq_len: int,
        default_heldout: int,
        path: str,
        tokenizer: tuple[str, str] | None,
        *,
        cache_dir: str = "",
        workers: int = 1,
        log: Callable[[str], None] | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> PackedMixtureData:
        """The packed mixture of ``config`` over its opened stores: each source's packing
        index at ``seq_len`` (built on first use; ``log`` gets one line per source,
        ``warn`` a source that pads more than ``PADDING_WARNING``), its packed samples
        counted as the source's samples."""
        packed = {}
        for name in config.names:
            packed[name], folder = open_packing(
                stores[name], seq_len, cache_dir=cache_dir, workers=workers, log=log
            )
            if log is not None:
                log(f"mixture source {name!r}: " + packing_note(packed[name], stores[name], folder))
            warning = padding_warning(packed[name], f"mixture source {name!r}")
            if warning and warn is not None:
                warn(warning)
        available = {name: p.num_samples for name, p in packed.items()}
        spec = resolve_mixture(
            config,
            stores,
            seq_len,
            default_heldout=default_heldout,
            tokenizer=tokenizer,
            available=available,
        )
        return cls(spec, stores, seq_len, packed=packed, path=path)

    def __repr__(self) -> str:
        return f"PackedMixtureData({self.path!r}, sources={self.names}, seq_len={self.seq_len})"

    def data_config(
        self, *, seed: int, schedule: BatchSchedule, extra: Mapping[str, Any] | None = None
    ) -> DataConfig:
        return super().data_config(seed=seed, schedule=schedule, extra=packed_extra(extra))

    def _by_source(self, keys: np.ndarray) -> list[tuple[np.ndarray, PackedStoreData, np.ndarray]]:
        """(positions in ``keys``, the source's packed data, its sample ids) per source
        that ``keys`` draws from."""
        sources, ids = split_keys(np.asarray(keys, dtype=np.int64).ravel())
        out = []
        for i, data in enumerate(self.sources):
            at = np.flatnonzero(sources == i)
            if at.size:
                out.append((at, data, ids[at]))
        return out

    def windows(self, keys: np.ndarray, seq_len: int) -> np.ndarray:
        out = np.empty((np.size(keys), seq_len + 1), dtype=self.stores[0].dtype)
        for at, data, ids in self._by_source(keys):
            out[at] = data.windows(ids, seq_len)
        return out

    def ignored(self, keys: np.ndarray, seq_len: int) -> np.ndarray:
        out = np.empty((np.size(keys), seq_len), dtype=bool)
        for at, data, ids in self._by_source(keys):
            out[at] = data.ignored(ids, seq_len)
        return out

    def packed_rows(self, keys: np.ndarray, seq_len: int) -> tuple[np.ndarray, Unlabelled | None]:
        """``PackedStoreData.packed_rows`` of each key's source, in key order."""
        rows = np.empty((np.size(keys), seq_len + 1), dtype=self.stores[0].dtype)
        ends: list[int] = []
        which: list[int] = []
        pads: list[int] = []
        for at, data, ids in self._by_source(keys):
            rows[at], some = data.packed_rows(ids, seq_len)
            if some is not None:  # its rows k are the batch's rows at[k]
                row = at.tolist()
                ends += [row[e // seq_len] * seq_len + e % seq_len for e in some[0]]
                which += [row[k] for k in some[1]]
                pads += some[2]
        return rows, ((ends, which, pads) if ends or which else None)

    def labelled_tokens(self, keys: np.ndarray) -> int:
        return sum(data.labelled_tokens(ids) for _, data, ids in self._by_source(keys))

    def documents_started(self, keys: np.ndarray) -> np.ndarray:
        """Per source (name order): documents whose first token is in samples ``keys``."""
        return self._per_source(keys, PackedStoreData.documents_started)

    def padding(self, keys: np.ndarray) -> np.ndarray:
        """Per source (name order): padding inputs of samples ``keys``."""
        return self._per_source(keys, PackedStoreData.padding)

    def _per_source(
        self, keys: np.ndarray, count: Callable[[PackedStoreData, np.ndarray], int]
    ) -> np.ndarray:
        out = np.zeros(len(self.sources), dtype=np.int64)
        for _, data, ids in self._by_source(keys):
            out[self.sources.index(data)] = count(data, ids)
        return out

    def out_of_vocab(self, keys: np.ndarray, tokens: np.ndarray, limit: int) -> str:
        row = int(np.unravel_index(int(np.argmax(tokens)), tokens.shape)[0])
        sources, ids = split_keys(np.asarray(keys).ravel()[row : row + 1])
        i = int(sources[0])
        return f"mixture source {self.names[i]!r}: " + self.sources[i].out_of_vocab(
            ids, tokens[row : row + 1], limit
        )

    def read_ahead_steps(self) -> int:
        return max(data.read_ahead_steps() for data in self.sources)

    def read_ahead(self, keys: np.ndarray, seq_len: int) -> None:
        """Each source in object storage fetches the pieces of its samples of ``keys``
        (one future step) in the background (``PackedStoreData.read_ahead``)."""
        for _, data, ids in self._by_source(keys):
            data.read_ahead(ids, seq_len)

    def drop_read_ahead(self) -> None:
        for data in self.sources:
            data.drop_read_ahead()

    def heldout(self) -> list[Heldout]:
        """Each source's last packed samples, read as packed samples."""
        return [
            Heldout(name, data, int(s.num_samples), int(s.heldout_samples))  # type: ignore[arg-type]
            for name, s, data in zip(self.names, self.spec.sources, self.sources, strict=True)
        ]
