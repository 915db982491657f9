"""``zephon show``: what a step trains on, sample by sample (past or future steps).

Role: opens the data a step reads (``StepData``: a plan, the stores it names, the
tokenizer) from a run folder (its sequence log's newest start or resume event
holds the data config, skips included; its stores and tokenizer are found from what
the run recorded (``job.run_data``), the job config it saved, the command line or the
builtin data, each checked against the config's fingerprints; its left-out list,
``zephon.exclude``, from ``--exclude FILE``, the record or the saved job config,
checked against the sha256 the config binds), or from a store or a mixture file with
``--seq-len``, ``--global-batch-size`` and ``--seed``. Words: a step's **slots** are
its place in the batch schedule (``[first, first + GBS)``, the sequence log's
``first_position``; skips and left-out samples never move them); a sample's
**position** is its index in its source's stream (past the skips and the left-out
samples: epoch = position // the source's samples), as ``where`` says
``stream_position``. For each sample of the step (or of one DP
rank's slice, or one sample) it prints its source, sample id, position, the documents its
``seq_len`` input tokens belong to (id, the window's offsets within the document,
the document's length) and the decoded text. ``zephon where`` and ``zephon
spikes`` open their data here too.

Invariants:
- The sample ids shown for a step are the plan's (``job.plans.plan_of`` of the
  run's data config, or ``StoreData`` / ``MixtureData.plan``): those ``zephon
  plan`` prints and the trainer's loader reads, at any DP degree.
- The cost is O(1) in the step number: one plan lookup of the step's slots
  and the step's samples read from the store; nothing is replayed.
- A step before the first, past a mixture source's ``max_epochs``, a DP rank or
  a sample out of range, a run's left-out list not found or not the one its data
  config binds, is a one-line error (exit status 2), never a traceback.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_zephon import runs
from torchtitan_zephon.cli.args import int_in
from torchtitan_zephon.cli.inspect_run import is_run
from torchtitan_zephon.cli.plan import (
    _open_store,
    _raw_inputs,
    _schedule,
    _skip_steps,
    add_exclude_argument,
    leave_out,
    load_exclude,
)
from torchtitan_zephon.job.plans import exclusions_problem, plan_of
from torchtitan_zephon.job.run_data import read_run_data, recorded
from torchtitan_zephon.order.data_config import SKIP_FIELD, DataConfig
from torchtitan_zephon.order.exclusions import Exclusions
from torchtitan_zephon.order.layout import BatchSchedule, Layout
from torchtitan_zephon.order.mixture.stream import MixtureStream
from torchtitan_zephon.order.skips import SkipSteps
from torchtitan_zephon.order.stream import StreamPlan, split_keys
from torchtitan_zephon.store.reader import TokenStore

MAX_CHARS = 200
"""Default --max-chars: characters of decoded text shown per sample."""


class ShowError(ValueError):
    """Bad input to show / where / spikes (reported by ``cli.main`` in one line)."""


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
            raise ShowError(
                f"step {step} is before the first step {self.first_step} of {self.what}{after}; "
                f"pass --step {self.first_step} or later."
            )
        if isinstance(self.plan, MixtureStream):
            self.plan.mixture.check_max_epochs(step)

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
    """Tokens [first, end) of document ``doc``; ShowError when there is no such document."""
    if store.doc_offsets is None:
        raise ShowError(f"the store {store.path} does not expose its document offsets.")
    n = store.num_documents
    if not 0 <= doc < n:
        raise ShowError(
            f"document {doc} is not in the store {store.path}, which holds documents 0 .. {n - 1}."
        )
    first = int(store.doc_offsets[doc])
    end = int(store.doc_offsets[doc + 1]) if doc + 1 < n else store.num_tokens
    return first, end


# ---------------------------------------------------------------- arguments


def add_data_arguments(p: argparse.ArgumentParser, *, target: str = "TARGET") -> None:
    """The flags that name the data: a run folder or a store (positional), or a mixture."""
    p.add_argument(
        "target",
        nargs="?",
        metavar=target,
        help="a run folder (TorchTitan dump folder: its data config, skips included, comes "
        "from its sequence log) or a token store (then --seq-len, --global-batch-size, --seed)",
    )
    p.add_argument(
        "--store",
        metavar="STORE",
        help="with a run: where its store is when the saved job config does not say "
        "(checked against the run's store fingerprint)",
    )
    p.add_argument(
        "--mixture",
        metavar="FILE",
        help="a mixture file (TOML [[source]] / [[schedule]]): instead of a store, or with a run "
        "whose saved config does not name it",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="folder holding the tokenizer.json to decode with (default: the run's "
        "hf_assets_path, else the builtin tokenizer, when it is the store's)",
    )
    p.add_argument("--seq-len", type=int_in(1), default=None, metavar="L")
    p.add_argument(
        "--global-batch-size", type=_schedule, default=None, metavar="G",
        help="'64' or a schedule '1:64,1000:128'",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=None, metavar="S")
    p.add_argument(
        "--skip-steps", type=_skip_steps, default=SkipSteps(), metavar="S:N,...",
        help="with a store or mixture: the trainer's zephon.skip_steps",
    )  # fmt: skip
    p.add_argument(
        "--heldout-samples", type=int_in(0), default=0, metavar="N",
        help="with a store or mixture: the job's zephon.heldout_samples (default 0)",
    )  # fmt: skip
    add_exclude_argument(
        p, "; with a run: the list it was trained with, when its saved job config does not "
        "name it (checked against the sha256 its data config binds)",
    )  # fmt: skip


def open_step_data(args: argparse.Namespace, command: str) -> StepData:
    """The data ``args`` name (a run, a store or a mixture), opened once."""
    args.text_field, args.split, args.cache_dir, args.workers = "text", "", "", 1
    target = args.target
    if target is not None and is_run(Path(target)):
        given = [
            f for f in ("seq_len", "global_batch_size", "seed") if getattr(args, f) is not None
        ]
        if given or args.skip_steps:
            flags = ", ".join(
                "--" + f.replace("_", "-") for f in given + ["skip_steps"] * bool(args.skip_steps)
            )
            raise ShowError(
                f"{target} is a run folder: its sequence log's data config decides the data "
                f"(seq_len, batch schedule, seed, skip_steps); drop {flags}."
            )
        return _open_run(Path(target), args)
    if target is None and not args.mixture:
        raise ShowError(
            f"zephon {command} needs a run folder or a store (positional), or --mixture FILE."
        )
    if (
        target is not None
        and not Path(target).exists()
        and not target.startswith(("builtin:", "s3://", "gs://", "az://"))
    ):
        raise ShowError(
            f"{target} does not exist: expected a run folder (TorchTitan dump folder) or a token store."
        )
    missing = [f for f in ("seq_len", "global_batch_size", "seed") if getattr(args, f) is None]
    if missing:
        flags = ", ".join("--" + f.replace("_", "-") for f in missing)
        what = "a store" if target is not None else "a mixture"
        raise ShowError(
            f"with {what} (not a run folder) zephon {command} needs {flags}: the job's "
            "training.seq_len, training.global_batch_size and zephon.seed."
        )
    if target is not None and args.mixture:
        raise ShowError("give a store or --mixture FILE, not both.")
    return _open_given(args, command)


def _open_given(args: argparse.Namespace, command: str) -> StepData:
    from torchtitan_zephon.job.data import MixtureData
    from torchtitan_zephon.job.settings import store_source
    from torchtitan_zephon.order.mixture.config import MixtureConfig

    schedule: BatchSchedule = args.global_batch_size
    extra = {SKIP_FIELD: args.skip_steps.to_json()} if args.skip_steps else {}
    raw = _raw_inputs(args, command)
    if args.mixture:
        data = MixtureData.open(
            MixtureConfig.load(args.mixture),
            args.seq_len,
            default_heldout=args.heldout_samples,
            path=args.mixture,
            raw=raw,
        )
        leave_out(data, args.exclude)
        config = data.data_config(seed=args.seed, schedule=schedule, extra=extra)
        plan: StreamPlan = data.plan(config)
        stores: list[TokenStore | None] = list(data.stores)
        what = f"the mixture {args.mixture}"
        names = list(data.names)
    else:
        store = _open_store(args.target, raw)
        what = f"the store {args.target}"
        source = store_source(store, args.seq_len, args.heldout_samples, schedule, what=what)
        leave_out(source, args.exclude)
        config = source.data_config(seed=args.seed, schedule=schedule, extra=extra)
        plan = source.plan(config)
        stores, names = [store], [""]
    tokenizer, note = _tokenizer(config.tokenizer_hash, [args.tokenizer])
    data = StepData(what, plan, config, names, stores, tokenizer, args.seq_len)
    if note:
        data.notes.append(note)
    return data


def _last_trained(path: Path) -> int:
    """The last step of the log's effective history, from its last whole line: a record
    (its step) or an event (its from_step: the steps after it are superseded). Records
    are appended in step order after the event they follow, so the tail decides; O(1)
    in the log's length (the chain is ``zephon verify``'s to check)."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        block = 1 << 16
        while True:
            f.seek(max(0, size - block))
            lines = f.read(block).split(b"\n")
            if size > block:
                lines = lines[1:]  # the first may be cut
            for raw in reversed(lines):
                try:
                    entry = json.loads(raw)
                except (ValueError, RecursionError):
                    continue  # blank, or a last line cut short by a crash
                if isinstance(entry, dict):
                    key = "from_step" if "event" in entry else "step"
                    if type(entry.get(key)) is int:
                        return int(entry[key])
            if block >= size:
                return 0
            block *= 4


