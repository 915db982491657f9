"""What a step reads (``zephon show``, ``where`` and ``spikes`` ask it): ``StepData`` (a
plan, the stores it names, the tokenizer, and for a run its last trained step and the
DP degree each step was trained at), the documents a window of tokens belongs to, and
how it is opened: from the job's data (``of_job_data``: a store or a mixture opened as
the trainer opens them, ``job.data.JobData``) or from a run folder (``open_run``: its
sequence log's newest start or resume event holds the data config, skips included, and
a trained step is described under the data config of the job that trained it,
``run.history``; its stores and tokenizer are found from what the run recorded,
``job.run_data``, the job config it saved, the names given or the builtin data, each
checked against the config's fingerprints; its left-out list from the one given, the
record or the saved job config, checked against the sha256 the config binds). The plan
is the one the trainer's job data builds from that data config (``job.plans.plan_of``).

Invariant: ``StepData`` only reads: the plan gives a step's sample keys, the stores
their tokens and documents; nothing is replayed, so a step is O(1) to show. What the
data cannot answer (a step before the first, a document the store does not hold, a
run's left-out list not found or not the one its data config binds) is a
``StepDataError``, one line.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_zephon.ingest.builtin import builtin_store_path
from torchtitan_zephon.job.data import JobData, source_of
from torchtitan_zephon.job.packing import open_packing
from torchtitan_zephon.job.plans import exclusions_problem, plan_of
from torchtitan_zephon.job.run_data import read_run_data, recorded
from torchtitan_zephon.job.settings import builtin_tokenizer
from torchtitan_zephon.job.stores import open_mixture_stores, open_named_store
from torchtitan_zephon.order.data_config import DataConfig
from torchtitan_zephon.order.exclusions import Exclusions
from torchtitan_zephon.order.layout import part_slice, slice_index
from torchtitan_zephon.order.mixture.config import MixtureConfig
from torchtitan_zephon.order.skips import SkipSteps
from torchtitan_zephon.order.stream import StreamPlan, split_keys
from torchtitan_zephon.run import recorded as runs
from torchtitan_zephon.run.history import RunHistory, TrainedUnder
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.tracker.records import ids_digest

MAX_CHARS = 200
"""Default --max-chars: characters of decoded text shown per sample."""


class StepDataError(ValueError):
    """What a step's data cannot answer, or a run's data that cannot be opened (one line:
    ``zephon`` reports it as it reports every ValueError)."""


@dataclass
class StepData:
    """What a step reads: the plan, the store of each source (None: not found), the
    tokenizer (None: not found) and, for a run, its last trained step."""

    what: str
    plan: StreamPlan
    config: DataConfig
    names: list[str]
    stores: list[TokenStore | None]
    tokenizer: Any
    seq_len: int
    dp_degree: int = 1
    trained_last: int | None = None
    notes: list[str] = field(default_factory=list)
    trained_degree: Callable[[int], int | None] | None = None
    """A run's: the DP degree of the job (start or resume event) that trained a step."""
    packed: list[Any] | None = None
    """A run that packs (``zephon.packing``): each source's store read as packed samples
    (a ``job.source.Source``; None: its store was not found); the sample ids are
    packed sample ids."""
    history: Any = None
    """A run's ``run.history.RunHistory`` (None: a store or a mixture)."""
    job: Any = None
    """A run's: the job of its history whose data config this describes
    (``run.history.TrainedUnder``)."""
    open_job: Callable[[Any], StepData] | None = None
    """A run's: the data of another job of its history."""

    def as_trained(self, step: int) -> StepData:
        """The data ``step`` was trained under: this one for a store, a mixture, a step
        not trained yet or one this data's job trained; else the data of the job that
        trained it. A trained step's recomputed ids are checked against the ids digest
        its log record holds (StepDataError when they differ: never other samples)."""
        if self.history is None or self.status(step) != "trained":
            return self
        job = self.history.job_of(step)
        data = self
        if job.key != self.job.key:
            if self.open_job is None:
                raise StepDataError(
                    f"step {step} of {self.what} was trained under another data config."
                )
            data = self.open_job(job)
        data.check_logged(step)
        return data

    def check_logged(self, step: int) -> None:
        """StepDataError when the ids this data recomputes for a trained ``step`` are not those
        its log record's ids digest names."""
        logged = self.history.logged_ids_digest(step) if self.history is not None else None
        if logged is None or step < self.first_step:
            return
        first, count = self.plan.step_positions(step)
        ids = self.plan.ids_for_positions(first, count)
        if ids_digest(ids, self.config.step_key(step), first) != logged:
            raise StepDataError(
                f"step {step} of {self.what}: the sample ids recomputed from the data config "
                "its log records for that step do not match the ids digest the log holds, so "
                "what it trained cannot be shown (the log, the store or the saved "
                f"zephon.exclude list changed since); `zephon verify {self.history.run}` "
                "checks the log."
            )

    def place(self, step: int, index: int, degree: int) -> dict[str, Any]:
        """Who trains the sample at ``index`` of ``step`` at DP ``degree``: its
        ``dp_rank`` and ``rank_index``; for a step a torchft quorum trained, also its
        ``part`` (of ``parts``) and the replica ``group`` that trained it (None: not
        recorded), the rank being within that group's part."""
        gbs = self.plan.schedule.gbs(step)
        quorum = self.history.quorum_at(step) if self.history is not None else None
        if quorum is None or type(quorum.get("groups")) is not int:
            rank, at = slice_index(index, gbs, degree)
            return {"dp_rank": rank, "rank_index": at}
        parts = int(quorum["groups"])
        for part in range(parts):
            first, size = part_slice(0, gbs, step, part, parts)
            if index < first + size:
                break
        j = index - first
        inner = degree if 1 <= degree <= size else 1
        for rank in range(inner):
            lo, count = part_slice(0, size, step, rank, inner)
            if j < lo + count:
                break
        members = quorum.get("members") or []
        group = members[part] if part < len(members) else None
        return {"dp_rank": rank, "rank_index": j - lo, "part": part, "parts": parts,
                "group": group}  # fmt: skip

    def covers(self, step: int) -> bool:
        """Whether this data describes ``step`` as it was (or will be) trained: always for
        a store or a mixture; for a run, when the job that trained it (a step not trained
        yet: the newest) has this data config."""
        return self.history is None or self.history.job_of(step).key == self.job.key

    def views(self) -> list[StepData]:
        """This data, then that of every other data config of the run's history."""
        if self.history is None or self.open_job is None:
            return [self]
        others = {j.key: j for j in self.history.jobs if j.key != self.job.key}
        return [self, *(self.open_job(j) for j in others.values())]

    @property
    def skips(self) -> SkipSteps:
        return self.config.skip_steps

    @property
    def first_step(self) -> int:
        return self.plan.anchor_step

    def check_step(self, step: int) -> None:
        """Refuse a step the plan does not define (before the first step, past a
        mixture source's max_epochs)."""
        if step < self.first_step:
            after = (
                f" (the run's data config counts positions from step {self.first_step})"
                if self.first_step > 1
                else " (steps are 1-based)"
            )
            raise StepDataError(
                f"step {step} is before the first step {self.first_step} of {self.what}{after}; "
                f"pass --step {self.first_step} or later."
            )
        self.plan.check_max_epochs(step)

    def degree_at(self, step: int) -> tuple[int, str]:
        """The DP degree ``step``'s samples are shown at, and where it comes from:
        "trained" (a run's trained step: the degree of the job that trained it),
        "current" (a run's step not trained yet: the run's newest job's degree) or
        "default" (a store or mixture: ``dp_degree``)."""
        if self.trained_degree is None:
            return self.dp_degree, "default"
        if self.status(step) == "trained":
            degree = self.trained_degree(step)
            if degree is not None:
                return degree, "trained"
        return self.dp_degree, "current"

    def status(self, step: int) -> str:
        """``trained`` (a run's step at or before its last) or ``planned``."""
        if self.trained_last is not None and step <= self.trained_last:
            return "trained"
        return "planned"

    def sample(self, key: int, *, max_chars: int = MAX_CHARS) -> dict[str, Any]:
        """Source, sample id, documents and decoded text of the sample ``key``."""
        sources, ids = split_keys(np.array([key], dtype=np.int64))
        i, sid = int(sources[0]), int(ids[0])
        out: dict[str, Any] = {"source": self.names[i], "sample": sid}
        store = self.stores[i]
        if store is None:
            return out
        packed = None if self.packed is None else self.packed[i]
        if packed is not None:  # whole documents, then padding
            out["documents"] = packed.documents(sid)
            used = sum(d["stop"] - d["start"] for d in out["documents"])
            out["padding"] = self.seq_len - used
            if self.tokenizer is not None:
                tokens = packed.windows(np.array([sid]), self.seq_len)[0, :used]
                text = self.tokenizer.decode(tokens.tolist(), skip_special_tokens=False)
                out["text"] = text if max_chars == 0 or len(text) <= max_chars else text[:max_chars]
                out["text_cut"] = max_chars != 0 and len(text) > max_chars
            return out
        start, stop = sid * self.seq_len, (sid + 1) * self.seq_len  # the input tokens
        out["tokens"] = [start, stop]
        out["documents"] = window_documents(store, start, stop)
        if self.tokenizer is not None:
            tokens = np.asarray(store.window(sid, self.seq_len))[:-1]
            text = self.tokenizer.decode(tokens.tolist(), skip_special_tokens=False)
            out["text"] = text if max_chars == 0 or len(text) <= max_chars else text[:max_chars]
            out["text_cut"] = max_chars != 0 and len(text) > max_chars
        return out


