"""The resume rule: may a saved data state continue under the current data config?

Role: ``check_resume(saved, current, allow_changes, first_correction=...)``
compares a checkpoint's ``DataState`` with the job's ``DataConfig`` and returns a
``ResumeDecision`` (the anchor the current schedule counts positions from, what
was accepted) or raises ``DataStateMismatch`` naming every refused change with the
opt-in that accepts it. Where the saved next step starts under the current
schedule is the layout's answer (``order.layout.Layout``); the first step a
mixture rule corrects comes from the job's data, which owns the plans
(``first_correction``): this module builds none.

Invariants: ``check_resume`` accepts exactly when every differing field is
allowed, and then the current plan continues at the saved consumed position: no
position is skipped or repeated. A batch schedule or a mixture weight schedule
that differs only for untrained steps is an exact continuation (``extended``); a
mixture whose sources or trained steps' weights changed is the field ``mixture``
(its derived ``store_fingerprint`` / ``num_samples`` go with it). A ``seq_len``
change is named once with what follows from it over the same stores (the sample
counts, a mixture's per-source counts) and accepted by the one opt-in
``seq_len``; a refusal lists every change, never only the first. A mixture saved
under an older rule (``zephon-mixture/1``) is refused only when the current rule
corrects a trained step; when it corrects no step at all the run continues under
the saved rule (``ResumeDecision.config``), so its steps' ids digests keep
binding it. Skip entries (``order.skips``) at untrained steps may be added, changed
or dropped (``extended``, with a note per added entry); changing an entry at a
trained step is the field ``skip_steps``. A skip at a trained step that covers
untrained steps fixes their batch sizes and weights (what it skipped is what they
draw): a schedule change before the end of its range is refused like a change of
the past. Left-out entries (``order.exclusions``) follow the skips' rule: entries
with from_step >= next_step may be added, changed or dropped (``extended``, a note
per added entry); changing one with from_step < next_step is the field ``exclude``
(compared by its ids' sha256: the list's content, not its file).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torchtitan_zephon.order.data_config import (
    MIXTURE_FIELD,
    SKIP_FIELD,
    DataConfig,
    DataStateMismatch,
    config_text,
)
from torchtitan_zephon.order.exclusions import EXCLUDE_FIELD, describe_saved, entries_up_to
from torchtitan_zephon.order.layout import BatchSchedule, Layout
from torchtitan_zephon.order.mixture.config import MixtureError
from torchtitan_zephon.order.mixture.spec import MixtureSpec, past_changes
from torchtitan_zephon.order.skips import SkipSteps
from torchtitan_zephon.order.state import DataState

# allow_changes aliases: one user-facing name can accept several config fields.
ALIASES = {
    "store": ("store_fingerprint", "num_samples"),
    "tokenizer": ("tokenizer_hash",),
    "mixture": ("mixture", "store_fingerprint", "num_samples"),
}


def allowed_fields(allow_changes: Iterable[str] | str, config: DataConfig) -> set[str] | bool:
    """The config fields ``allow_changes`` opens (``True``: all); unknown names raise."""
    names = [allow_changes] if isinstance(allow_changes, str) else list(allow_changes)
    if "all" in names:
        return True
    fields = set(config.to_dict()) | {SKIP_FIELD, EXCLUDE_FIELD}  # also when none is set
    allowed: set[str] = set()
    for name in names:
        if name in ALIASES:
            allowed.update(ALIASES[name])
        elif name in fields:
            allowed.add(name)
        else:
            raise ValueError(
                f"unknown allow_changes entry {name!r}; expected one of "
                f"{', '.join(sorted(fields | set(ALIASES) | {'all'}))}."
            )
    return allowed


@dataclass(frozen=True)
class ResumeDecision:
    """What ``check_resume`` accepted."""

    anchor: tuple[int, int]
    """(step, position) the current schedule counts positions from."""
    accepted: tuple[str, ...] = ()
    """Differing fields accepted through ``allow_changes``."""
    extended: tuple[str, ...] = ()
    """Schedules ("schedule": the batch schedule, "mixture": a mixture's weight schedule)
    that changed only for steps not yet trained: an exact continuation."""
    notes: tuple[str, ...] = ()
    """Other accepted differences, in sentences: a mixture rule update that corrects
    no step of the schedule, or first corrects one not yet trained."""
    config: DataConfig | None = None
    """The config to continue under when it is not the current one: the current
    config keeping the saved mixture rule, when the current rule corrects no step
    of the schedule (both rules draw the same samples), so the steps' ids digests
    keep binding the rule the run started with and it still verifies against an
    uninterrupted run."""


def skips_kept(saved: DataState, current: DataConfig) -> str | None:
    """None when ``current`` keeps every skip entry of ``saved`` with S < next_step (the
    trained steps draw the same samples); otherwise the refusal line, naming the field."""
    trained = saved.next_step - 1
    old, new = saved.config.skip_steps, current.skip_steps
    if old.up_to(trained) == new.up_to(trained):
        return None
    first = min(s for s, _ in set(old.up_to(trained).entries) ^ set(new.up_to(trained).entries))
    had = dict(old.entries).get(first)
    how = "without a skip there" if had is None else f"with the skip {first}:{had}"
    return (
        f"  {SKIP_FIELD}: {str(old) or '(none)'} -> {str(new) or '(none)'} (the entries at "
        f"or before step {trained} differ from step {first} on: this run trained step "
        f"{first} {how}; only entries at step {saved.next_step} or later are a continuation)"
    )


def exclusions_kept(saved: DataState, current: DataConfig) -> str | None:
    """None when ``current`` keeps every left-out entry (``order.exclusions``) of ``saved``
    with from_step < next_step (the trained steps drew the same samples); otherwise the
    refusal line, naming the field."""
    trained = saved.next_step - 1
    old = entries_up_to(saved.config.exclude, trained)
    new = entries_up_to(current.exclude, trained)
    if old == new:
        return None
    first = min(int(e["from_step"]) for e in old + new if (e in old) != (e in new))
    return (
        f"  {EXCLUDE_FIELD}: the left-out entries at or before step {trained} differ from "
        f"step {first} on (saved: {describe_saved(old)}; current: {describe_saved(new)}): "
        f"this run trained steps from {first} with another list; only entries with "
        f"from_step {saved.next_step} or later are a continuation"
    )


def skip_reach(saved: DataState) -> int:
    """First step whose batch size or mixture weights a trained step does not depend on:
    ``next_step``, or later when a skip at a trained step covers untrained steps (what it
    skips is what those steps would draw)."""
    return saved.config.skip_steps.reach(saved.next_step - 1)


def schedule_appended(old: BatchSchedule, new: BatchSchedule, next_step: int) -> bool:
    """True when ``new`` is ``old`` plus entries starting at ``next_step`` or later: every
    step already trained keeps its global batch size and positions."""
    k = len(old.entries)
    return new.entries[:k] == old.entries and all(s >= next_step for s, _ in new.entries[k:])


def check_resume(
    saved: DataState,
    current: DataConfig,
    allow_changes: Iterable[str] | str = (),
    *,
    first_correction: Callable[[DataConfig], int | None] | None = None,
) -> ResumeDecision:
    """Decide whether ``saved`` may continue under ``current``.

    ``first_correction(config)`` is the first step the current mixture rule corrects
    under ``config``'s weights and batch schedule (None: none), asked only of a
    mixture saved under another rule (``job.plans.first_correction``: the job layer owns
    the plans).

    A batch schedule that only gained entries for untrained steps, and a mixture
    whose weight schedule differs only for untrained steps (``mixture.spec.past_change``)
    with the same sources, are continuations (no opt-in). Any other differing
    field must be allowed; otherwise
    DataStateMismatch names every refused field (saved -> current) with the
    opt-in that would accept it. The sample counts that change because seq_len
    does (over unchanged stores) are named on the seq_len line and accepted with
    it. An internally inconsistent state is refused too.
    """
    allowed = allowed_fields(allow_changes, current)
    old, new = saved.config.to_dict(), current.to_dict()
    differing = saved.config.differing(current)
    follows, counts = _seq_len_follows(saved.config, current, differing)
    if allowed is not True and "seq_len" in allowed:
        allowed |= follows  # one opt-in for a seq_len change and what it implies
    # a mixture is compared as if its sources already had the new seq_len's counts
    base = _with_counts_of(saved.config, current) if counts else saved.config
    extended: list[str] = []
    notes: list[str] = []
    skip_line = skips_kept(saved, current) if SKIP_FIELD in differing else None
    if SKIP_FIELD in differing and skip_line is None:
        differing.remove(SKIP_FIELD)
        extended.append(SKIP_FIELD)
        added = [e for e in current.skip_steps.entries if e not in saved.config.skip_steps.entries]
        notes += [f"skip_steps gained {s}:{n}: {text}" for (s, n), text in zip(
            added, SkipSteps(added).describe(current.batch_schedule().gbs), strict=True
        )]  # fmt: skip
    exclude_line = exclusions_kept(saved, current) if EXCLUDE_FIELD in differing else None
    if EXCLUDE_FIELD in differing and exclude_line is None:
        differing.remove(EXCLUDE_FIELD)
        extended.append(EXCLUDE_FIELD)
        old_entries = saved.config.exclude
        notes += [
            f"exclude gained an entry: {describe_saved([e])}: never trained from step "
            f"{e['from_step']} on"
            for e in current.exclude
            if e not in old_entries
        ]
    reach = skip_reach(saved)
    if "schedule" in differing and schedule_appended(
        saved.config.batch_schedule(), current.batch_schedule(), max(saved.next_step, reach)
    ):
        differing.remove("schedule")
        extended.append("schedule")
    mixture_change = None
    keep: DataConfig | None = None
    if MIXTURE_FIELD in differing and MIXTURE_FIELD not in follows:
        mixture_change = _mixture_change(
            base, current, saved.next_step, first_correction, max(saved.next_step, reach)
        )
        if mixture_change is None:
            differing.remove(MIXTURE_FIELD)
            a, b = dict(base.mixture or {}), dict(current.mixture or {})
            rule_a, rule_b = a.pop("format", None), b.pop("format", None)
            if a != b:
                extended.append(MIXTURE_FIELD)
            if rule_a != rule_b:
                step = _corrected(first_correction, current)
                if step is None:
                    rule = {**(current.mixture or {}), "format": rule_a}
                    keep = DataConfig.from_dict({**current.to_dict(), MIXTURE_FIELD: rule})
                notes.append(
                    f"the mixture rule changed ({rule_a} -> {rule_b}) but corrects no step of "
                    f"this schedule: every step draws the same samples; the run keeps {rule_a}"
                    if step is None
                    else f"the mixture rule changed ({rule_a} -> {rule_b}); its first "
                    f"corrected step is {step}, after the trained ones: those keep their "
                    f"samples, and steps from {step} on follow the new rule"
                    if step >= saved.next_step
                    else f"the mixture rule changed ({rule_a} -> {rule_b}); under the new "
                    f"batch schedule it first corrects step {step}: the trained steps kept "
                    "the old batch schedule's samples, and the steps from here on follow "
                    "the new rule"
                )
        else:  # derived from the sources: reported, and opened, with the mixture
            differing = [k for k in differing if k not in ("store_fingerprint", "num_samples")]
            if allowed is not True and MIXTURE_FIELD in allowed:
                allowed |= {"store_fingerprint", "num_samples"}
    refused = [k for k in differing if not (allowed is True or k in allowed)]
    if "seq_len" in refused:  # named once, with what it implies, under one opt-in
        refused = [k for k in refused if k not in follows]
    if refused:
        lines = []
        for k in refused:
            if k == MIXTURE_FIELD:
                lines.append(f"  {k}: " + str(mixture_change).replace("\n", "\n    "))
                continue
            if k == SKIP_FIELD and skip_line is not None:
                lines.append(skip_line)
                continue
            if k == EXCLUDE_FIELD and exclude_line is not None:
                lines.append(exclude_line)
                continue
            was, now = (config_text(d[k], 10**6) if k in d else "(absent)" for d in (old, new))
            line = f"  {k}: {was} -> {now}"
            if k == "seq_len" and counts:
                stores = "stores" if base.mixture else "store"
                line += f" (every sample is another window of the same {stores}, so {counts})"
            lines.append(line)
        hint = _schedule_hint(saved, current) if "schedule" in refused else ""
        if reach > saved.next_step and ({"schedule", MIXTURE_FIELD} & set(refused)):
            s, n = next((s, n) for s, n in saved.config.skip_steps.entries if s + n == reach)
            hint += (
                f"\nThe skip {s}:{n} (already in effect at trained step {s}) skips what steps "
                f"{s}..{s + n - 1} draw, so their batch sizes and mixture weights are part of "
                f"the trained past: a change must start at step {reach} or later."
            )
        raise DataStateMismatch(
            "the data config differs from the one saved in the checkpoint; resuming would "
            "not continue the same data stream. Differing fields (saved -> current):\n"
            + "\n".join(lines)
            + hint
            + f"\nTo accept, opt in with allow_changes={refused!r} (or 'all').",
            tuple(refused),
        )
    if "schedule" in differing:  # accepted: count the new schedule from the saved position
        anchor = (saved.next_step, saved.consumed_positions)
        return ResumeDecision(anchor, tuple(differing), tuple(extended), tuple(notes), keep)
    layout = Layout(current.batch_schedule(), saved.position_anchor)
    expected = None
    if saved.next_step >= layout.anchor_step >= 1:  # a step the anchor places
        expected = layout.step_positions(saved.next_step)[0]
    if expected != saved.consumed_positions:
        raise DataStateMismatch(
            f"data state is inconsistent: step {saved.next_step} should start at position "
            f"{expected} under schedule {layout.schedule}, but the state records "
            f"consumed_positions={saved.consumed_positions}. The checkpoint's data state is corrupt."
        )
    return ResumeDecision(layout.anchor, tuple(differing), tuple(extended), tuple(notes), keep)


def _mixture_change(
    saved: DataConfig,
    current: DataConfig,
    next_step: int,
    first_correction: Callable[[DataConfig], int | None] | None,
    fixed_until: int | None = None,
) -> str | None:
    """None when ``current``'s mixture draws the same samples as ``saved``'s for steps
    before ``next_step`` and has the same sources (only entries governing untrained
    steps differ); otherwise what changed, in a sentence. The weights of the steps
    before ``fixed_until`` (default ``next_step``; later when a trained skip covers
    untrained steps) must agree."""
    a, b = saved.mixture, current.mixture
    if a is None or b is None:
        return (
            f"a mixture of {len(b['sources'])} sources replaces one store"
            if a is None
            else f"one store replaces a mixture of {len(a['sources'])} sources"
        )
    try:
        old_spec, new_spec = MixtureSpec.from_json(a), MixtureSpec.from_json(b)
    except MixtureError as e:
        return f"the saved mixture cannot be read ({e})"
    past = past_changes(old_spec, new_spec, (fixed_until or next_step) - 1)
    if past:
        return "\n".join(past)
    if a.get("format") != b.get("format"):
        step = _corrected(first_correction, saved)
        if step is not None and step < next_step:
            return (
                f"the mixture rule changed ({a.get('format')} -> {b.get('format')}): the new "
                f"rule corrects step {step}, a trained step the old rule left more than one "
                f"sample off, so steps from {step} on draw other samples than this run did."
            )
    olds = {s["name"]: s for s in a["sources"]}
    news = {s["name"]: s for s in b["sources"]}
    changes = []
    for name in sorted(set(olds) | set(news)):
        if name not in news or name not in olds:
            verb = "removed" if name not in news else "added"
            changes.append(
                f"source {name!r} was {verb} (the steps trained so far do not draw from it, "
                "but every step's log record binds the list of sources)."
            )
            continue
        for key in sorted(set(olds[name]) | set(news[name])):
            va, vb = olds[name].get(key), news[name].get(key)
            if va != vb:
                changes.append(
                    f"source {name!r}: {key} was {config_text(va)}, now {config_text(vb)}."
                )
    if a.get("tokenizer_hash") != b.get("tokenizer_hash"):
        changes.append("the sources' tokenizer changed.")
    return "\n".join(changes) or None


def _seq_len_follows(
    saved: DataConfig, current: DataConfig, differing: list[str]
) -> tuple[set[str], str]:
    """The fields that differ because ``seq_len`` does (every sample is another window
    of the same stores, so their sample counts change), and those counts in words;
    (set(), "") when seq_len is unchanged or nothing follows from it."""
    if "seq_len" not in differing:
        return set(), ""
    a, b = saved.mixture, current.mixture
    if a is None and b is None:
        if "num_samples" in differing and "store_fingerprint" not in differing:
            return {"num_samples"}, f"num_samples {saved.num_samples} -> {current.num_samples}"
        return set(), ""
    if a is None or b is None:
        return set(), ""
    try:
        olds = {s["name"]: s for s in a["sources"]}
        news = {s["name"]: s for s in b["sources"]}
        same_store = [
            n
            for n in sorted(olds)
            if n in news and olds[n].get("store_fingerprint") == news[n].get("store_fingerprint")
        ]
        changed = [n for n in same_store if olds[n]["num_samples"] != news[n]["num_samples"]]
        if not changed:
            return set(), ""

        def without_counts(m: Mapping[str, Any]) -> dict[str, Any]:
            rows = [{k: v for k, v in s.items() if k != "num_samples"} for s in m["sources"]]
            return {**m, "sources": rows}

        same_otherwise = without_counts(a) == without_counts(b)
    except (KeyError, TypeError, AttributeError):  # a malformed saved mixture: named later
        return set(), ""
    words = ", ".join(
        f"{n!r} {olds[n]['num_samples']} -> {news[n]['num_samples']}" for n in changed
    )
    follows = {"num_samples", MIXTURE_FIELD} if same_otherwise else {"num_samples"}
    return follows, f"the sources' training samples: {words}"


def _with_counts_of(saved: DataConfig, current: DataConfig) -> DataConfig:
    """``saved`` with its mixture sources' sample counts taken from ``current`` (by
    name): what remains of a mixture change once a seq_len change is accounted for."""
    if saved.mixture is None or current.mixture is None:
        return saved
    counts = {s["name"]: s["num_samples"] for s in current.mixture["sources"]}
    rows = [
        {**s, "num_samples": counts.get(s["name"], s["num_samples"])}
        for s in saved.mixture["sources"]
    ]
    return DataConfig.from_dict(
        {**saved.to_dict(), MIXTURE_FIELD: {**saved.mixture, "sources": rows}}
    )


def _corrected(
    first_correction: Callable[[DataConfig], int | None] | None, config: DataConfig
) -> int | None:
    """``first_correction(config)``; a caller judging a mixture rule change must pass it."""
    if first_correction is None:
        raise TypeError(
            "check_resume needs first_correction to judge a mixture saved under another "
            "rule; pass job.plans.first_correction."
        )
    return first_correction(config)


def _schedule_hint(saved: DataState, current: DataConfig) -> str:
    step = saved.next_step
    old, new = saved.config.batch_schedule(), current.batch_schedule()
    if old.first_position(step) == new.first_position(step):
        return (
            f"\nThe new schedule agrees with the saved one on steps < {step}, so "
            "accepting 'schedule' continues from the recorded position without a gap."
        )
    return (
        f"\nAccepting 'schedule' continues from the recorded consumed position; steps from "
        f"{step} on use the new global batch sizes. (Entries added for steps >= {step}, "
        "keeping every saved entry, need no opt-in.)"
    )
