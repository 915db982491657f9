"""The job's data as a loader reads it: one class, one store or a mixture of stores.

Role: ``JobData`` is what every reader of a job's data asks (the loader, validation,
the accounting, torchft, ``plan``, ``show``, ``where`` and the benches): its
``sources`` (each a ``job.source.Source``: a store and its map from sample ids to
rows, windows or packed), ``data_config(seed, schedule, extra)`` (the ``DataConfig``
it governs), ``plan(config, anchor)`` (a ``StreamPlan``: keys per step, rank slice
and window of a rank's stream), ``rows(keys, seq_len)`` (the tokens and the inputs
that train no label, read from each key's source), ``id_limit`` / ``out_of_vocab``
(the vocabulary guard), ``labelled_tokens`` / ``documents_started`` / ``padding``
(torchft and the accounting), ``heldout`` (each source's held-out samples, for
validation) and the read-ahead of stores in object storage (``read_ahead_steps``,
``read_ahead``, ``drop_read_ahead``). One store is a mixture of one source whose data
config carries no mixture (``mixture`` is None): its keys are its sample ids and its
plan a ``DataPlan``; a mixture's sources are drawn in exact proportions by a
``MixturePlan`` (seen through ``MixtureStream``). Packing is a property of each
source's map (``packing``), reading from a bucket a property of its store; nothing
outside this package asks which kind a job's data is.

Invariants:
- ``data.plan(config, anchor)`` depends only on the data config, the anchor
  and (for a mixture) the spec it was resolved to: every rank builds the same
  plan (``job.plans.plan_of``). Its keys of step ``s`` are
  ``plan.global_ids(s)``; the rank slices concatenate to them for every DP
  degree dividing the step's batch.
- Row k of ``rows(keys, seq_len)`` is what the source of ``keys[k]`` gives for its
  sample id (``split_keys``), read from that source's store (property-tested).
- A ``JobData`` keeps only its own last plan; nothing here keeps opened stores per
  process.
- Left-out samples (``leave_out``: ``order.exclusions``) are checked against the
  data once; from then on every ``data_config`` binds them (field ``exclude``) and
  every ``plan`` maps past them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_zephon.job.packed import PackedSource
from torchtitan_zephon.job.packing import open_packing, packing_note
from torchtitan_zephon.job.plans import plan_of
from torchtitan_zephon.job.source import Source, Unlabelled, WindowSource
from torchtitan_zephon.job.stores import open_mixture_stores
from torchtitan_zephon.order.data_config import MIXTURE_FIELD, PACKING_FIELD, DataConfig
from torchtitan_zephon.order.exclusions import EXCLUDE_FIELD, Exclusions, SourceRange
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.mixture.config import MixtureConfig, MixtureError
from torchtitan_zephon.order.mixture.spec import MixtureSpec, resolve_mixture
from torchtitan_zephon.order.packing import PackedSamples, packing_field, padding_warning
from torchtitan_zephon.order.store_size import no_sample_text, store_fix
from torchtitan_zephon.order.stream import ID_MASK, STORE_NAME, StreamPlan, split_keys
from torchtitan_zephon.store.format import fingerprint
from torchtitan_zephon.store.group import StoreGroup
from torchtitan_zephon.store.reader import TokenStore


@dataclass(frozen=True)
class Heldout:
    """One source's held-out samples: ``[first, first + count)`` of ``source``."""

    name: str | None  # None: the job's only store
    source: Source
    first: int
    count: int


def source_of(store: TokenStore, seq_len: int, packed: PackedSamples | None = None) -> Source:
    """``store`` read as windows of ``seq_len``, or as its packed samples (``packed``: its
    packing index at seq_len)."""
    return WindowSource(store, seq_len) if packed is None else PackedSource(store, packed)