def window_documents(store: TokenStore, start: int, stop: int) -> list[dict[str, int]]:
    """The documents tokens [start, stop) belong to: id, the window's [start, stop)
    within the document, and the document's length."""
    offsets = store.doc_offsets
    if offsets is None:
        return []
    first = int(np.searchsorted(offsets, start, side="right")) - 1
    last = int(np.searchsorted(offsets, stop - 1, side="right")) - 1
    out = []
    for d in range(first, last + 1):
        d0 = int(offsets[d])
        d1 = int(offsets[d + 1]) if d + 1 < len(offsets) else store.num_tokens
        out.append(
            {
                "document": d,
                "start": max(d0, start) - d0,
                "stop": min(d1, stop) - d0,
                "length": d1 - d0,
            }
        )
    return out


def document_span(store: TokenStore, doc: int) -> tuple[int, int]:
    """Tokens [first, end) of document ``doc``; StepDataError when there is no such document."""
    if store.doc_offsets is None:
        raise StepDataError(f"the store {store.path} does not expose its document offsets.")
    n = store.num_documents
    if not 0 <= doc < n:
        raise StepDataError(
            f"document {doc} is not in the store {store.path}, which holds documents 0 .. {n - 1}."
        )
    first = int(store.doc_offsets[doc])
    end = int(store.doc_offsets[doc + 1]) if doc + 1 < n else store.num_tokens
    return first, end


