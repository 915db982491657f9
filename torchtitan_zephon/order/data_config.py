"""The data config: every setting that decides which tokens a step sees, and its keys.

Role: the one owner of the **data config** (``DataConfig``): store content,
tokenizer, seq_len, held-out split, seed, batch schedule, order format, the skip
entries (extra field ``skip_steps``, ``order.skips``) and, for a mixture, the
mixture spec (its sources and weight schedule, in the extra field ``mixture``), with its fingerprint, order key and step keys, to and from JSON. Also
``config_text`` (a value as the user wrote it, for the order engine's messages) and
``DataStateMismatch``, the error of a saved record that is corrupt or does not match
(``order.state``, ``order.resume``).

Invariants:
- ``DataConfig.fingerprint`` depends only on fields that govern the data,
  never on the topology. ``DataConfig.order_key`` is the same without the batch
  schedule and without a mixture's weight schedule: it binds what maps a
  position to a sample, so a step's log record can bind what governed that step
  while a schedule extended only for later steps leaves earlier steps' records
  unchanged. ``DataConfig.step_key(s)`` adds the weights in effect at step ``s``
  (a mixture) and the skip entries with S <= s (``order.skips``; otherwise it is
  the order key): a step's ids digest binds it, so a skip appended for later
  steps changes no earlier step's record.
- ``skip_steps`` is an extra field present only when a skip is set: a config
  without skips has the fingerprint, order key and step keys it had before skips
  existed. The same holds for ``exclude`` (left-out samples, ``order.exclusions``:
  the canonical entries, each with its ids' sha256), which ``step_key(s)`` binds for
  the entries with from_step <= s.
- ``packing`` is an extra field present only when it is not ``none`` (the method and
  the packing index's constants, ``order.packing``); it is part of the order key (it
  maps positions to samples: packed ones), so a packed run never matches an unpacked
  one, and an unpacked config is what it was before packing existed.
- A saved config of format 1 (no ``order_format``) reads as order format 1; a
  field that does not parse raises ``DataStateMismatch`` naming it.
"""

from __future__ import annotations

import bisect
import datetime
import decimal
import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from torchtitan_zephon.order.exclusions import EXCLUDE_FIELD
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.packing import packing_field
from torchtitan_zephon.order.skips import SkipSteps
from torchtitan_zephon.order.stream import ID_MASK
from torchtitan_zephon.store.format import fingerprint

