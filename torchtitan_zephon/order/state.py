"""The data config and the data state: what a checkpoint records about the data.

Role: the one owner of
1. the **data config**: every setting that decides which tokens a step sees
   (store content, tokenizer, seq_len, held-out split, seed, batch schedule,
   order format and, for a mixture, the mixture spec: its sources and weight
   schedule in the extra field ``mixture``), with its fingerprint;
2. the **data state**: the world-size-free record a checkpoint holds (config,
   next step, consumed positions, position anchor, tracker chain head), to and
   from JSON;
3. the **resume rule** ``check_resume(saved, current, allow, first_correction=...)``
   (the first step a mixture rule corrects comes from the job's data, which owns
   the plans: this module builds none).
The loader, the TorchTitan adapter, run-folder readers, ``inspect`` and
``bench`` ask this module instead of knowing the JSON.

Invariants:
- ``DataConfig.fingerprint`` depends only on fields that govern the data,
  never on the topology. ``DataConfig.order_key`` is the same without the batch
  schedule and without a mixture's weight schedule: it binds what maps a
  position to a sample, so a step's log record can bind what governed that step
  while a schedule extended only for later steps leaves earlier steps' records
  unchanged. ``DataConfig.step_key(s)`` adds the weights in effect at step ``s``
  (a mixture; otherwise it is the order key): a step's ids digest binds it.
- ``DataState.from_dict(s.to_dict()) == s``, the record is identical on every
  rank, and records of format 1 (written before this module existed) load
  with the defaults they implied.
- ``check_resume`` accepts exactly when every differing field is allowed, and
  then the current plan continues at the saved consumed position: no position
  is skipped or repeated. A batch schedule or a mixture weight schedule that
  differs only for untrained steps is an exact continuation (``extended``); a
  mixture whose sources or trained steps' weights changed is the field
  ``mixture`` (its derived ``store_fingerprint`` / ``num_samples`` go with it).
  A ``seq_len`` change is named once with what follows from it over the same
  stores (the sample counts, a mixture's per-source counts) and accepted by the
  one opt-in ``seq_len``; a refusal lists every change, never only the first.
  A mixture saved under an older rule (``zephon-mixture/1``) is refused only when
  the current rule corrects a trained step; when it corrects no step at all the
  run continues under the saved rule (``ResumeDecision.config``), so its steps'
  ids digests keep binding it.
"""

from __future__ import annotations

import datetime
import decimal
import functools
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.store.format import fingerprint

STATE_FORMAT = 2
"""2: the config carries ``order_format``. 1: the first release (still read)."""
ORDER_FORMAT = 1
"""Version of the position -> sample mapping (Feistel v1 permutation per epoch,
contiguous DP slices). A new mapping gets a new number, so its runs never match
or resume runs of the old one."""

RECORD_KEY = "zephon"
"""The key of the JSON record in the dataloader's state dict; DCP stores it under
``dataloader.zephon`` (TorchTitan's ``dataloader`` checkpoint entry)."""

# allow_changes aliases: one user-facing name can accept several config fields.
ALIASES = {
    "store": ("store_fingerprint", "num_samples"),
    "tokenizer": ("tokenizer_hash",),
    "mixture": ("mixture", "store_fingerprint", "num_samples"),
}
MIXTURE_FIELD = "mixture"
"""The extra config field holding a mixture's canonical spec (``MixtureSpec.to_json``)."""
CORE_FIELDS = (
    "seq_len",
    "seed",
    "schedule",
    "sample_offset",
    "num_samples",
    "store_fingerprint",
    "tokenizer_hash",
    "order_format",
)


class DataStateMismatch(ValueError):
    """A saved data state does not match the current data config, or is corrupt."""


def config_text(value: Any, limit: int = 200) -> str:
    """A value of a config file or saved record as the user wrote it (TOML / JSON), for
    messages: ``1.5``, ``3/4``, ``null``, ``true``, ``'text'``, ``[1, 2]``,
    ``{ a = 1 }``; never Python's repr (``Decimal('1.5')``) or type names. Cut after
    ``limit`` characters."""
    text = _config_text(value)
    return text if len(text) <= limit else text[:limit] + " ..."