# ---------------------------------------------------------------- opening


def of_job_data(
    data: JobData, config: DataConfig, what: str, tokenizer: str | None = None
) -> StepData:
    """The data a store or a mixture names, opened as the trainer opens them (``data``,
    left-out samples set) under ``config`` (made by ``data.data_config``); ``tokenizer``:
    a folder to decode with (else the builtin tokenizer, when it is the store's)."""
    names = list(data.names) if data.mixture is not None else [""]
    found, note = find_tokenizer(config.tokenizer_hash, [tokenizer])
    step_data = StepData(
        what, data.plan(config), config, names, list(data.stores), found, data.seq_len
    )
    if note:
        step_data.notes.append(note)
    return step_data


def open_run(
    run: Path,
    *,
    store: str | None = None,
    mixture: str | None = None,
    tokenizer: str | None = None,
    exclude: str | None = None,
) -> StepData:
    """The data of the run folder ``run`` under its newest job's data config; a trained
    step is described under the data config of the job that trained it
    (``StepData.as_trained``). ``store``, ``mixture``, ``tokenizer`` and ``exclude``:
    where the run's data is when what it recorded does not say (each checked against the
    data config's fingerprints and sha256)."""
    given = _Given(store, mixture, tokenizer, exclude)
    history = RunHistory(run)
    opened: dict[Any, StepData] = {}

    def open_job(job: TrainedUnder) -> StepData:
        if job.key not in opened:
            try:
                opened[job.key] = _open_job(run, given, history, job)
            except StepDataError as e:
                if job is history.newest:
                    raise
                raise StepDataError(
                    f"the steps after {job.event.get('from_step')} up to the next start or "
                    f"resume of the run {run} were trained under an earlier data config "
                    f"(fingerprint {job.config.fingerprint[:12]}), which cannot be opened "
                    f"here: {e}"
                ) from None
        return opened[job.key]

    data = open_job(history.newest)
    data.open_job = open_job
    return data