def _newest_event(run: Path) -> dict[str, Any]:
    reader = runs.log_reader(run)
    events = [e for e in reader.events if e.get("event") in ("start", "resume")]
    events = [e for e in events if isinstance(e.get("data_config"), dict)]
    if not events:
        raise ShowError(
            f"the run {run} has no start or resume event with a data config in its sequence "
            "log (zephon/sequence_log.jsonl): it was not trained with Zephon's tracker "
            "(zephon.audit off?). Name the data instead: a store with --seq-len, "
            "--global-batch-size and --seed."
        )
    starts = [i for i, e in enumerate(events) if e.get("event") == "start"]
    history = events[starts[-1] :] if starts else events  # a start begins a new history
    return {
        **events[-1],
        "_trained": _last_trained(reader.path),
        "_anchor": _anchor(history),
        "_reader": reader,
    }


def _anchor(history: list[dict[str, Any]]) -> tuple[int, int]:
    """The position anchor of the newest job's data config, from the run's history (its
    start and resume events from the last start on). Only a resume that accepted a batch
    schedule change moves it (``accepted_changes`` names "schedule", ``order.resume``):
    to (k + 1, the first position of step k + 1 under the job that trained step k), k
    its from_step; any other resume keeps that job's anchor."""
    anchors: list[tuple[int, int]] = []
    for i, e in enumerate(history):
        k = e.get("from_step")
        if i == 0 or e.get("event") == "start" or not isinstance(k, int) or k < 1:
            anchors.append((1, 0))
            continue
        j = max((j for j in range(i) if _int(history[j].get("from_step")) < k), default=0)
        anchor = anchors[j]  # the job that trained step k
        accepted = e.get("accepted_changes")
        if isinstance(accepted, list) and "schedule" in accepted:
            schedule = DataConfig.from_dict(history[j]["data_config"]).batch_schedule()
            anchor = (k + 1, Layout(schedule, anchor).step_positions(k + 1)[0])
        anchors.append(anchor)
    return anchors[-1]