def _config_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):  # a TOML literal string where it can be one, as names are shown
        plain = "'" not in value and value.isprintable()
        return f"'{value}'" if plain else json.dumps(value, ensure_ascii=False)
    if isinstance(value, Fraction):
        return f"{value.numerator}/{value.denominator}"
    if isinstance(value, decimal.Decimal) and not value.is_finite():  # TOML's spelling
        return "nan" if value.is_nan() else "-inf" if value < 0 else "inf"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else "-inf" if value < 0 else "inf"
    if isinstance(value, (int, float, decimal.Decimal)):
        return str(value)
    if isinstance(value, Mapping):
        inner = ", ".join(f"{k} = {_config_text(v)}" for k, v in value.items())
        return f"{{ {inner} }}" if inner else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_config_text(v) for v in value) + "]"
    if isinstance(value, (datetime.date, datetime.time)):  # TOML dates and times
        return value.isoformat()
    return str(value)


def _int(d: Mapping[str, Any], name: str, what: str, default: Any = None) -> int:
    """Field ``name`` of a saved record as an integer, or DataStateMismatch naming it."""
    value = d.get(name, default)
    if value is None:
        raise DataStateMismatch(f"{what} has no field {name!r}; the checkpoint is corrupt.")
    try:
        if isinstance(value, bool):
            raise TypeError
        return int(value)
    except (TypeError, ValueError):
        raise DataStateMismatch(
            f"{what} has an invalid field {name!r}: {config_text(value)}, expected an integer; "
            "the checkpoint is corrupt."
        ) from None


@dataclass(frozen=True)
class DataConfig:
    """Everything that decides which tokens each step sees, and nothing else."""

    seq_len: int
    seed: int
    schedule: tuple[tuple[int, int], ...]
    sample_offset: int
    num_samples: int
    store_fingerprint: str
    tokenizer_hash: str
    order_format: int = ORDER_FORMAT
    extra: tuple[tuple[str, Any], ...] = ()
    """Further data-governing fields (sorted (name, JSON value) pairs)."""

    @classmethod
    def make(
        cls,
        *,
        seq_len: int,
        seed: int,
        schedule: BatchSchedule,
        sample_offset: int,
        num_samples: int,
        store_fingerprint: str,
        tokenizer_hash: str,
        extra: Mapping[str, Any] | None = None,
    ) -> DataConfig:
        clash = set(CORE_FIELDS) & set(extra or {})
        if clash:
            raise ValueError(f"extra data config may not redefine fields {sorted(clash)}.")
        return cls(
            seq_len=int(seq_len),
            seed=int(seed),
            schedule=tuple((int(s), int(g)) for s, g in schedule.entries),
            sample_offset=int(sample_offset),
            num_samples=int(num_samples),
            store_fingerprint=str(store_fingerprint),
            tokenizer_hash=str(tokenizer_hash),
            extra=tuple(sorted((extra or {}).items())),
        )

    def batch_schedule(self) -> BatchSchedule:
        return BatchSchedule(list(self.schedule))

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq_len": self.seq_len,
            "seed": self.seed,
            "schedule": [[s, g] for s, g in self.schedule],
            "sample_offset": self.sample_offset,
            "num_samples": self.num_samples,
            "store_fingerprint": self.store_fingerprint,
            "tokenizer_hash": self.tokenizer_hash,
            "order_format": self.order_format,
            **dict(self.extra),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DataConfig:
        """Parse a saved config; a format-1 config (no ``order_format``) means order 1."""
        what = "the saved data config"
        if not isinstance(d, Mapping):
            raise DataStateMismatch(
                f"{what} is {config_text(d)}, not a JSON object; the checkpoint's data state "
                "is corrupt or was written by another tool."
            )
        raw = d.get("schedule")
        try:
            schedule = tuple((int(s), int(g)) for s, g in raw)
        except (TypeError, ValueError):
            raise DataStateMismatch(
                f"{what} has an invalid field 'schedule': {config_text(raw)}, expected "
                "[[step, global batch size], ...]; the checkpoint's data state is corrupt or "
                "was written by another tool."
            ) from None
        for name in ("store_fingerprint", "tokenizer_hash"):
            if name not in d:
                raise DataStateMismatch(f"{what} has no field {name!r}; the checkpoint is corrupt.")
        return cls(
            seq_len=_int(d, "seq_len", what),
            seed=_int(d, "seed", what),
            schedule=schedule,
            sample_offset=_int(d, "sample_offset", what, 0),
            num_samples=_int(d, "num_samples", what),
            store_fingerprint=str(d["store_fingerprint"]),
            tokenizer_hash=str(d["tokenizer_hash"]),
            order_format=_int(d, "order_format", what, 1),
            extra=tuple(sorted((k, v) for k, v in d.items() if k not in CORE_FIELDS)),
        )

    @functools.cached_property
    def fingerprint(self) -> str:
        """Hex sha256 of the canonical JSON of the whole config."""
        return fingerprint(self.to_dict())

    @property
    def mixture(self) -> Mapping[str, Any] | None:
        """The mixture spec JSON (``MixtureSpec.to_json``), or None for one store."""
        value = dict(self.extra).get(MIXTURE_FIELD)
        return value if isinstance(value, Mapping) else None

    @functools.cached_property
    def order_key(self) -> str:
        """Hex sha256 of the config without its batch schedule (nor a mixture's weight
        schedule): what maps positions to samples. A step's ids digest binds it (through
        ``step_key``) together with the step's positions."""
        body = self.to_dict()
        del body["schedule"]
        if self.mixture is not None:
            body[MIXTURE_FIELD] = {k: v for k, v in self.mixture.items() if k != "schedule"}
        return fingerprint(body)

    @functools.cached_property
    def _weight_entries(self) -> tuple[tuple[int, Any], ...]:
        entries = (self.mixture or {}).get("schedule") or ()
        return tuple((int(e["from_step"]), e["weights"]) for e in entries)

    def step_key(self, step: int) -> str:
        """What step ``step``'s ids digest binds besides its ids and positions: the order
        key, and for a mixture the weights in effect at that step (exact fractions)."""
        if not self._weight_entries:
            return self.order_key
        weights = None
        for from_step, w in self._weight_entries:
            if from_step > step:
                break
            weights = w
        return fingerprint({"order_key": self.order_key, "weights": weights})

    def differing(self, other: DataConfig) -> list[str]:
        """Names of the fields whose values differ (sorted)."""
        a, b = self.to_dict(), other.to_dict()
        return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


