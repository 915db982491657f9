"""The job's data as a loader reads it: one interface, one store or a mixture.

Role: ``JobData`` is what a loader reads: ``data_config`` (the ``DataConfig`` it
governs), ``plan(config, anchor)`` (a ``StreamPlan``: keys per step, rank slice
and window of a rank's stream), ``windows(keys, seq_len)`` (the tokens, checked
by their store), ``id_limit`` / ``out_of_vocab`` (the vocabulary guard) and
``heldout`` (each source's held-out samples, for validation), and the read-ahead of
stores in object storage (``read_ahead_steps``: how many steps a loader announces
ahead, 0 for local stores; ``read_ahead(keys, seq_len)``: one future step's keys;
``drop_read_ahead()``: forget them). ``StoreData`` is
one token store (its plan is a ``DataPlan``); ``MixtureData`` is several stores
drawn in exact proportions by a ``MixturePlan`` (seen through
``MixtureStream``). A new kind of job data (a remote store, raw inputs prepared
on the fly) plugs in by providing the same few methods; plans and state stay as
they are.

Invariants:
- ``data.plan(config, anchor)`` depends only on the data config, the anchor
  and (for a mixture) the spec it was resolved to: every rank builds the same
  plan (``job.plans.plan_of``). Its keys of step ``s`` are
  ``plan.global_ids(s)``; the rank slices concatenate to them for every DP
  degree dividing the step's batch.
- Row k of ``windows(keys, seq_len)`` is the window of the sample ``keys[k]``
  names, read from that sample's store.
- A ``MixtureData`` keeps only its own last plan; nothing here keeps opened
  stores per process.
- Left-out samples (``leave_out``: ``order.exclusions``) are checked against the
  data once; from then on every ``data_config`` binds them (field ``exclude``) and
  every ``plan`` maps past them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from torchtitan_zephon.job.plans import plan_of
from torchtitan_zephon.job.stores import open_mixture_stores
from torchtitan_zephon.job.vocab import store_id_limit, store_out_of_vocab
from torchtitan_zephon.order.data_config import MIXTURE_FIELD, DataConfig
from torchtitan_zephon.order.exclusions import EXCLUDE_FIELD, Exclusions, SourceRange
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.mixture.config import MixtureConfig, MixtureError
from torchtitan_zephon.order.mixture.spec import MixtureSpec, resolve_mixture
from torchtitan_zephon.order.mixture.stream import MixtureStream
from torchtitan_zephon.order.store_size import no_sample_text, store_fix
from torchtitan_zephon.order.stream import ID_MASK, DataPlan, StreamPlan, split_keys
from torchtitan_zephon.store.format import fingerprint
from torchtitan_zephon.store.group import StoreGroup
from torchtitan_zephon.store.reader import TokenStore


@dataclass(frozen=True)
class Heldout:
    """One source's held-out samples: ``[first, first + count)`` of ``store``."""

    name: str | None  # None: the job's only store
    store: TokenStore
    first: int
    count: int


class JobData(Protocol):
    """What a loader reads: a plan of sample keys and the tokens of a key."""

    path: str
    seq_len: int
    vocab_size: int
    tokenizer_hash: str
    fingerprint: str
    warnings: list[str]

    def data_config(
        self, *, seed: int, schedule: BatchSchedule, extra: Mapping[str, Any] | None = None
    ) -> DataConfig: ...
    def plan(self, config: DataConfig, anchor: tuple[int, int] = (1, 0)) -> StreamPlan: ...
    def leave_out(self, exclusions: Exclusions) -> None: ...
    def windows(self, keys: np.ndarray, seq_len: int) -> np.ndarray: ...
    def id_limit(self, vocab_size: int | None) -> int | None: ...
    def out_of_vocab(self, keys: np.ndarray, tokens: np.ndarray, limit: int) -> str: ...
    def heldout(self) -> list[Heldout]: ...
    def read_ahead_steps(self) -> int: ...
    def read_ahead(self, keys: np.ndarray, seq_len: int) -> None: ...
    def drop_read_ahead(self) -> None: ...


def _store_read_ahead_steps(store: TokenStore) -> int:
    """Steps a loader reads ahead of a store: a remote store's setting, 0 for a map."""
    return 0 if store.mapped else int(getattr(store, "read_ahead_steps", 0))


# ---------------------------------------------------------------- one store


