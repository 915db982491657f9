"""The data config and the data state: what a checkpoint records about the data.

Role: the one owner of
1. the **data config**: every setting that decides which tokens a step sees
   (store content, tokenizer, seq_len, held-out split, seed, batch schedule,
   order format and, for a mixture, the mixture spec: its sources and weight
   schedule in the extra field ``mixture``), with its fingerprint;
2. the **data state**: the world-size-free record a checkpoint holds (config,
   next step, consumed positions, position anchor, tracker chain head), to and
   from JSON;
3. the **resume rule** ``check_resume(saved, current, allow)``.
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
  A mixture saved under an older rule (``zephon-mixture/1``) is refused only when
  the current rule corrects a trained step; when it corrects no step at all the
  run continues under the saved rule (``ResumeDecision.config``), so its steps'
  ids digests keep binding it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torchtitan_zephon.data.digest import fingerprint
from torchtitan_zephon.data.plan import BatchSchedule

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
        try:
            return cls(
                seq_len=int(d["seq_len"]),
                seed=int(d["seed"]),
                schedule=tuple((int(s), int(g)) for s, g in d["schedule"]),
                sample_offset=int(d.get("sample_offset", 0)),
                num_samples=int(d["num_samples"]),
                store_fingerprint=str(d["store_fingerprint"]),
                tokenizer_hash=str(d["tokenizer_hash"]),
                order_format=int(d.get("order_format", 1)),
                extra=tuple(sorted((k, v) for k, v in d.items() if k not in CORE_FIELDS)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise DataStateMismatch(
                f"the saved data config is missing or has an invalid field ({e!r}); "
                "the checkpoint's data state is corrupt or was written by another tool."
            ) from None

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
        found = d.get("format") if isinstance(d, Mapping) else type(d).__name__
        if found not in (1, STATE_FORMAT):
            raise DataStateMismatch(
                f"unsupported data state format {found!r}; expected {STATE_FORMAT} (or 1). "
                "The checkpoint was written by an incompatible version of zephon."
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
        tracker = d.get("tracker")
        try:
            anchor = d.get("position_anchor", [1, 0])
            state = cls(
                config,
                int(d["next_step"]),
                int(d["consumed_positions"]),
                (int(anchor[0]), int(anchor[1])),
                None
                if tracker is None
                else {"step": int(tracker["step"]), "chain": str(tracker["chain"])},
            )
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise DataStateMismatch(
                f"data state is missing or has an invalid field ({e!r}); the checkpoint is corrupt."
            ) from None
        return state

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
                f"{sorted(fields | set(ALIASES) | {'all'})}."
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
    saved: DataState, current: DataConfig, allow_changes: Iterable[str] | str = ()
) -> ResumeDecision:
    """Decide whether ``saved`` may continue under ``current``.

    A batch schedule that only gained entries for untrained steps, and a mixture
    whose weight schedule differs only for untrained steps (``mixture.past_change``)
    with the same sources, are continuations (no opt-in). Any other differing
    field must be allowed; otherwise
    DataStateMismatch names every refused field (saved -> current) with the
    opt-in that would accept it. An internally inconsistent state is refused too.
    """
    allowed = allowed_fields(allow_changes, current)
    old, new = saved.config.to_dict(), current.to_dict()
    differing = saved.config.differing(current)
    extended: list[str] = []
    if "schedule" in differing and schedule_appended(
        saved.config.batch_schedule(), current.batch_schedule(), saved.next_step
    ):
        differing.remove("schedule")
        extended.append("schedule")
    mixture_change = None
    notes: list[str] = []
    keep: DataConfig | None = None
    if MIXTURE_FIELD in differing:
        mixture_change = _mixture_change(saved.config, current, saved.next_step)
        if mixture_change is None:
            differing.remove(MIXTURE_FIELD)
            a, b = dict(saved.config.mixture or {}), dict(current.mixture or {})
            rule_a, rule_b = a.pop("format", None), b.pop("format", None)
            if a != b:
                extended.append(MIXTURE_FIELD)
            if rule_a != rule_b:
                step = _first_correction(current)
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
    if refused:
        lines = [
            f"  {k}: {mixture_change}"
            if k == MIXTURE_FIELD
            else f"  {k}: {old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r}"
            for k in refused
        ]
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


def _mixture_change(saved: DataConfig, current: DataConfig, next_step: int) -> str | None:
    """None when ``current``'s mixture draws the same samples as ``saved``'s for steps
    before ``next_step`` and has the same sources (only entries governing untrained
    steps differ); otherwise what changed, in a sentence."""
    from torchtitan_zephon.data.mixture import MixtureError, MixtureSpec, past_change

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
    past = past_change(old_spec, new_spec, next_step - 1)
    if past is not None:
        return past
    if a.get("format") != b.get("format"):
        step = _first_correction(saved)
        if step is not None and step < next_step:
            return (
                f"the mixture rule changed ({a.get('format')} -> {b.get('format')}): the new "
                f"rule corrects step {step}, a trained step the old rule left more than one "
                f"sample off, so steps from {step} on draw other samples than this run did."
            )
    olds = {s["name"]: s for s in a["sources"]}
    news = {s["name"]: s for s in b["sources"]}
    for name in sorted(set(olds) | set(news)):
        if name not in news or name not in olds:
            verb = "removed" if name not in news else "added"
            return (
                f"source {name!r} was {verb} (the steps trained so far do not draw from it, "
                "but every step's log record binds the list of sources)."
            )
        if olds[name] != news[name]:
            field = sorted(k for k in olds[name] if olds[name].get(k) != news[name].get(k))[0]
            return f"source {name!r}: {field} was {olds[name][field]}, now {news[name][field]}."
    if a.get("tokenizer_hash") != b.get("tokenizer_hash"):
        return "the sources' tokenizer changed."
    return None


def _first_correction(config: DataConfig) -> int | None:
    """The first step the current mixture rule corrects under ``config``'s weights and
    batch schedule (``MixturePlan.first_correction``); None if none. A resume asks it
    of the saved and the current config, which usually plan the same steps."""
    rule_free = {k: v for k, v in (config.mixture or {}).items() if k != "format"}
    return _first_correction_of(json.dumps(rule_free, sort_keys=True), config.seed, config.schedule)


@functools.lru_cache(maxsize=4)
def _first_correction_of(
    mixture: str, seed: int, schedule: tuple[tuple[int, int], ...]
) -> int | None:
    from torchtitan_zephon.data.mixture import SPEC_FORMAT, MixturePlan, MixtureSpec

    spec = MixtureSpec.from_json({**json.loads(mixture), "format": SPEC_FORMAT})
    return MixturePlan(spec, seed, BatchSchedule(list(schedule))).first_correction


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
