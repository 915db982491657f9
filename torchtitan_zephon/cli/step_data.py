"""What a step reads, for ``zephon show``, ``where`` and ``spikes``: ``StepData`` (a
plan, the stores it names, the tokenizer, and for a run its last trained step and the
DP degree each step was trained at), the documents a window of tokens belongs to, and
``ShowError``, bad input to these commands (reported by ``cli.main`` in one line).

Invariant: ``StepData`` only reads: the plan gives a step's sample keys, the stores
their tokens and documents; nothing is replayed, so a step is O(1) to show.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from torchtitan_zephon.order.data_config import DataConfig
from torchtitan_zephon.order.layout import part_slice, slice_index
from torchtitan_zephon.order.skips import SkipSteps
from torchtitan_zephon.order.stream import StreamPlan, split_keys
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.tracker.records import ids_digest

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
    packed: list[Any] | None = None
    """A run that packs (``zephon.packing``): each source's store read as packed samples
    (a ``job.source.Source``; None: its store was not found); the sample ids are
    packed sample ids."""
    history: Any = None
    """A run's ``cli.run_history.RunHistory`` (None: a store or a mixture)."""
    job: Any = None
    """A run's: the job of its history whose data config this describes
    (``cli.run_history.TrainedUnder``)."""
    open_job: Callable[[Any], StepData] | None = None
    """A run's: the data of another job of its history."""

    def as_trained(self, step: int) -> StepData:
        """The data ``step`` was trained under: this one for a store, a mixture, a step
        not trained yet or one this data's job trained; else the data of the job that
        trained it. A trained step's recomputed ids are checked against the ids digest
        its log record holds (ShowError when they differ: never other samples)."""
        if self.history is None or self.status(step) != "trained":
            return self
        job = self.history.job_of(step)
        data = self
        if job.key != self.job.key:
            if self.open_job is None:
                raise ShowError(
                    f"step {step} of {self.what} was trained under another data config."
                )
            data = self.open_job(job)
        data.check_logged(step)
        return data

    def check_logged(self, step: int) -> None:
        """ShowError when the ids this data recomputes for a trained ``step`` are not those
        its log record's ids digest names."""
        logged = self.history.logged_ids_digest(step) if self.history is not None else None
        if logged is None or step < self.first_step:
            return
        first, count = self.plan.step_positions(step)
        ids = self.plan.ids_for_positions(first, count)
        if ids_digest(ids, self.config.step_key(step), first) != logged:
            raise ShowError(
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
            raise ShowError(
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


def say_notes(data: StepData, command: str) -> None:
    for note in data.notes:
        print(f"zephon {command}: note: {note}", file=sys.stderr)