class StoreData:
    """One token store: samples ``[sample_offset, sample_offset + num_samples)`` are
    trained on (the rest, at the end, is held out); the keys are the sample ids."""

    def __init__(
        self,
        store: TokenStore,
        seq_len: int,
        *,
        sample_offset: int = 0,
        num_samples: int | None = None,
        available: int | None = None,
    ) -> None:
        available = store.num_samples(seq_len) if available is None else available
        if available == 0:
            what = f"the store {str(store.path)!r}"
            raise ValueError(
                f"{no_sample_text(what, store.num_tokens, seq_len)}. "
                + store_fix(store.num_tokens, sample_offset + (num_samples or 1), "seq_len")
            )
        if num_samples is None:
            num_samples = available - sample_offset
        if sample_offset < 0 or num_samples < 1 or sample_offset + num_samples > available:
            raise ValueError(
                f"samples [{sample_offset}, {sample_offset + num_samples}) do not fit the store "
                f"{str(store.path)!r}, which holds {available} samples of seq_len {seq_len} "
                f"({store.num_tokens} tokens). Use a smaller seq_len, sample_offset or "
                "num_samples, or a larger store."
            )
        self.store = store
        self.available = int(available)  # samples of the store at seq_len (packed: the index's)
        self.seq_len = int(seq_len)
        self.sample_offset = int(sample_offset)
        self.num_samples = int(num_samples)
        self.path = str(store.path)
        self.version = store.version
        self.vocab_size = store.vocab_size
        self.tokenizer_hash = store.tokenizer_hash
        self.fingerprint = store.fingerprint
        self.warnings: list[str] = []
        self.exclusions: Exclusions | None = None

    def __repr__(self) -> str:
        return f"StoreData({self.store!r}, seq_len={self.seq_len})"

    def leave_out(self, exclusions: Exclusions) -> None:
        """Leave out ``exclusions`` (``order.exclusions``) from now on: checked against the
        store's training and held-out ids (ValueError naming the line), then bound by
        every data config this data makes."""
        total = self.available
        exclusions.check({None: SourceRange(self.sample_offset, self.num_samples, total)})
        self.exclusions = exclusions if exclusions else None

    def data_config(
        self, *, seed: int, schedule: BatchSchedule, extra: Mapping[str, Any] | None = None
    ) -> DataConfig:
        return DataConfig.make(
            seq_len=self.seq_len,
            seed=seed,
            schedule=schedule,
            sample_offset=self.sample_offset,
            num_samples=self.num_samples,
            store_fingerprint=self.store.fingerprint,
            tokenizer_hash=self.store.tokenizer_hash,
            extra=_with_exclusions(extra, self.exclusions),
        )

    def plan(self, config: DataConfig, anchor: tuple[int, int] = (1, 0)) -> DataPlan:
        return plan_of(config, anchor, exclusions=self.exclusions)

    def windows(self, keys: np.ndarray, seq_len: int) -> np.ndarray:
        return self.store.windows(keys, seq_len)

    def id_limit(self, vocab_size: int | None) -> int | None:
        return store_id_limit(self.store, vocab_size)

    def out_of_vocab(self, keys: np.ndarray, tokens: np.ndarray, limit: int) -> str:
        return store_out_of_vocab(self.store, keys, tokens, self.seq_len, limit)

    def read_ahead_steps(self) -> int:
        return _store_read_ahead_steps(self.store)

    def read_ahead(self, keys: np.ndarray, seq_len: int) -> None:
        if not self.store.mapped:
            self.store.read_ahead(keys, seq_len)

    def drop_read_ahead(self) -> None:
        if not self.store.mapped:
            self.store.drop_read_ahead()

    def heldout(self) -> list[Heldout]:
        first = self.sample_offset + self.num_samples
        return [Heldout(None, self.store, first, self.available - first)]


# ---------------------------------------------------------------- a mixture


def as_job_data(
    data: TokenStore | JobData,
    seq_len: int,
    *,
    sample_offset: int = 0,
    num_samples: int | None = None,
) -> JobData:
    """``data`` as a job's data for ``seq_len``: a bare store becomes ``StoreData``
    (samples ``[sample_offset, + num_samples)``); job data opened for another seq_len is
    refused."""
    if isinstance(data, TokenStore):  # the one-store case
        return StoreData(data, seq_len, sample_offset=sample_offset, num_samples=num_samples)
    if data.seq_len != seq_len:
        raise ValueError(
            f"the job's data {data.path!r} was opened for seq_len {data.seq_len}, "
            f"the loader was asked for seq_len {seq_len}."
        )
    return data