@dataclass(frozen=True)
class _Given:
    """Where a run's data is when its record does not say (``open_run``'s keywords)."""

    store: str | None
    mixture: str | None
    tokenizer: str | None
    exclude: str | None


def _open_job(run: Path, given: _Given, history: RunHistory, job: TrainedUnder) -> StepData:
    """The run's data under the data config of ``job`` (one of its history's)."""
    config = job.config
    saved = runs.saved_config(run)
    saved_job = saved[1] if saved else {}
    zephon = saved_job.get("zephon") if isinstance(saved_job.get("zephon"), dict) else {}
    record = read_run_data(run)  # what Zephon recorded at the run's newest start
    exclude = recorded(record, "exclude") or zephon.get("exclude")
    exclusions = _run_exclusions(run, config, given.exclude, exclude)
    plan = plan_of(config, job.anchor, exclusions=exclusions)
    notes: list[str] = []
    if config.mixture is None:
        names = [""]
        candidates = [
            given.store,
            recorded(record, "store", "opened"),
            recorded(record, "store", "given"),
            zephon.get("store"),
        ]
        stores = [_run_store(config, candidates, notes)]
    else:
        names = list(plan.names)
        mixtures = [given.mixture, recorded(record, "mixture", "given"), zephon.get("mixture")]
        sources = record["mixture"].get("sources") if recorded(record, "mixture", "given") else {}
        stores = _run_mixture_stores(config, mixtures, notes, sources)
    assets = saved_job.get("hf_assets_path")
    if assets is None and isinstance(saved_job.get("model"), dict):
        assets = saved_job["model"].get("hf_assets_path")
    folders = [given.tokenizer, recorded(record, "tokenizer"), assets]
    tokenizer, note = find_tokenizer(config.tokenizer_hash, folders)
    if note:
        notes.append(note)
    packed = _run_packed(config, stores) if config.packing != "none" else None
    return StepData(
        f"the run {run}",
        plan,
        config,
        names,
        stores,
        tokenizer,
        config.seq_len,
        dp_degree=history.newest.dp_degree or 1,
        trained_last=history.trained_last,
        notes=notes,
        trained_degree=lambda step: history.job_of(step).dp_degree,
        packed=packed,
        history=history,
        job=job,
    )


def _load_exclude(path: str, setting: str = "--exclude") -> Exclusions:
    """The left-out list of ``path`` (ValueError, one line naming the file's line, when it
    cannot be read or parsed)."""
    return Exclusions.load(path, setting)


def _run_packed(config: DataConfig, stores: list[TokenStore | None]) -> list[Any]:
    """A packing run's stores (one per source) as packed samples (None: not found)."""

    return [
        None if st is None else source_of(st, config.seq_len, open_packing(st, config.seq_len)[0])
        for st in stores
    ]