@dataclass(frozen=True)
class DataState:
    """The data side of a checkpoint: one record, identical on every rank."""

    config: DataConfig
    next_step: int
    """First step not yet completely delivered."""
    consumed_positions: int
    """Positions of the global stream used by steps < next_step."""
    position_anchor: tuple[int, int] = (1, 0)
    """(step, position): the current schedule counts positions from here (a resume
    that accepted a schedule change moves it)."""
    tracker: Mapping[str, Any] | None = field(default=None, compare=True)
    """The sequence tracker's chain head ``{"step", "chain"}`` (None: audit off)."""

    def __post_init__(self) -> None:
        if self.next_step < 1 or self.consumed_positions < 0:
            raise DataStateMismatch(
                f"data state has next_step={self.next_step}, consumed_positions="
                f"{self.consumed_positions}; expected next_step >= 1 and consumed_positions "
                ">= 0. The checkpoint's data state is corrupt."
            )

    def with_tracker(self, head: Mapping[str, Any] | None) -> DataState:
        return DataState(
            self.config, self.next_step, self.consumed_positions, self.position_anchor, head
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": STATE_FORMAT,
            "store_fingerprint": self.config.store_fingerprint,
            "data_config": self.config.to_dict(),
            "data_config_fingerprint": self.config.fingerprint,
            "next_step": self.next_step,
            "consumed_positions": self.consumed_positions,
            "position_anchor": list(self.position_anchor),
        }
        if self.tracker is not None:
            out["tracker"] = dict(self.tracker)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Any) -> DataState:
        """Parse a saved record (format 1 or 2); DataStateMismatch names what is wrong."""
        if not isinstance(d, Mapping):
            raise DataStateMismatch(
                f"the data state is {config_text(d)}, not a JSON object; the checkpoint's data "
                "state is corrupt or was written by another tool."
            )
        found = d.get("format")
        if isinstance(found, bool) or found not in (1, STATE_FORMAT):
            raise DataStateMismatch(
                f"unsupported data state format {config_text(found)}; expected {STATE_FORMAT} "
                "(or 1). The checkpoint was written by an incompatible version of zephon."
            )
        raw = d.get("data_config")
        if not isinstance(raw, Mapping):
            raise DataStateMismatch("data state has no data_config; the checkpoint is corrupt.")
        config = DataConfig.from_dict(raw)
        if found == STATE_FORMAT and d.get("data_config_fingerprint") != fingerprint(dict(raw)):
            raise DataStateMismatch(
                "data state is corrupt: its data_config does not hash to its recorded "
                "data_config_fingerprint (edited after it was saved?)."
            )
        if d.get("store_fingerprint", config.store_fingerprint) != config.store_fingerprint:
            raise DataStateMismatch(
                "data state is corrupt: its store_fingerprint disagrees with its data_config."
            )
        what = "the data state"
        tracker = d.get("tracker")
        anchor = d.get("position_anchor", [1, 0])
        if not isinstance(anchor, list) or len(anchor) != 2:
            raise DataStateMismatch(
                f"{what} has an invalid field 'position_anchor': {config_text(anchor)}, "
                "expected [step, position]; the checkpoint is corrupt."
            )
        if tracker is not None and not (isinstance(tracker, Mapping) and "chain" in tracker):
            raise DataStateMismatch(
                f"{what} has an invalid field 'tracker': {config_text(tracker)}, expected "
                '{ step = N, chain = "..." }; the checkpoint is corrupt.'
            )
        anchors = {"step": anchor[0], "position": anchor[1]}
        at = "the data state's position_anchor"
        head = None
        if tracker is not None:
            step = _int(tracker, "step", "the data state's tracker")
            head = {"step": step, "chain": str(tracker["chain"])}
        return cls(
            config,
            _int(d, "next_step", what),
            _int(d, "consumed_positions", what),
            (_int(anchors, "step", at), _int(anchors, "position", at)),
            head,
        )

    @classmethod
    def from_json(cls, text: str) -> DataState:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise DataStateMismatch(f"data state is not valid JSON ({e}); it is corrupt.") from None