def _int(value: Any) -> int:
    return value if isinstance(value, int) else 0


def _checkpoint_folder(run: Path) -> str:
    from torchtitan_zephon.cli.checkpoint_heads import _checkpoint_folder as folder

    return folder(run)


def _open_run(run: Path, args: argparse.Namespace) -> StepData:
    from torchtitan_zephon.order.data_config import DataStateMismatch

    event = _newest_event(run)
    try:
        config = DataConfig.from_dict(event["data_config"])
    except DataStateMismatch as e:
        raise ShowError(f"the run {run}'s sequence log holds a bad data config: {e}") from None
    saved = runs.saved_config(run)
    saved_job = saved[1] if saved else {}
    zephon = saved_job.get("zephon") if isinstance(saved_job.get("zephon"), dict) else {}
    record = read_run_data(run)  # what Zephon recorded at the run's newest start
    exclude = recorded(record, "exclude") or zephon.get("exclude")
    exclusions = _run_exclusions(run, config, args.exclude, exclude)
    plan = plan_of(config, event["_anchor"], exclusions=exclusions)
    notes: list[str] = []
    if config.mixture is None:
        names = [""]
        given = [
            args.store,
            recorded(record, "store", "opened"),
            recorded(record, "store", "given"),
        ]
        stores = [_run_store(config, [*given, zephon.get("store")], notes)]
    else:
        assert isinstance(plan, MixtureStream)
        names = list(plan.names)
        mixtures = [args.mixture, recorded(record, "mixture", "given"), zephon.get("mixture")]
        sources = record["mixture"].get("sources") if recorded(record, "mixture", "given") else {}
        stores = _run_mixture_stores(config, mixtures, notes, sources)
    assets = saved_job.get("hf_assets_path")
    if assets is None and isinstance(saved_job.get("model"), dict):
        assets = saved_job["model"].get("hf_assets_path")
    folders = [args.tokenizer, recorded(record, "tokenizer"), assets]
    tokenizer, note = _tokenizer(config.tokenizer_hash, folders)
    if note:
        notes.append(note)
    reader = event["_reader"]

    def trained_degree(step: int) -> int | None:
        return _degree(reader.event_for(step))

    return StepData(
        f"the run {run}",
        plan,
        config,
        names,
        stores,
        tokenizer,
        config.seq_len,
        dp_degree=_degree(event) or 1,
        trained_last=event["_trained"],
        notes=notes,
        trained_degree=trained_degree,
    )