def _run_exclusions(
    run: Path, config: DataConfig, given: str | None, saved: Any
) -> Exclusions | None:
    """The left-out list the run's data config binds (only its entries' sha256): from
    ``--exclude FILE``, else the saved job config's zephon.exclude (read only when the
    config leaves samples out); StepDataError, one line, when it is not that list."""
    what = f"the run {run}'s data config"
    if given:
        exclusions = _load_exclude(given)
    elif config.exclude and isinstance(saved, str) and saved:
        if not Path(saved).is_file():
            raise StepDataError(
                f"{exclusions_problem(config, None, what)}; its saved job config names "
                f"zephon.exclude {saved}, which is not a file here: pass --exclude FILE, the "
                "zephon.exclude list the run was trained with."
            )
        exclusions = _load_exclude(saved, "the run's saved zephon.exclude")
    else:
        exclusions = None
    problem = exclusions_problem(config, exclusions, what)
    if problem is None:
        return exclusions
    if not config.exclude:
        raise StepDataError(f"{problem}: drop --exclude.")
    where = "" if exclusions else " (its saved job config names no zephon.exclude)"
    raise StepDataError(
        f"{problem}{where}: pass --exclude FILE, the zephon.exclude list the run was trained with."
    )


def _run_store(config: DataConfig, candidates: list[Any], notes: list[str]) -> TokenStore | None:
    """The run's store: the first of the candidates (a --store, the store the run
    recorded, opened then as given, the saved zephon.store, then the builtin store)
    whose fingerprint is the run's."""
    tried = []
    for value in [c for c in candidates if isinstance(c, str) and c] + [None]:
        try:
            store = (
                TokenStore.open(builtin_store_path(progress=False))
                if value is None
                else open_named_store(value, None)
            )
        except (ValueError, OSError) as e:
            tried.append(f"{value or 'the builtin store'} ({e})")
            continue
        if store.fingerprint == config.store_fingerprint:
            return store
        tried.append(f"{store.path} (fingerprint {store.fingerprint[:12]})")
    notes.append(
        f"the run's store (fingerprint {config.store_fingerprint[:12]}) was not found "
        f"(tried {'; '.join(tried)}): documents and text are left out; pass --store STORE."
    )
    return None


def _run_mixture_stores(
    config: DataConfig, candidates: list[Any], notes: list[str], opened: Any = None
) -> list[TokenStore | None]:
    """Each source's store of a run's mixture, from a mixture file (--mixture, the
    recorded or saved zephon.mixture) whose source of that name has the run's
    fingerprint, else from the store the run opened for it (``opened``: name ->
    location, ``zephon/run_data.json``)."""

    spec = config.mixture or {}
    wanted = {s["name"]: s["store_fingerprint"] for s in spec.get("sources", [])}
    names = sorted(wanted)
    found: dict[str, TokenStore] = {}
    for value in [c for c in candidates if isinstance(c, str) and c]:
        try:
            stores = open_mixture_stores(MixtureConfig.load(value))
        except (ValueError, OSError) as e:
            notes.append(f"cannot open the mixture {value}: {e}")
            continue
        for name, store in stores.items():
            if name not in found and wanted.get(name) == store.fingerprint:
                found[name] = store
    for name in [n for n in names if n not in found]:
        location = opened.get(name) if isinstance(opened, dict) else None
        if isinstance(location, str) and location:
            try:
                store = open_named_store(location, None)
            except (ValueError, OSError):
                continue
            if store.fingerprint == wanted[name]:
                found[name] = store
    lost = [n for n in names if n not in found]
    if lost:
        notes.append(
            f"the stores of mixture sources {', '.join(repr(n) for n in lost)} were not found "
            "with the run's fingerprints: their documents and text are left out; pass "
            "--mixture FILE."
        )
    return [found.get(n) for n in names]


def find_tokenizer(sha256: str, candidates: list[Any]) -> tuple[Any, str | None]:
    """The first candidate folder (then the builtin tokenizer) whose tokenizer.json is the
    store's (sha256), loaded; else (None, a note)."""
    from tokenizers import Tokenizer

    folders = [Path(c) for c in candidates if isinstance(c, str) and c]
    folders.append(builtin_tokenizer()[0])
    for folder in folders:
        path = folder / "tokenizer.json" if folder.is_dir() else folder
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if hashlib.sha256(data).hexdigest() == sha256:
            return Tokenizer.from_str(data.decode()), None
    return None, (
        f"no tokenizer.json with the store's sha256 {sha256[:12]} found (tried "
        f"{', '.join(str(f) for f in folders)}): text is left out; pass --tokenizer DIR."
    )