ORDER_FORMAT = 1
"""Version of the position -> sample mapping (Feistel v1 permutation per epoch,
contiguous DP slices). A new mapping gets a new number, so its runs never match
or resume runs of the old one."""
MIXTURE_FIELD = "mixture"
"""The extra config field holding a mixture's canonical spec (``MixtureSpec.to_json``)."""
PACKING_FIELD = "packing"
"""The extra config field of packing (``order.packing.packing_field``); absent for
``none``, so unpacked configs keep their fingerprints, order keys and digests."""
SKIP_FIELD = "skip_steps"
"""The extra config field holding the skip entries ``[[S, N], ...]`` (``order.skips``);
absent when no skip is set."""
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
    """A saved data state does not match the current data config, or is corrupt;
    ``fields``: the allow_changes names that would accept it (none: nothing would)."""

    def __init__(self, message: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = tuple(fields)


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


def saved_int(d: Mapping[str, Any], name: str, what: str, default: Any = None) -> int:
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


def data_extra(*, skip_steps: str = "", packing: str = "none") -> dict[str, Any]:
    """The extra data-config fields of a job's ``[zephon]`` settings: ``skip_steps``
    (``"S:N,..."``) when set, and ``packing`` when it is not ``none`` (``order.packing``:
    the method and the index's constants), absent otherwise. ValueError names the
    setting."""
    try:
        skips = SkipSteps.parse(skip_steps or "")
    except ValueError as e:
        raise ValueError(f"zephon.skip_steps: {e}") from None
    extra: dict[str, Any] = {SKIP_FIELD: skips.to_json()} if skips else {}
    field = packing_field(packing)
    if field is not None:
        extra[PACKING_FIELD] = field
    return extra


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
        config = cls(
            seq_len=saved_int(d, "seq_len", what),
            seed=saved_int(d, "seed", what),
            schedule=schedule,
            sample_offset=saved_int(d, "sample_offset", what, 0),
            num_samples=saved_int(d, "num_samples", what),
            store_fingerprint=str(d["store_fingerprint"]),
            tokenizer_hash=str(d["tokenizer_hash"]),
            order_format=saved_int(d, "order_format", what, 1),
            extra=tuple(sorted((k, v) for k, v in d.items() if k not in CORE_FIELDS)),
        )
        bad = config._out_of_range()
        if bad:
            raise DataStateMismatch(
                f"{what} has {bad}; the checkpoint's data state is corrupt or was written by "
                "another tool."
            )
        return config

    def _out_of_range(self) -> str | None:
        """What no config this engine makes holds: seq_len or num_samples below 1, or
        samples outside the sample id space of ``order.stream`` (2^40 per source)."""
        if self.seq_len < 1:
            return f"seq_len {self.seq_len} (expected >= 1)"
        if self.num_samples < 1:
            return f"num_samples {self.num_samples} (expected >= 1)"
        if self.sample_offset < 0 or self.sample_offset + self.num_samples > ID_MASK + 1:
            return (
                f"samples [{self.sample_offset}, {self.sample_offset + self.num_samples}) "
                f"outside the sample ids [0, {ID_MASK + 1})"
            )
        return None

    @functools.cached_property
    def fingerprint(self) -> str:
        """Hex sha256 of the canonical JSON of the whole config."""
        return fingerprint(self.to_dict())

    @property
    def mixture(self) -> Mapping[str, Any] | None:
        """The mixture spec JSON (``MixtureSpec.to_json``), or None for one store."""
        value = dict(self.extra).get(MIXTURE_FIELD)
        return value if isinstance(value, Mapping) else None

    @property
    def packing(self) -> str:
        """The packing method: ``none`` (fixed windows) or ``best_fit``."""
        value = dict(self.extra).get(PACKING_FIELD)
        return str(value.get("method")) if isinstance(value, Mapping) else "none"

    @functools.cached_property
    def skip_steps(self) -> SkipSteps:
        """The skip entries (none when the field is absent); DataStateMismatch when the
        saved field does not parse."""
        raw = dict(self.extra).get(SKIP_FIELD)
        try:
            return SkipSteps.from_json(raw)
        except ValueError as e:
            raise DataStateMismatch(
                f"the saved data config has an invalid field {SKIP_FIELD!r}: {e} The "
                "checkpoint's data state is corrupt or was written by another tool."
            ) from None

    @functools.cached_property
    def order_key(self) -> str:
        """Hex sha256 of the config without its batch schedule (nor a mixture's weight
        schedule, nor the skip entries): what maps positions to samples. A step's ids
        digest binds it (through ``step_key``) together with the step's positions."""
        body = self.to_dict()
        del body["schedule"]
        body.pop(SKIP_FIELD, None)
        body.pop(EXCLUDE_FIELD, None)
        if self.mixture is not None:
            body[MIXTURE_FIELD] = {k: v for k, v in self.mixture.items() if k != "schedule"}
        return fingerprint(body)

    @functools.cached_property
    def _weight_entries(self) -> tuple[tuple[int, Any], ...]:
        entries = (self.mixture or {}).get("schedule") or ()
        return tuple((int(e["from_step"]), e["weights"]) for e in entries)

    @functools.cached_property
    def exclude(self) -> list[dict[str, Any]]:
        """The canonical left-out entries (``order.exclusions``; [] when the field is
        absent); DataStateMismatch when the saved field does not parse."""
        raw = dict(self.extra).get(EXCLUDE_FIELD)
        if raw is None:
            return []
        try:
            entries = [dict(e) for e in raw]
            for e in entries:
                int(e["from_step"]), int(e["ids"]), str(e["sha256"])
            return entries
        except (TypeError, ValueError, KeyError):
            raise DataStateMismatch(
                f"the saved data config has an invalid field {EXCLUDE_FIELD!r}: "
                f"{config_text(raw)}; the checkpoint's data state is corrupt or was written "
                "by another tool."
            ) from None

    @functools.cached_property
    def _starts(self) -> tuple[list[int], list[int], list[int]]:
        """The skip entries' S, the weight entries' and the left-out entries' from_step,
        for bisection."""
        return (
            [s for s, _ in self.skip_steps.entries],
            [s for s, _ in self._weight_entries],
            [int(e["from_step"]) for e in self.exclude],
        )

    @functools.cached_property
    def _step_keys(self) -> dict[tuple[int, int, int], str]:
        """Step keys by (skip, weight, left-out entries) in effect: each computed once."""
        return {}

    def step_key(self, step: int) -> str:
        """What step ``step``'s ids digest binds besides its ids and positions: the order
        key, for a mixture the weights in effect at that step (exact fractions), and the
        skip entries with S <= ``step`` and the left-out entries with from_step <=
        ``step`` when there are any. O(log entries) per step."""
        if not self._weight_entries and not self.skip_steps and not self.exclude:
            return self.order_key
        skip_starts, weight_starts, exclude_starts = self._starts
        which = (
            bisect.bisect_right(skip_starts, step),
            bisect.bisect_right(weight_starts, step),
            bisect.bisect_right(exclude_starts, step),
        )
        key = self._step_keys.get(which)
        if key is None:
            k, w, x = which
            if not self._weight_entries:
                body: dict[str, Any] = {"order_key": self.order_key}
            else:
                weights = self._weight_entries[w - 1][1] if w else None
                body = {"order_key": self.order_key, "weights": weights}
            if k:
                body[SKIP_FIELD] = [list(e) for e in self.skip_steps.entries[:k]]
            if x:
                body[EXCLUDE_FIELD] = self.exclude[:x]
            key = self.order_key if len(body) == 1 else fingerprint(body)
            self._step_keys[which] = key
        return key

    def differing(self, other: DataConfig) -> list[str]:
        """Names of the fields whose values differ (sorted)."""
        a, b = self.to_dict(), other.to_dict()
        return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