def as_job_data(
    data: TokenStore | JobData,
    seq_len: int,
    *,
    sample_offset: int = 0,
    num_samples: int | None = None,
) -> JobData:
    """``data`` as a job's data for ``seq_len``: a bare store becomes its windows
    (samples ``[sample_offset, + num_samples)``); job data opened for another seq_len is
    refused."""
    if isinstance(data, TokenStore):  # the one-store case
        return JobData.of_store(data, seq_len, sample_offset=sample_offset, num_samples=num_samples)
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


class JobData:
    """A job's sources and the plan over them: one store (``of_store``: the keys are
    its sample ids, samples ``[sample_offset, sample_offset + num_samples)`` trained,
    the rest at the end held out) or a mixture (``of_mixture`` / ``open_mixture``: key
    ``i << 40 | id`` is sample ``id`` of the ``i``-th source in name order)."""

    def __init__(
        self,
        sources: Sequence[Source],
        seq_len: int,
        *,
        mixture: MixtureSpec | None = None,
        sample_offset: int = 0,
        num_samples: int | None = None,
        path: str | None = None,
    ) -> None:
        self.sources = list(sources)
        self.seq_len = int(seq_len)
        self.mixture = mixture
        self.stores = [s.store for s in self.sources]
        ref = self.stores[0]
        self.vocab_size = ref.vocab_size
        self.tokenizer_hash = ref.tokenizer_hash
        self.packing = self.sources[0].packing
        self.warnings: list[str] = []
        self.exclusions: Exclusions | None = None
        self._plan: tuple[tuple[str, tuple[int, int]], StreamPlan] | None = None
        if mixture is None:
            self._one_store(sample_offset, num_samples)
            self.path = str(ref.path) if path is None else path
            self.names = [STORE_NAME]
            self.fingerprint = ref.fingerprint
        else:
            self._check_mixture(mixture)
            self.path = "mixture" if path is None else path
            self.names = mixture.names
            self.sample_offset = 0
            self.num_samples = sum(int(s.num_samples) for s in mixture.sources)
            self.fingerprint = mixture_store_fingerprint(mixture)
        self._group = (
            StoreGroup(self.stores) if mixture is not None and self.packing == "none" else None
        )

    def _one_store(self, sample_offset: int, num_samples: int | None) -> None:
        """Check and set the one store's trained samples ``[sample_offset, + num_samples)``."""
        source = self.sources[0]
        store, seq_len, available = source.store, self.seq_len, source.available
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
        self.sample_offset = int(sample_offset)
        self.num_samples = int(num_samples)

    def _check_mixture(self, spec: MixtureSpec) -> None:
        names = spec.names
        if names != sorted(names):
            raise MixtureError(f"a mixture's data needs its sources in name order, found {names}.")
        for s in spec.sources:
            if s.num_samples + s.heldout_samples > ID_MASK:
                raise MixtureError(
                    f"mixture source {s.name!r} holds {s.num_samples + s.heldout_samples} "
                    f"samples; a source may hold at most {ID_MASK} (split it into two sources)."
                )

    # ------------------------------------------------------------------ opening

    @classmethod
    def of_store(
        cls,
        store: TokenStore,
        seq_len: int,
        *,
        packed: PackedSamples | None = None,
        sample_offset: int = 0,
        num_samples: int | None = None,
    ) -> JobData:
        """One store, read as windows of ``seq_len`` or as its packed samples (``packed``:
        its packing index at seq_len); samples ``[sample_offset, + num_samples)`` trained
        (None: through the last)."""
        source = source_of(store, seq_len, packed)
        return cls([source], seq_len, sample_offset=sample_offset, num_samples=num_samples)

    @classmethod
    def of_mixture(
        cls,
        spec: MixtureSpec,
        stores: Mapping[str, TokenStore],
        seq_len: int,
        *,
        packed: Mapping[str, PackedSamples] | None = None,
        path: str = "mixture",
    ) -> JobData:
        """The mixture ``spec`` (sources in name order) over its opened stores, each read
        as windows, or as its packed samples (``packed``: each source's packing index)."""
        sources = [
            source_of(stores[n], seq_len, None if packed is None else packed[n]) for n in spec.names
        ]
        return cls(sources, seq_len, mixture=spec, path=path)

    @classmethod
    def open_mixture(
        cls,
        config: MixtureConfig,
        seq_len: int,
        *,
        packing: str = "none",
        default_heldout: int = 0,
        path: str = "mixture",
        progress: bool = False,
        raw: Any = None,
        remote: Any = None,
        cache_dir: str = "",
        workers: int = 1,
        log: Callable[[str], None] | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> JobData:
        """Open the stores of a parsed mixture file and check them against each other
        (one tokenizer, enough samples); MixtureError names the source at fault. Sources
        that name raw inputs are prepared as ``raw`` (a ``cache.RawInputs``) says; sources
        in object storage are read as ``remote`` (a ``store.remote.RemoteOptions``;
        None: its defaults) says. With ``packing`` (not "none") each source packs its own
        documents: its packing index at ``seq_len`` (built on first use in ``cache_dir``;
        ``log`` gets one line per source, ``warn`` a source that pads more than
        ``PADDING_WARNING``), its packed samples counted as the source's samples.

        Every call opens the stores afresh: a job opens its data once and hands the
        object on (the trainer: to the preflight, the loader and the validator)."""
        config = sorted_by_name(config)
        stores = open_mixture_stores(config, progress=progress, raw=raw, remote=remote)
        tokenizer = _job_tokenizer(raw)
        packed: dict[str, PackedSamples] | None = None
        if packing != "none":
            packed = {}
            for name in config.names:
                packed[name], folder = open_packing(
                    stores[name], seq_len, cache_dir=cache_dir, workers=workers, log=log
                )
                if log is not None:
                    note = packing_note(packed[name], stores[name], folder)
                    log(f"mixture source {name!r}: {note}")
                warning = padding_warning(packed[name], f"mixture source {name!r}")
                if warning and warn is not None:
                    warn(warning)
        spec = resolve_mixture(
            config,
            stores,
            seq_len,
            default_heldout=default_heldout,
            tokenizer=tokenizer,
            available=None if packed is None else {n: p.num_samples for n, p in packed.items()},
        )
        return cls.of_mixture(spec, stores, seq_len, packed=packed, path=path)

    def __repr__(self) -> str:
        if self.mixture is None:
            return f"JobData({self.sources[0]!r})"
        return f"JobData({self.path!r}, sources={self.names}, seq_len={self.seq_len})"

    @property
    def what(self) -> str:
        """The data as a message names it: the store, or the mixture and its sources."""
        if self.mixture is None:
            return f"the store {self.path}"
        return f"the mixture {self.path} (sources {', '.join(self.names)})"

    # ------------------------------------------------------------------ the plan

    def leave_out(self, exclusions: Exclusions) -> None:
        """Leave out ``exclusions`` (``order.exclusions``; each entry of a mixture's names
        a source) from now on: checked against each source's training and held-out ids
        (ValueError naming the line), then bound by every data config this data makes."""
        if self.mixture is None:
            total = self.sources[0].available
            ranges = {None: SourceRange(self.sample_offset, self.num_samples, total)}
        else:
            ranges = {
                s.name: SourceRange(0, int(s.num_samples), int(s.num_samples + s.heldout_samples))
                for s in self.mixture.sources
            }
        exclusions.check(ranges)
        self.exclusions = exclusions if exclusions else None
        self._plan = None

    def data_config(
        self, *, seed: int, schedule: BatchSchedule, extra: Mapping[str, Any] | None = None
    ) -> DataConfig:
        """The data config of this data for ``seed`` and ``schedule`` (``extra``: more
        fields, such as skipped steps)."""
        extra = dict(extra or {})
        if self.packing != "none":
            extra[PACKING_FIELD] = packing_field(self.packing)
        extra = _with_exclusions(extra, self.exclusions)
        if self.mixture is not None:
            extra[MIXTURE_FIELD] = self.mixture.to_json()
        return DataConfig.make(
            seq_len=self.seq_len,
            seed=seed,
            schedule=schedule,
            sample_offset=self.sample_offset,
            num_samples=self.num_samples,
            store_fingerprint=self.fingerprint,
            tokenizer_hash=self.tokenizer_hash,
            extra=extra,
        )

    def plan(self, config: DataConfig, anchor: tuple[int, int] = (1, 0)) -> StreamPlan:
        """The plan of ``config`` (made by ``data_config``), counted from ``anchor``; the
        first call also collects a mixture plan's warnings (a source smaller than its
        share of a global batch).

        The job's data owns its plan: it keeps the one it built last (plans are
        immutable), so a loader and its resume at the same anchor, or a loader built
        again on this data, read that plan instead of building it again."""
        if self.mixture is not None and not self.mixture.is_written_as(config.mixture):
            raise MixtureError(
                "the data config's mixture is not this source's mixture; build the config "
                "with the job data's data_config."
            )
        key = (config.fingerprint, (int(anchor[0]), int(anchor[1])))
        if self._plan is None or self._plan[0] != key:
            built = plan_of(config, anchor, spec=self.mixture, exclusions=self.exclusions)
            self._plan = (key, built)
        plan = self._plan[1]
        if self.mixture is not None and not self.warnings:
            self.warnings = list(plan.mixture.warnings)  # type: ignore[attr-defined]
        return plan

    # ------------------------------------------------------------------ the samples

    def _split(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, sample id) of each of ``keys`` (``order.stream.split_keys``; one
        source: the keys are its sample ids)."""
        keys = np.asarray(keys, dtype=np.int64).ravel()
        if len(self.sources) == 1:
            return np.zeros(keys.size, dtype=np.int64), keys
        return split_keys(keys)

    def _by_source(self, keys: np.ndarray) -> list[tuple[np.ndarray, Source, np.ndarray]]:
        """(positions in ``keys``, the source, its sample ids) per source ``keys`` draws
        from, in source order."""
        sources, ids = self._split(keys)
        out = []
        for i, source in enumerate(self.sources):
            at = np.flatnonzero(sources == i)
            if at.size:
                out.append((at, source, ids[at]))
        return out

    def rows(self, keys: np.ndarray, seq_len: int) -> tuple[np.ndarray, Unlabelled | None]:
        """Rows [len(keys), seq_len + 1] of samples ``keys`` in the stores' dtype and the
        inputs among them that train no label (None: every label trained), each read from
        its key's source (which checks what it reads)."""
        if len(self.sources) == 1:  # one source: its keys are its sample ids
            return self.sources[0].rows(keys, seq_len)
        if self._group is not None:  # windows of several stores: one gather
            sources, ids = self._split(keys)
            return self._group.windows(sources, ids, seq_len), None
        out = np.empty((np.size(keys), seq_len + 1), dtype=self.stores[0].dtype)
        ends: list[int] = []
        which: list[int] = []
        pads: list[int] = []
        for at, source, ids in self._by_source(keys):
            out[at], some = source.rows(ids, seq_len)
            if some is not None:  # its rows k are the batch's rows at[k]
                row = at.tolist()
                ends += [row[e // seq_len] * seq_len + e % seq_len for e in some[0]]
                which += [row[k] for k in some[1]]
                pads += some[2]
        return out, ((ends, which, pads) if ends or which else None)

    def windows(self, keys: np.ndarray, seq_len: int) -> np.ndarray:
        """The rows of ``rows``, without the inputs that train no label."""
        if len(self.sources) == 1:
            return self.sources[0].windows(keys, seq_len)
        if self._group is not None:
            sources, ids = self._split(keys)
            return self._group.windows(sources, ids, seq_len)
        out = np.empty((np.size(keys), seq_len + 1), dtype=self.stores[0].dtype)
        for at, source, ids in self._by_source(keys):
            out[at] = source.windows(ids, seq_len)
        return out

    def ignored(self, keys: np.ndarray, seq_len: int) -> np.ndarray:
        """bool [len(keys), seq_len]: the inputs whose label is not trained."""
        out = np.zeros((np.size(keys), seq_len), dtype=bool)
        for at, source, ids in self._by_source(keys):
            out[at] = source.ignored(ids, seq_len)
        return out

    def labelled_tokens(self, keys: np.ndarray) -> int:
        """Labels trained in samples ``keys``, from the sources' maps (no token is read)."""
        return sum(source.labelled_tokens(ids) for _, source, ids in self._by_source(keys))

    def documents_started(self, keys: np.ndarray) -> np.ndarray:
        """Per source (source order): documents whose first token is in samples ``keys``
        (-1: a source whose documents are not counted, ``WindowSource.document_offsets``)."""
        sources, ids = self._split(keys)
        return np.array(
            [s.documents_started(ids[sources == i]) for i, s in enumerate(self.sources)],
            dtype=np.int64,
        )

    def padding(self, keys: np.ndarray) -> np.ndarray | None:
        """Per source (source order): padding inputs of samples ``keys``; None when the
        samples are not packed (windows have none)."""
        if self.packing == "none":
            return None
        sources, ids = self._split(keys)
        return np.array(
            [s.padding(ids[sources == i]) for i, s in enumerate(self.sources)], dtype=np.int64
        )

    def id_limit(self, vocab_size: int | None) -> int | None:
        """Refuse a store whose recorded ids exceed ``vocab_size``; the limit a loader must
        still check per batch (None: every store records its largest id)."""
        limits = [source.id_limit(vocab_size) for source in self.sources]
        return None if all(x is None for x in limits) else int(vocab_size)  # type: ignore[arg-type]

    def out_of_vocab(self, keys: np.ndarray, tokens: np.ndarray, limit: int) -> str:
        """Where the largest id of ``tokens`` (rows of samples ``keys``) is, and what to do."""
        if self.mixture is None:
            return self.sources[0].out_of_vocab(keys, tokens, limit)
        row = int(np.unravel_index(int(np.argmax(tokens)), tokens.shape)[0])
        sources, ids = self._split(np.asarray(keys).ravel()[row : row + 1])
        i = int(sources[0])
        return f"mixture source {self.names[i]!r}: " + self.sources[i].out_of_vocab(
            ids, tokens[row : row + 1], limit
        )

    def heldout(self) -> list[Heldout]:
        """Each source's held-out samples (one store: its last ones), read as the source
        reads them."""
        if self.mixture is None:
            first = self.sample_offset + self.num_samples
            return [Heldout(None, self.sources[0], first, self.sources[0].available - first)]
        return [
            Heldout(s.name, source, int(s.num_samples), int(s.heldout_samples))
            for s, source in zip(self.mixture.sources, self.sources, strict=True)
        ]

    # ------------------------------------------------------------------ read-ahead

    def read_ahead_steps(self) -> int:
        """Steps a loader announces ahead: the largest of a source's (0: all local)."""
        return max(source.read_ahead_steps() for source in self.sources)

    def read_ahead(self, keys: np.ndarray, seq_len: int) -> None:
        """Each source in object storage fetches its samples of ``keys`` (one future step)
        in the background."""
        for _, source, ids in self._by_source(keys):
            source.read_ahead(ids, seq_len)

    def drop_read_ahead(self) -> None:
        for source in self.sources:
            source.drop_read_ahead()

    def settle_read_ahead(self, timeout: float = 120.0) -> None:
        """Wait until every source's read-ahead announced so far has landed (a bench
        counts it as fetched: ``zephon bench corpus``)."""
        for source in self.sources:
            source.settle_read_ahead(timeout)


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