def allowed_fields(allow_changes: Iterable[str] | str, config: DataConfig) -> set[str] | bool:
    """The config fields ``allow_changes`` opens (``True``: all); unknown names raise."""
    names = [allow_changes] if isinstance(allow_changes, str) else list(allow_changes)
    if "all" in names:
        return True
    fields = set(config.to_dict())
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
    mixture saved under another rule (``job.first_correction``: the job layer owns
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
    if "schedule" in differing and schedule_appended(
        saved.config.batch_schedule(), current.batch_schedule(), saved.next_step
    ):
        differing.remove("schedule")
        extended.append("schedule")
    mixture_change = None
    notes: list[str] = []
    keep: DataConfig | None = None
    if MIXTURE_FIELD in differing and MIXTURE_FIELD not in follows:
        mixture_change = _mixture_change(base, current, saved.next_step, first_correction)
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
            was, now = (config_text(d[k], 10**6) if k in d else "(absent)" for d in (old, new))
            line = f"  {k}: {was} -> {now}"
            if k == "seq_len" and counts:
                stores = "stores" if base.mixture else "store"
                line += f" (every sample is another window of the same {stores}, so {counts})"
            lines.append(line)
        hint = _schedule_hint(saved, current) if "schedule" in refused else ""
        raise DataStateMismatch(
            "the data config differs from the one saved in the checkpoint; resuming would "
            "not continue the same data stream. Differing fields (saved -> current):\n"
            + "\n".join(lines)
            + hint
            + f"\nTo accept, opt in with allow_changes={refused!r} (or 'all')."
        )
    if "schedule" in differing:  # accepted: count the new schedule from the saved position
        anchor = (saved.next_step, saved.consumed_positions)
        return ResumeDecision(anchor, tuple(differing), tuple(extended), tuple(notes), keep)
    anchor_step, anchor_pos = saved.position_anchor
    schedule = current.batch_schedule()
    expected = None
    if saved.next_step >= anchor_step >= 1:
        expected = (
            anchor_pos
            + schedule.first_position(saved.next_step)
            - schedule.first_position(anchor_step)
        )
    if expected != saved.consumed_positions:
        raise DataStateMismatch(
            f"data state is inconsistent: step {saved.next_step} should start at position "
            f"{expected} under schedule {schedule}, but the state records "
            f"consumed_positions={saved.consumed_positions}. The checkpoint's data state is corrupt."
        )
    return ResumeDecision(
        (anchor_step, anchor_pos), tuple(differing), tuple(extended), tuple(notes), keep
    )


def _mixture_change(
    saved: DataConfig,
    current: DataConfig,
    next_step: int,
    first_correction: Callable[[DataConfig], int | None] | None,
) -> str | None:
    """None when ``current``'s mixture draws the same samples as ``saved``'s for steps
    before ``next_step`` and has the same sources (only entries governing untrained
    steps differ); otherwise what changed, in a sentence."""
    from torchtitan_zephon.order.mixture.config import MixtureError
    from torchtitan_zephon.order.mixture.spec import MixtureSpec, past_changes

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
    past = past_changes(old_spec, new_spec, next_step - 1)
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
            "rule; pass job.first_correction."
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