def _degree(event: dict[str, Any] | None) -> int | None:
    """The DP degree a start or resume event records (None: not recorded)."""
    dp = None if event is None else event.get("dp_degree")
    return dp if type(dp) is int and dp >= 1 else None


def _run_exclusions(
    run: Path, config: DataConfig, given: str | None, saved: Any
) -> Exclusions | None:
    """The left-out list the run's data config binds (only its entries' sha256): from
    ``--exclude FILE``, else the saved job config's zephon.exclude (read only when the
    config leaves samples out); ShowError, one line, when it is not that list."""
    what = f"the run {run}'s data config"
    if given:
        exclusions = load_exclude(given)
    elif config.exclude and isinstance(saved, str) and saved:
        if not Path(saved).is_file():
            raise ShowError(
                f"{exclusions_problem(config, None, what)}; its saved job config names "
                f"zephon.exclude {saved}, which is not a file here: pass --exclude FILE, the "
                "zephon.exclude list the run was trained with."
            )
        exclusions = load_exclude(saved, "the run's saved zephon.exclude")
    else:
        exclusions = None
    problem = exclusions_problem(config, exclusions, what)
    if problem is None:
        return exclusions
    if not config.exclude:
        raise ShowError(f"{problem}: drop --exclude.")
    where = "" if exclusions else " (its saved job config names no zephon.exclude)"
    raise ShowError(
        f"{problem}{where}: pass --exclude FILE, the zephon.exclude list the run was trained with."
    )


def _run_store(config: DataConfig, candidates: list[Any], notes: list[str]) -> TokenStore | None:
    """The run's store: the first of the candidates (a --store, the store the run
    recorded, opened then as given, the saved zephon.store, then the builtin store)
    whose fingerprint is the run's."""
    from torchtitan_zephon.ingest.builtin import builtin_store_path

    tried = []
    for value in [c for c in candidates if isinstance(c, str) and c] + [None]:
        try:
            store = (
                TokenStore.open(builtin_store_path(progress=False))
                if value is None
                else _open_store(value, None)
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
    from torchtitan_zephon.job.stores import open_mixture_stores
    from torchtitan_zephon.order.mixture.config import MixtureConfig

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
                store = _open_store(location, None)
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


def _tokenizer(sha256: str, candidates: list[Any]) -> tuple[Any, str | None]:
    """The first candidate folder (then the builtin tokenizer) whose tokenizer.json is the
    store's (sha256), loaded; else (None, a note)."""
    from tokenizers import Tokenizer

    from torchtitan_zephon.job.settings import builtin_tokenizer

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


# ---------------------------------------------------------------- the command


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "show",
        help="what a step trains on: sources, sample ids, documents, text",
        description="Print, for each sample of a step (past or future), its source, sample "
        "id, the documents its seq_len input tokens belong to (id, [start:stop) within the "
        "document, /length) and the decoded text. O(1) in the step number.",
    )
    add_data_arguments(p, target="RUN")
    p.add_argument("--step", type=int, required=True, metavar="N", help="the step (1-based)")
    p.add_argument(
        "--dp-degree", type=int_in(1), default=None, metavar="D",
        help="DP degree for --dp-rank (default: for a run, the degree the step was trained "
        "at, or the run's newest for a step not trained yet; else 1)",
    )  # fmt: skip
    p.add_argument(
        "--dp-rank", type=int_in(0), default=None, metavar="R", help="one DP rank's slice"
    )
    p.add_argument(
        "--sample", type=int_in(0), default=None, metavar="K",
        help="only the K-th sample of the step (of the rank's slice with --dp-rank), from 0",
    )  # fmt: skip
    p.add_argument(
        "--max-chars", type=int_in(0), default=MAX_CHARS, metavar="C",
        help=f"characters of text per sample (default {MAX_CHARS}; 0: all)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON object for the step")
    return p