def mixture_store_fingerprint(spec: MixtureSpec) -> str:
    """The ``store_fingerprint`` of a mixture's data config: a hash of its sources'
    store fingerprints (by name)."""
    return fingerprint(
        {
            "format": "zephon-mixture-stores/1",
            "sources": {s.name: s.store_fingerprint for s in spec.sources},
        }
    )


def sorted_by_name(config: MixtureConfig) -> MixtureConfig:
    """The mixture with its sources in name order: source indices (and so sample keys)
    do not depend on the order of the ``[[source]]`` blocks."""
    return MixtureConfig(tuple(sorted(config.sources, key=lambda s: s.name)), config.schedule)


class MixtureData:
    """Several token stores drawn by a mixture plan; key ``i << 40 | id`` is sample ``id``
    of the ``i``-th source in name order."""

    def __init__(
        self,
        spec: MixtureSpec,
        stores: Mapping[str, TokenStore],
        seq_len: int,
        *,
        path: str = "mixture",
    ) -> None:
        names = spec.names
        if names != sorted(names):
            raise MixtureError(f"a MixtureData needs its sources in name order, found {names}.")
        for s in spec.sources:
            if s.num_samples + s.heldout_samples > ID_MASK:
                raise MixtureError(
                    f"mixture source {s.name!r} holds {s.num_samples + s.heldout_samples} "
                    f"samples; a source may hold at most {ID_MASK} (split it into two sources)."
                )
        self.spec = spec
        self.names = names
        self.stores = [stores[n] for n in names]
        self.seq_len = int(seq_len)
        self.path = str(path)
        ref = self.stores[0]
        self.vocab_size = ref.vocab_size
        self.tokenizer_hash = ref.tokenizer_hash
        self.fingerprint = mixture_store_fingerprint(spec)
        self.warnings: list[str] = []
        self.group = StoreGroup(self.stores)
        self._plan: tuple[tuple[str, tuple[int, int]], MixtureStream] | None = None
        self.exclusions: Exclusions | None = None

    def leave_out(self, exclusions: Exclusions) -> None:
        """Leave out ``exclusions`` (``order.exclusions``; each entry names a source) from
        now on: checked against each source's training and held-out ids (ValueError
        naming the line), then bound by every data config this data makes."""
        exclusions.check(
            {
                s.name: SourceRange(0, int(s.num_samples), int(s.num_samples + s.heldout_samples))
                for s in self.spec.sources
            }
        )
        self.exclusions = exclusions if exclusions else None
        self._plan = None

    @classmethod
    def open(
        cls,
        config: MixtureConfig,
        seq_len: int,
        *,
        default_heldout: int = 0,
        path: str = "mixture",
        progress: bool = False,
        raw: Any = None,
        remote: Any = None,
        **options: Any,
    ) -> MixtureData:
        """Open the stores of a parsed mixture file and check them against each other
        (one tokenizer, enough samples); MixtureError names the source at fault. Sources
        that name raw inputs are prepared as ``raw`` (a ``cache.RawInputs``) says; sources
        in object storage are read as ``remote`` (a ``store.remote.RemoteOptions``;
        None: its defaults) says; ``options`` go to ``of_stores`` (a subclass's own).

        Every call opens the stores afresh: a job opens its data once and hands the
        object on (the trainer: to the preflight, the loader and the validator)."""
        config = sorted_by_name(config)
        stores = open_mixture_stores(config, progress=progress, raw=raw, remote=remote)
        tokenizer = _job_tokenizer(raw)
        return cls.of_stores(config, stores, seq_len, default_heldout, path, tokenizer, **options)

    @classmethod
    def of_stores(
        cls,
        config: MixtureConfig,
        stores: Mapping[str, TokenStore],
        seq_len: int,
        default_heldout: int,
        path: str,
        tokenizer: tuple[str, str] | None,
    ) -> MixtureData:
        """The mixture of ``config`` (sources in name order) over its opened stores."""
        spec = resolve_mixture(
            config, stores, seq_len, default_heldout=default_heldout, tokenizer=tokenizer
        )
        return cls(spec, stores, seq_len, path=path)

    def __repr__(self) -> str:
        return f"MixtureData({self.path!r}, sources={self.names}, seq_len={self.seq_len})"

    def data_config(
        self, *, seed: int, schedule: BatchSchedule, extra: Mapping[str, Any] | None = None
    ) -> DataConfig:
        return DataConfig.make(
            seq_len=self.seq_len,
            seed=seed,
            schedule=schedule,
            sample_offset=0,
            num_samples=sum(int(s.num_samples) for s in self.spec.sources),
            store_fingerprint=self.fingerprint,
            tokenizer_hash=self.tokenizer_hash,
            extra={**_with_exclusions(extra, self.exclusions), MIXTURE_FIELD: self.spec.to_json()},
        )

    def plan(self, config: DataConfig, anchor: tuple[int, int] = (1, 0)) -> MixtureStream:
        """The plan of ``config`` (made by ``data_config``), counted from ``anchor``; the
        first call also collects the plan's warnings (a source smaller than its share of
        a global batch).

        The job's data owns its plan: it keeps the one it built last (plans are
        immutable), so a loader and its resume at the same anchor, or a loader built
        again on this data, read that plan instead of building it again."""
        if not self.spec.is_written_as(config.mixture):
            raise MixtureError(
                "the data config's mixture is not this source's mixture; build the config "
                "with MixtureData.data_config."
            )
        key = (config.fingerprint, (int(anchor[0]), int(anchor[1])))
        if self._plan is None or self._plan[0] != key:
            self._plan = (
                key,
                plan_of(config, anchor, spec=self.spec, exclusions=self.exclusions),
            )
        stream = self._plan[1]
        if not self.warnings:
            self.warnings = list(stream.mixture.warnings)
        return stream

    def windows(self, keys: np.ndarray, seq_len: int) -> np.ndarray:
        sources, ids = split_keys(np.asarray(keys, dtype=np.int64).ravel())
        if len(self.stores) == 1 and not np.count_nonzero(sources):
            return self.stores[0].windows(ids, seq_len)  # one source: the store's own read
        return self.group.windows(sources, ids, seq_len)

    def id_limit(self, vocab_size: int | None) -> int | None:
        limits = [store_id_limit(st, vocab_size) for st in self.stores]
        return None if all(x is None for x in limits) else int(vocab_size)

    def out_of_vocab(self, keys: np.ndarray, tokens: np.ndarray, limit: int) -> str:
        row = int(np.unravel_index(int(np.argmax(tokens)), tokens.shape)[0])
        sources, ids = split_keys(np.asarray(keys).ravel()[row : row + 1])
        i = int(sources[0])
        return f"mixture source {self.names[i]!r}: " + store_out_of_vocab(
            self.stores[i], ids, tokens[row : row + 1], self.seq_len, limit
        )

    def read_ahead_steps(self) -> int:
        return max(_store_read_ahead_steps(st) for st in self.stores)

    def read_ahead(self, keys: np.ndarray, seq_len: int) -> None:
        sources, ids = split_keys(np.asarray(keys, dtype=np.int64).ravel())
        for i, st in enumerate(self.stores):
            if not st.mapped:
                st.read_ahead(ids[sources == i], seq_len)

    def drop_read_ahead(self) -> None:
        for st in self.stores:
            if not st.mapped:
                st.drop_read_ahead()

    def heldout(self) -> list[Heldout]:
        return [
            Heldout(s.name, st, int(s.num_samples), int(s.heldout_samples))
            for s, st in zip(self.spec.sources, self.stores, strict=True)
        ]


def _with_exclusions(
    extra: Mapping[str, Any] | None, exclusions: Exclusions | None
) -> dict[str, Any]:
    """``extra`` with the field ``exclude`` of the left-out list (absent without one)."""
    out = dict(extra or {})
    if exclusions:
        out[EXCLUDE_FIELD] = exclusions.to_json()
    return out


def _job_tokenizer(raw: Any) -> tuple[str, str] | None:
    """(sha256 of the job's tokenizer.json, the setting that names it) from a
    ``cache.RawInputs``; None without one: what tells which of disagreeing sources has
    the right tokenizer."""
    path = Path(raw.tokenizer) / "tokenizer.json" if raw is not None else None
    if path is None or not path.is_file():
        return None
    try:
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
    return sha, f"{raw.tokenizer_origin} ({raw.tokenizer})"