def step_samples(
    data: StepData,
    step: int,
    *,
    dp_rank: int | None = None,
    dp_degree: int | None = None,
    sample: int | None = None,
    max_chars: int = MAX_CHARS,
) -> dict[str, Any]:
    """The step's samples (all, one rank's slice, or one) as ``show`` prints them."""
    data.check_step(step)
    degree, degree_from = (dp_degree, "option") if dp_degree else data.degree_at(step)
    first, gbs = data.plan.step_positions(step)
    if dp_rank is not None:
        if dp_rank >= degree:
            raise ShowError(
                f"--dp-rank {dp_rank} is out of range: DP degree {degree} has ranks 0 .. "
                f"{degree - 1} (set another with --dp-degree)."
            )
        if gbs % degree:
            raise ShowError(
                f"step {step}'s global batch of {gbs} does not split over DP degree {degree}."
            )
    per_rank = gbs // degree if gbs % degree == 0 else gbs
    lo, count = (first, gbs) if dp_rank is None else (first + dp_rank * per_rank, per_rank)
    if sample is not None:
        if sample >= count:
            what = f"DP rank {dp_rank}'s slice" if dp_rank is not None else f"step {step}"
            raise ShowError(
                f"--sample {sample} is out of range: {what} holds samples 0 .. {count - 1}."
            )
        lo, count = lo + sample, 1
    keys = data.plan.ids_for_positions(lo, count)
    positions = data.plan.positions_of(lo, count)
    samples = []
    for k, (key, position) in enumerate(zip(keys.tolist(), positions.tolist(), strict=True)):
        index = lo - first + k
        entry = {
            "index": index,
            "dp_rank": index // per_rank,
            **data.sample(key, max_chars=max_chars),
            "position": position,
        }
        samples.append(entry)
    return {
        "step": step,
        "status": data.status(step),
        "slots": [first, first + gbs],
        "global_batch_size": gbs,
        "dp_degree": degree,
        "dp_degree_from": degree_from,
        "samples": samples,
    }


def format_sample(s: dict[str, Any], indent: str = "  ") -> list[str]:
    source = f"source {s['source']}  " if s["source"] else ""
    docs = ", ".join(
        f"{d['document']}[{d['start']}:{d['stop']})/{d['length']}" for d in s.get("documents", [])
    )
    at = f"  position {s['position']}" if "position" in s else ""
    head = f"{indent}[{s['index']}] rank {s['dp_rank']}  {source}sample {s['sample']}{at}"
    lines = [head + (f"  docs {docs}" if docs else "")]
    if "text" in s:
        lines.append(
            f"{indent}    {json.dumps(s['text'], ensure_ascii=False)}{' ...' if s['text_cut'] else ''}"
        )
    return lines


DEGREE_FROM = {
    "trained": " (as trained)",
    "current": " (not trained yet: the run's current layout)",
    "option": " (--dp-degree)",
    "default": "",
}
"""How ``show`` says where a step's DP degree comes from (``StepData.degree_at``)."""


def format_step(info: dict[str, Any], what: str) -> list[str]:
    first, end = info["slots"]
    lines = [
        f"step {info['step']} of {what} ({info['status']}): slots {first}..{end - 1}, "
        f"{info['global_batch_size']} samples, DP degree {info['dp_degree']}"
        + DEGREE_FROM[info["dp_degree_from"]]
    ]
    for s in info["samples"]:
        lines += format_sample(s)
    return lines


def say_notes(data: StepData, command: str) -> None:
    for note in data.notes:
        print(f"zephon {command}: note: {note}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    data = open_step_data(args, "show")
    info = step_samples(
        data,
        args.step,
        dp_rank=args.dp_rank,
        dp_degree=args.dp_degree,
        sample=args.sample,
        max_chars=args.max_chars,
    )
    say_notes(data, "show")
    if args.json:
        print(json.dumps(info, ensure_ascii=False))
    else:
        print("\n".join(format_step(info, data.what)))
    return 0
