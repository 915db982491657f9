"""Mixtures: several token stores drawn in exact proportions that follow a weight schedule.

Role: the pure index math of a data mixture. A mixture file names the sources
(stores) and a weight schedule; ``MixturePlan`` turns it, with a seed and the
global batch schedule, into the ordered (source, sample id) pairs of every
global step, DP-rank slice and micro-batch, like ``DataPlan`` does for one store.

The global stream is the slots 0, 1, 2, ...; step ``t`` covers the slots
``[BatchSchedule.first_position(t), + gbs(t))`` and slot ``s`` carries the
weights of its step. Each slot goes to one source; the k-th slot a source gets
is its stream position k, drawn like a single-store plan:
``Permutation(n_source, source_seed(seed, name), k // n_source)[k % n_source]``.

Invariants:
- Pure: the slot -> source assignment of steps 1..k depends only on the
  weights in effect at steps 1..k, the batch sizes of steps 1..k and the source
  names. Entries appended after k, sources added with weight 0 up to k and the
  order of the ``[[source]]`` blocks (it only numbers the sources) change
  nothing up to k; ``past_changes`` says whether two specs agree up to a step
  (and names every difference).
- Weight 0 means none: a source never gets a slot of a step where its weight
  is 0, not even one it is "owed".
- Exact: weights are exact rationals (decimals as written, normalized by their
  sum). With one schedule entry (and any batch schedule), every source's count
  after every step is within ``1 - 1/(2m-2)`` < 1 sample of its exact target
  ``sum over steps of w x GBS`` (m = sources of weight > 0). A weight change
  continues from the residuals the previous weights left (no fresh pattern per
  segment). Across changes, every step ends with every source of weight > 0
  within 1 sample of its target, or else no counts of that step do better (a
  source of weight 0 keeps its deviation): a step whose end the
  earliest-deadline pattern would leave more than 1 off takes the counts with
  the least worst deviation instead when they do better
  (``_least_worst_counts``; at most
  ``_MAX_CORRECTIONS`` = 4,096 such steps per weight entry before their
  residuals recur; a schedule that needs more, e.g. a weight of 1e-6 at batch
  size 1, follows the pattern alone after them).
  ``MixturePlan.max_deviation`` is the exact worst over every step end. No pure
  plan that keeps "weight 0 means none" can stay within 1 for every schedule
  once weights change: see ``test_weight_changes_can_force_more_than_one_sample``
  (7/6 is forced).
- Each source's ids within one of its epochs are a permutation of its training
  samples ``[0, n_source)``; a source that runs out starts its next epoch
  reshuffled; an optional ``max_epochs`` makes running past it an error.
- Elastic: DP rank r of D gets the contiguous slots ``[r*G/D, (r+1)*G/D)`` of
  the step; the rank slices concatenate to the global batch for every D
  dividing G.
- O(1) in the step: a step's ids cost O(GBS + sources + 512) whatever the
  step number and world size; nothing is replayed from step 1. The plan walks
  the weight segments once when built; within a segment the assignment is
  periodic (period: a multiple of the entry's common denominator, found by
  comparing states) after a prefix, kept as one table per segment with
  per-source counts every 512 slots. A corrected step is its own one-step
  segment; when the residuals after a corrected step recur under the same
  batch size, the steps between repeat as a block (``_Repeat``) until the batch
  size or the weights change. The tables depend only on the spec and the batch
  schedule, so every rank builds the same ones.

Warnings (a source smaller than its share of one global batch) are returned as
strings in ``MixturePlan.warnings`` for the caller to log; errors raise
``MixtureError``.
"""

from __future__ import annotations

import bisect
import decimal
import hashlib
import heapq
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_zephon.data.permutation import map_many
from torchtitan_zephon.data.plan import (
    BatchSchedule,
    DataPlan,
    check_batch_layout,
    no_sample_text,
    rank_slice,
    store_fix,
)
from torchtitan_zephon.data.state import config_text
from torchtitan_zephon.ingest.cache import rebase, store_location

MAX_PATTERN = 10**6
"""Largest common denominator of one schedule entry's normalized weights: the
length of its slot pattern. 0.7/0.3 gives 10, three weights of 0.001/0.499/0.5
give 1000; seven-decimal weights that do not simplify are refused."""

_CHECKPOINT = 512  # slots between prefix-count checkpoints of a pattern table
_MAX_CORRECTIONS = 4096
"""Corrected steps per weight entry before their residuals recur (steps inside
a ``_Repeat`` are not counted): bounds the plan's build time; past it, the
earliest-deadline pattern alone. Counted in step order, so pure."""
_PROBE_STEPS = 16  # steps simulated first after a correction, before a whole pattern
_SOURCE_KEYS = {"name", "store", "heldout_samples", "max_epochs"}
_ENTRY_KEYS = {"from_step", "weights"}
SPEC_FORMAT = "zephon-mixture/2"
_OLD_SPEC_FORMATS = ("zephon-mixture/1",)
"""Read, not written. Rule 1 had no corrected steps: for a schedule where rule 2
corrects none (``MixturePlan.first_correction`` is None) both draw the same."""


class MixtureError(ValueError):
    """A mixture file, spec or plan request is invalid."""


def source_seed(seed: int, name: str) -> int:
    """Permutation seed of source ``name``: independent of the other sources."""
    digest = hashlib.blake2b(
        f"zephon-mixture-source-v1:{int(seed)}:{name}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little")


def fraction_text(value: Fraction) -> str:
    """Exact text of a weight: ``"7/10"``, ``"1/1"``, ``"0/1"``."""
    return f"{value.numerator}/{value.denominator}"


# ---------------------------------------------------------------------- parsing


def _weight_value(value: Any, where: str, *, text_ok: bool) -> Fraction:
    """One raw weight as an exact Fraction, or MixtureError."""
    if isinstance(value, bool) or not isinstance(value, (int, decimal.Decimal, Fraction, str)):
        raise MixtureError(
            f"{where}: weight must be a number (like 0.7 or 3), found {config_text(value)}."
        )
    if isinstance(value, str):
        if not text_ok:
            raise MixtureError(
                f"{where}: weight must be a number (like 0.7 or 3), found the string "
                f"{config_text(value)}; remove the quotes."
            )
        try:
            value = Fraction(value)
        except (ValueError, ZeroDivisionError):
            raise MixtureError(
                f'{where}: weight {config_text(value)} is not a fraction like "7/10".'
            ) from None
    if isinstance(value, decimal.Decimal) and not value.is_finite():
        raise MixtureError(f"{where}: weight must be finite, found {value}.")
    frac = Fraction(value)
    if frac < 0:
        raise MixtureError(f"{where}: weight must be >= 0, found {value}.")
    return frac


def _found(table: Mapping[str, Any], key: str) -> str:
    """The value of ``key`` in a table of a mixture file, as written there."""
    return config_text(table[key]) if key in table else "nothing"


def _plain_int(value: Any, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MixtureError(f"{where} must be an integer >= {minimum}, found {config_text(value)}.")
    return value


@dataclass(frozen=True)
class WeightEntry:
    """One schedule entry: from ``from_step`` on, these normalized weights (every source)."""

    from_step: int
    weights: Mapping[str, Fraction]

    @property
    def period(self) -> int:
        """Common denominator of the weights: the slot pattern length."""
        return math.lcm(*(w.denominator for w in self.weights.values()))

    def to_json(self) -> dict[str, Any]:
        return {
            "from_step": self.from_step,
            "weights": {k: fraction_text(v) for k, v in sorted(self.weights.items())},
        }


def parse_schedule(
    entries: Any, names: Sequence[str], origin: str, *, text_ok: bool = False
) -> tuple[WeightEntry, ...]:
    """Validate and normalize raw ``[[schedule]]`` entries against the source ``names``."""
    if not isinstance(entries, list) or not entries:
        raise MixtureError(
            f"{origin}: needs at least one [[schedule]] entry with from_step = 1 and "
            "weights = { source = weight, ... }."
        )
    declared = set(names)
    out: list[WeightEntry] = []
    for k, raw in enumerate(entries, 1):
        where = f"{origin}: schedule entry {k}"
        if not isinstance(raw, Mapping):
            raise MixtureError(f"{where} must be a table with from_step and weights.")
        unknown = set(raw) - _ENTRY_KEYS
        if unknown:
            raise MixtureError(
                f"{where} has unknown keys {sorted(unknown)}; allowed: {sorted(_ENTRY_KEYS)}."
            )
        if "from_step" not in raw:
            raise MixtureError(f"{where} has no from_step.")
        step = _plain_int(raw["from_step"], f"{where}: from_step", 1)
        where = f"{origin}: schedule entry {k} (from_step {step})"
        if not out and step != 1:
            raise MixtureError(
                f"{where}: the first entry must start at from_step = 1 (steps are 1-based)."
            )
        if out and step <= out[-1].from_step:
            raise MixtureError(
                f"{where}: from_step must be strictly increasing, found {out[-1].from_step} "
                f"then {step}."
            )
        raw_weights = raw.get("weights")
        if not isinstance(raw_weights, Mapping):
            raise MixtureError(
                f"{where} needs weights = {{ source = weight, ... }}, found "
                f"{_found(raw, 'weights')}."
            )
        unknown = [n for n in raw_weights if n not in declared]
        if unknown:
            raise MixtureError(
                f"{where}: unknown source {unknown[0]!r}; declared sources: {list(names)}."
            )
        missing = [n for n in names if n not in raw_weights]
        if missing:
            raise MixtureError(
                f"{where}: no weight for source {missing[0]!r}; give every source a weight "
                "(0 leaves it out of this entry)."
            )
        values = {
            n: _weight_value(raw_weights[n], f"{where}, source {n!r}", text_ok=text_ok)
            for n in names
        }
        total = sum(values.values(), Fraction(0))
        if total == 0:
            raise MixtureError(f"{where}: all weights are 0; at least one must be positive.")
        entry = WeightEntry(step, {n: v / total for n, v in values.items()})
        if entry.period > MAX_PATTERN:
            raise MixtureError(
                f"{where}: the normalized weights have common denominator {entry.period}, over "
                f"the cap of {MAX_PATTERN} slots per pattern; use weights with fewer decimals "
                "(e.g. 0.123 rather than 0.1234567)."
            )
        out.append(entry)
    return tuple(out)


@dataclass(frozen=True)
class MixtureSource:
    """A ``[[source]]`` of a mixture file. ``None`` fields take the job's defaults."""

    name: str
    store: str
    heldout_samples: int | None = None
    max_epochs: int | None = None


def _parse_sources(raw: Any, origin: str, base_dir: Path | None) -> tuple[MixtureSource, ...]:
    if not isinstance(raw, list) or not raw:
        raise MixtureError(
            f"{origin}: needs at least one [[source]] with name and store, "
            'e.g. [[source]] name = "web" store = "/data/web".'
        )
    out: list[MixtureSource] = []
    for k, src in enumerate(raw, 1):
        where = f"{origin}: source {k}"
        if not isinstance(src, Mapping):
            raise MixtureError(f"{where} must be a table with name and store.")
        unknown = set(src) - _SOURCE_KEYS
        if unknown:
            raise MixtureError(
                f"{where} has unknown keys {sorted(unknown)}; allowed: {sorted(_SOURCE_KEYS)}."
            )
        name = src.get("name")
        if not isinstance(name, str) or not name.strip():
            raise MixtureError(
                f"{where} needs a non-empty name string, found {_found(src, 'name')}."
            )
        where = f"{origin}: source {name!r}"
        if any(s.name == name for s in out):
            raise MixtureError(f"{where} is declared twice; source names must be unique.")
        store = src.get("store")
        if not isinstance(store, str) or not store.strip():
            raise MixtureError(
                f"{where} needs store = a token store path or raw inputs (a file, folder, "
                "glob or comma list; absolute, or relative to the mixture file) or "
                f'"builtin:docs" / "builtin:stdlib", found {_found(src, "store")}.'
            )
        if base_dir is not None:
            store = rebase(store, base_dir)
        held = src.get("heldout_samples")
        if held is not None:
            held = _plain_int(held, f"{where}: heldout_samples", 0)
        max_epochs = src.get("max_epochs")
        if max_epochs is not None:
            max_epochs = _plain_int(max_epochs, f"{where}: max_epochs", 1)
        out.append(MixtureSource(name, store, held, max_epochs))
    return tuple(out)


@dataclass(frozen=True)
class MixtureConfig:
    """A parsed mixture file: sources (with store paths) and the weight schedule."""

    sources: tuple[MixtureSource, ...]
    schedule: tuple[WeightEntry, ...]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    @classmethod
    def from_dict(
        cls, data: Any, *, base_dir: Path | None = None, origin: str = "mixture"
    ) -> MixtureConfig:
        """Validate a parsed TOML document (floats as ``decimal.Decimal``)."""
        if not isinstance(data, Mapping):
            raise MixtureError(f"{origin}: expected a table with [[source]] and [[schedule]].")
        unknown = set(data) - {"source", "schedule"}
        if unknown:
            raise MixtureError(
                f"{origin}: unknown top-level keys {sorted(unknown)}; a mixture file has "
                "[[source]] and [[schedule]] entries only."
            )
        sources = _parse_sources(data.get("source"), origin, base_dir)
        schedule = parse_schedule(data.get("schedule"), [s.name for s in sources], origin)
        return cls(sources, schedule)

    @classmethod
    def loads(
        cls, text: str, *, base_dir: Path | None = None, origin: str = "mixture"
    ) -> MixtureConfig:
        """Parse TOML text; floats are read as exact decimals, never as binary floats."""
        try:
            import tomllib
        except ImportError:  # Python 3.10
            import tomli as tomllib  # type: ignore[no-redef]
        try:
            data = tomllib.loads(text, parse_float=decimal.Decimal)
        except tomllib.TOMLDecodeError as e:
            raise MixtureError(f"{origin}: not valid TOML ({e}).") from None
        return cls.from_dict(data, base_dir=base_dir, origin=origin)

    @classmethod
    def load(cls, path: str | os.PathLike) -> MixtureConfig:
        """Read a mixture file; relative store paths are taken relative to its folder."""
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise MixtureError(
                f"cannot read mixture file {str(p)!r}: {e.strerror or e}. Expected a TOML file "
                "with [[source]] and [[schedule]] entries."
            ) from None
        return cls.loads(text, base_dir=p.resolve().parent, origin=f"mixture file {str(p)!r}")

    def to_json(self) -> dict[str, Any]:
        return {
            "sources": [
                {
                    "name": s.name,
                    "store": s.store,
                    "heldout_samples": s.heldout_samples,
                    "max_epochs": s.max_epochs,
                }
                for s in self.sources
            ],
            "schedule": [e.to_json() for e in self.schedule],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MixtureConfig:
        origin = "mixture config JSON"
        sources = _parse_sources(list(data.get("sources") or []), origin, None)
        schedule = parse_schedule(
            list(data.get("schedule") or []), [s.name for s in sources], origin, text_ok=True
        )
        return cls(sources, schedule)

    def open_stores(self, *, progress: bool = False, raw: Any = None) -> dict[str, Any]:
        """Open every source's TokenStore (``builtin:PART`` values are built on first use,
        with a progress bar when ``progress``; raw inputs are prepared as ``raw``, a
        ``cache.RawInputs``, says, or refused when it is None); a missing or broken store
        names its source."""
        from torchtitan_zephon.store.format import StoreError
        from torchtitan_zephon.store.reader import TokenStore

        stores = {}
        for s in self.sources:
            try:
                location = store_location(s.store, raw, progress=progress)
                stores[s.name] = TokenStore.open(location)
            except (StoreError, ValueError) as e:
                raise MixtureError(f"mixture source {s.name!r}: {e}") from None
        return stores


# ------------------------------------------------------------------ resolved spec


@dataclass(frozen=True)
class SpecSource:
    """A source as the plan sees it: its content fingerprint and training samples."""

    name: str
    store_fingerprint: str
    num_samples: int
    heldout_samples: int = 0
    max_epochs: int | None = None


@dataclass(frozen=True)
class MixtureSpec:
    """What fixes a mixture's sample stream (with the seed and the batch schedule).

    ``to_json`` is canonical (store fingerprints, sample counts, weights as exact
    fractions; no paths, and no ``max_epochs``, which guards a run without
    changing its samples): the data-config fingerprint hashes it.
    """

    sources: tuple[SpecSource, ...]
    schedule: tuple[WeightEntry, ...]
    tokenizer_hash: str = ""

    def __post_init__(self) -> None:
        names = [s.name for s in self.sources]
        if not names or len(set(names)) != len(names):
            raise MixtureError(f"a mixture spec needs distinct source names, found {names}.")
        for s in self.sources:
            if int(s.num_samples) < 1:
                raise MixtureError(
                    f"mixture source {s.name!r} has {s.num_samples} training samples; it needs "
                    "at least 1 (a larger store, a shorter seq_len or fewer heldout_samples)."
                )
        if not self.schedule or self.schedule[0].from_step != 1:
            raise MixtureError("a mixture spec needs a schedule whose first entry is at step 1.")
        for e in self.schedule:
            if sum(e.weights.values()) != 1 or min(e.weights.values()) < 0:
                raise MixtureError(
                    f"schedule entry from_step {e.from_step}: weights must be normalized "
                    "(>= 0, summing to 1); build entries with parse_schedule."
                )
            if set(e.weights) != set(names):
                raise MixtureError(
                    f"schedule entry from_step {e.from_step} gives weights for "
                    f"{sorted(e.weights)}, the sources are {sorted(names)}."
                )

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    @classmethod
    def build(
        cls,
        sizes: Mapping[str, int],
        schedule: Sequence[tuple[int, Mapping[str, Any]]],
        *,
        max_epochs: Mapping[str, int] | None = None,
    ) -> MixtureSpec:
        """A spec from plain values (tests, tools): ``sizes`` name -> samples, in order."""
        names = list(sizes)
        entries = parse_schedule(
            [{"from_step": s, "weights": dict(w)} for s, w in schedule],
            names,
            "mixture schedule",
            text_ok=True,
        )
        me = max_epochs or {}
        return cls(
            tuple(
                SpecSource(n, f"unfingerprinted:{n}", int(k), 0, me.get(n))
                for n, k in sizes.items()
            ),
            entries,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": SPEC_FORMAT,
            "tokenizer_hash": self.tokenizer_hash,
            "sources": [
                {
                    "name": s.name,
                    "store_fingerprint": s.store_fingerprint,
                    "num_samples": int(s.num_samples),
                    "heldout_samples": int(s.heldout_samples),
                }
                for s in self.sources
            ],
            "schedule": [e.to_json() for e in self.schedule],
        }

    def is_written_as(self, data: Mapping[str, Any] | None) -> bool:
        """True when ``data`` is this spec's JSON under this rule or an older one it
        reads (a run continued under its saved rule, ``state.check_resume``)."""
        if not isinstance(data, Mapping) or data.get("format") not in (
            SPEC_FORMAT,
            *_OLD_SPEC_FORMATS,
        ):
            return False
        return {**data, "format": SPEC_FORMAT} == self.to_json()

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MixtureSpec:
        if data.get("format") not in (SPEC_FORMAT, *_OLD_SPEC_FORMATS):
            raise MixtureError(
                f"mixture spec format {config_text(data.get('format'))} is not "
                f"{config_text(SPEC_FORMAT)}."
            )
        try:
            sources = tuple(
                SpecSource(
                    str(s["name"]),
                    str(s["store_fingerprint"]),
                    int(s["num_samples"]),
                    int(s.get("heldout_samples", 0)),
                )
                for s in data["sources"]
            )
        except KeyError as e:
            raise MixtureError(
                f"mixture spec JSON has a source without the field {e.args[0]!r}."
            ) from None
        except (TypeError, ValueError):
            raise MixtureError(
                f"mixture spec JSON has a malformed source list: {config_text(data.get('sources'))}"
                " (each source needs name, store_fingerprint and an integer num_samples)."
            ) from None
        schedule = parse_schedule(
            list(data.get("schedule") or []),
            [s.name for s in sources],
            "mixture spec JSON",
            text_ok=True,
        )
        return cls(sources, schedule, str(data.get("tokenizer_hash", "")))


def resolve_mixture(
    config: MixtureConfig,
    stores: Mapping[str, Any],
    seq_len: int,
    *,
    default_heldout: int = 0,
    tokenizer: tuple[str, str] | None = None,
) -> MixtureSpec:
    """Check the opened stores against each other and fix each source's sample count.

    ``stores`` maps source name -> an opened store (``TokenStore`` or anything with
    ``fingerprint``, ``tokenizer_hash``, ``vocab_size``, ``eos_id``, ``dtype`` and
    ``num_samples(seq_len)``). All sources must share one tokenizer (hash, vocab
    size, EOS id) and token dtype; ``tokenizer`` (the sha256 of the job's
    tokenizer.json and the setting that names it) tells which is right when the
    sources disagree. A source keeps its last ``heldout_samples`` (default
    ``default_heldout``) for validation.
    """
    missing = [n for n in config.names if n not in stores]
    if missing:
        raise MixtureError(f"no opened store for mixture source {missing[0]!r}.")
    _check_one_tokenizer(config.names, stores, tokenizer)
    ref = stores[config.sources[0].name]
    out = []
    for s in config.sources:
        st = stores[s.name]
        total = int(st.num_samples(seq_len))
        held = default_heldout if s.heldout_samples is None else s.heldout_samples
        tokens = getattr(st, "num_tokens", None)
        if total == 0 and tokens is not None:
            what = f"mixture source {s.name!r}: its store {str(getattr(st, 'path', ''))!r}"
            raise MixtureError(
                f"{no_sample_text(what, int(tokens), seq_len)}. "
                + store_fix(int(tokens), 1 + max(held, 0), "seq_len")
            )
        if not 0 <= held < total:
            raise MixtureError(
                f"mixture source {s.name!r}: heldout_samples={held} must be in [0, {total}): its "
                f"store holds {total} samples of seq_len {seq_len}. Lower heldout_samples or "
                "seq_len, or use a larger store."
            )
        out.append(SpecSource(s.name, st.fingerprint, total - held, held, s.max_epochs))
    return MixtureSpec(tuple(out), config.schedule, str(ref.tokenizer_hash))


_TOKENIZER_FIELDS = (
    ("tokenizer_hash", "tokenizer (sha256)"),
    ("vocab_size", "vocabulary size"),
    ("eos_id", "EOS id"),
    ("dtype", "token dtype"),
)


def _check_one_tokenizer(
    names: Sequence[str], stores: Mapping[str, Any], tokenizer: tuple[str, str] | None
) -> None:
    """Refuse sources prepared with different tokenizers, naming the odd ones out: the
    sources outside the group that has the job's tokenizer (``tokenizer``: its sha256
    and the setting naming it) when one has it, else outside the largest group."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name in names:
        st = stores[name]
        groups.setdefault(tuple(getattr(st, f) for f, _ in _TOKENIZER_FIELDS), []).append(name)
    if len(groups) == 1:
        return
    ranked = sorted(groups.items(), key=lambda kv: -len(kv[1]))  # stable: source order
    sha, origin = tokenizer or ("", "")
    by_job = [kv for kv in ranked if sha and kv[0][0] == sha]
    ref = by_job[0] if by_job else ranked[0] if len(ranked[0][1]) > len(ranked[1][1]) else None
    if ref is None:  # no majority and no job tokenizer among them: the first two named
        first, odd = ranked[0][1][0], next(n for n in names if n not in ranked[0][1])
    else:
        first, odd = ref[1][0], next(n for n in names if n not in ref[1])
    a, b = stores[first], stores[odd]
    field, label = next((f, lab) for f, lab in _TOKENIZER_FIELDS if getattr(a, f) != getattr(b, f))
    message = (
        f"mixture sources {first!r} and {odd!r} differ in {label}: {getattr(a, field)} vs "
        f"{getattr(b, field)}. Every source must be prepared with the same tokenizer. "
    )
    if ref is not None:
        odd_ones = [n for n in names if n not in ref[1]]
        shared = ", ".join(repr(n) for n in ref[1])
        listed = ", ".join(repr(n) for n in odd_ones)
        why = (
            f"{shared} {'has' if len(ref[1]) == 1 else 'have'} the tokenizer of {origin}"
            if by_job
            else f"{shared} share one: {len(ref[1])} of the {len(names)} sources"
        )
        message += (
            f"The odd one{'s' if len(odd_ones) > 1 else ''} out: {listed} ({why}). Re-run "
            f"`zephon prepare` for {listed} with the tokenizer of {first!r}."
        )
    else:
        listing = "; ".join(", ".join(repr(n) for n in g) for _, g in ranked)
        job = f", and none has the tokenizer of {origin} (sha256 {sha})" if sha else ""
        message += (
            f"No majority tells which is right (the groups: {listing}){job}: re-run `zephon "
            "prepare` for the sources that do not have the model's tokenizer, with it."
        )
    raise MixtureError(message)


def _weights_equal(a: Mapping[str, Fraction], b: Mapping[str, Fraction]) -> bool:
    return all(a.get(k, 0) == b.get(k, 0) for k in set(a) | set(b))


def _effective_entries(spec: MixtureSpec, step: int) -> list[tuple[int, WeightEntry]]:
    """(entry number, entry) of the entries up to ``step`` that change the weights."""
    out: list[tuple[int, WeightEntry]] = []
    for k, e in enumerate(spec.schedule, 1):
        if e.from_step <= step and not (out and _weights_equal(out[-1][1].weights, e.weights)):
            out.append((k, e))
    return out


def past_change(old: MixtureSpec, new: MixtureSpec, step: int) -> str | None:
    """None when steps 1..``step`` draw the same samples under ``old`` and ``new``;
    otherwise ``past_changes`` as one text, a sentence per change."""
    changes = past_changes(old, new, step)
    return " ".join(changes) if changes else None


def past_changes(old: MixtureSpec, new: MixtureSpec, step: int) -> list[str]:
    """What makes steps 1..``step`` draw other samples under ``new`` than under ``old``,
    one sentence per change ([]: the same samples).

    Every changed weight of every schedule entry in effect at those steps (up to the
    first entry added, removed or moved, after which entries no longer pair up), then
    every source they use whose content or size changed. Only what the past depends
    on counts: the weights in effect at steps <= ``step`` (a source absent from one
    side weighs 0 there; an entry that repeats the previous weights changes nothing)
    and the content and size of the sources they use. Source order does not count.
    The seed, seq_len and batch schedule live in the data config and are compared by
    its owner.
    """
    out: list[str] = []
    old_past, new_past = _effective_entries(old, step), _effective_entries(new, step)
    for k in range(max(len(old_past), len(new_past))):
        if k >= len(old_past) or k >= len(new_past):
            num, extra = (new_past if k >= len(old_past) else old_past)[k]
            side = "added" if k >= len(old_past) else "removed"
            out.append(
                f"schedule entry {num} (from_step {extra.from_step}) was {side}; it starts at "
                f"or before step {step}."
            )
            break
        (num, a), (_, b) = old_past[k], new_past[k]
        if a.from_step != b.from_step:
            out.append(
                f"schedule entry {num}: from_step was {a.from_step}, now {b.from_step} "
                f"(at or before step {step})."
            )
            break
        for name in sorted(set(a.weights) | set(b.weights)):
            wa, wb = a.weights.get(name, Fraction(0)), b.weights.get(name, Fraction(0))
            if wa != wb:
                out.append(
                    f"schedule entry {num} (from_step {a.from_step}): weight of source "
                    f"{name!r} was {fraction_text(wa)}, now {fraction_text(wb)} (normalized)."
                )
    used = sorted({n for _, e in old_past for n, w in e.weights.items() if w > 0})
    olds = {s.name: s for s in old.sources}
    news = {s.name: s for s in new.sources}
    for name in used:
        a, b = olds[name], news.get(name)
        if b is None:
            out.append(f"source {name!r} was removed; steps up to {step} draw from it.")
            continue
        for field in ("store_fingerprint", "num_samples"):
            va, vb = getattr(a, field), getattr(b, field)
            if va != vb:
                hint = ""
                if field == "num_samples" and a.heldout_samples != b.heldout_samples:
                    hint = f" (heldout_samples {a.heldout_samples} -> {b.heldout_samples})"
                out.append(f"source {name!r}: {field} was {va}, now {vb}{hint}.")
    return out


# ------------------------------------------------------------------ slot patterns


class _Pattern:
    """The slot -> source assignment of one weight segment, periodic after a prefix.

    ``local`` holds, per simulated slot, an index into ``active`` (the sources
    with weight > 0): ``prefix`` slots, then one period of ``cycle`` slots that
    repeats forever (``cycle`` = 0 when the segment is shorter than that).
    """

    def __init__(self, active: np.ndarray, local: np.ndarray, prefix: int, cycle: int) -> None:
        self.active = active
        self.local = local
        self.prefix = prefix
        self.cycle = cycle
        m = len(active)
        checkpoints = np.zeros((len(local) // _CHECKPOINT + 1, m), dtype=np.int64)
        for q in range(1, len(checkpoints)):
            block = local[(q - 1) * _CHECKPOINT : q * _CHECKPOINT]
            checkpoints[q] = checkpoints[q - 1] + np.bincount(block, minlength=m)
        self._checkpoints = checkpoints
        self._cycle_counts = (
            self._local_counts(prefix + cycle) - self._local_counts(prefix)
            if cycle
            else np.zeros(m, dtype=np.int64)
        )

    def _local_counts(self, x: int) -> np.ndarray:
        """Counts per active source of simulated slots [0, x), x <= len(local)."""
        q = x // _CHECKPOINT
        tail = self.local[q * _CHECKPOINT : x]
        return self._checkpoints[q] + np.bincount(tail, minlength=len(self.active))

    def counts(self, t: int) -> np.ndarray:
        """Counts per active source of the segment's slots [0, t)."""
        if t <= len(self.local):
            return self._local_counts(t)
        if not self.cycle:
            raise AssertionError("slot beyond a finite segment pattern")
        full, rem = divmod(t - self.prefix, self.cycle)
        return self._local_counts(self.prefix + rem) + full * self._cycle_counts

    def local_at(self, t0: int, count: int) -> np.ndarray:
        """Indices into ``active`` of the segment's slots [t0, t0+count)."""
        idx = np.arange(t0, t0 + count, dtype=np.int64)
        if self.cycle:
            wrap = idx >= self.prefix + self.cycle
            idx[wrap] = self.prefix + (idx[wrap] - self.prefix) % self.cycle
        return self.local[idx]


def _simulate(
    weights: Sequence[Fraction],
    residual: Sequence[Fraction],
    ranks: Sequence[int],
    length: int | None,
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Chairman assignment of one weight segment, from the residuals it inherits.

    Returns (active source indices, per-slot index into them, prefix, cycle).
    Rule: earliest deadline first on Tijdeman's windows, in exact integer
    arithmetic. With m sources of weight > 0 and ``d = 1/(2m-2)``, a source is
    a candidate for a slot when its deficit ``r`` (target - count) plus the
    slot's accrual ``w`` is at least ``d`` (taking the slot leaves it at most
    ``1 - d`` ahead); its deadline is the last slot before its deficit would
    pass ``1 - d`` at the current weights. The candidate with the earliest
    deadline wins, ties to the smaller name. Tijdeman (1980) shows a sequence
    within ``1 - d`` exists for constant weights, and earliest-deadline-first
    meets every deadline of unit jobs whenever any schedule does, so from the
    start of the stream this stays within ``1 - d``. After a weight change the
    windows may have no solution: a source may then pass its deadline (it stays
    first in line), and with no candidate the largest ``r + w`` wins. Sources
    with weight 0 never win.
    """
    active = [i for i, w in enumerate(weights) if w > 0]
    m = len(active)
    period = math.lcm(*(weights[i].denominator for i in active))
    if m == 1:
        return np.array(active, dtype=np.int64), np.zeros(1, dtype=np.uint16), 0, 1
    scale = math.lcm(period, 2 * m - 2, *(residual[i].denominator for i in active))
    acc = [int(weights[i] * scale) for i in active]  # accrual per slot, scaled
    low = scale // (2 * m - 2)  # d
    high = scale - low  # 1 - d
    rank = [ranks[i] for i in active]
    base_t = [0] * m  # each source's deficit is base_r at time base_t (+ acc per slot)
    base_r = [int(residual[i] * scale) for i in active]

    def candidate_from(j: int) -> int:
        need = low - base_r[j] - acc[j]
        return base_t[j] + (0 if need <= 0 else -(-need // acc[j]))

    waiting = [(candidate_from(j), rank[j], j) for j in range(m)]
    heapq.heapify(waiting)
    ready: list[tuple[int, int, int]] = []  # (deadline, rank, j)
    picks: list[int] = []
    seen: dict[tuple[int, ...], int] = {tuple(base_r): 0}  # state at multiples of period
    cap = 64 * period + 4096
    prefix = cycle = 0
    t = 0
    push, pop = heapq.heappush, heapq.heappop
    while length is None or t < length:
        while waiting and waiting[0][0] <= t:
            j = pop(waiting)[2]
            push(ready, (base_t[j] + (high - base_r[j]) // acc[j], rank[j], j))
        if ready:
            j = pop(ready)[2]
        else:
            j = max(range(m), key=lambda x: (base_r[x] + acc[x] * (t - base_t[x] + 1), -rank[x]))
            waiting = [w for w in waiting if w[2] != j]
            heapq.heapify(waiting)
        base_r[j] += acc[j] * (t - base_t[j] + 1) - scale
        base_t[j] = t + 1
        push(waiting, (candidate_from(j), rank[j], j))
        picks.append(j)
        t += 1
        if t % period == 0:
            state = tuple(base_r[x] + acc[x] * (t - base_t[x]) for x in range(m))
            if state in seen:
                prefix = seen[state]
                cycle = t - prefix
                break
            seen[state] = t
            if t > cap:
                raise MixtureError(
                    f"internal: the slot pattern of weights {[str(weights[i]) for i in active]} "
                    f"did not repeat within {cap} slots; please report this mixture."
                )
    local = np.array(picks, dtype=np.uint16 if m <= 1 << 16 else np.int32)
    return np.array(active, dtype=np.int64), local, prefix, cycle


def _least_worst_counts(
    deficit: Sequence[Fraction], weights: Sequence[Fraction], gbs: int, ranks: Sequence[int]
) -> list[int]:
    """The counts of one step that leave the smallest worst |target - count| at its
    end among the sources of weight > 0 (those of weight 0 get none and keep theirs).

    ``deficit[i]`` is source i's target after the step minus its count before
    it. Counts are integers >= 0 summing to ``gbs``. Among the counts that reach
    the least worst deviation ``D``, each source first gets the fewest that keep
    it within ``D``; the rest go one at a time to the source with the largest
    remaining deficit that can take one more, ties to the smaller name.
    """
    active = [i for i, w in enumerate(weights) if w > 0]
    candidates: set[Fraction] = set()
    for i in active:  # the least D is the distance of a deficit to a count
        x = deficit[i]
        candidates.update(abs(x - k) for k in range(max(0, math.floor(x) - 3), math.floor(x) + 5))

    def bounds(d: Fraction) -> tuple[list[int], list[int]] | None:
        lo = [max(0, math.ceil(deficit[i] - d)) for i in active]
        hi = [math.floor(deficit[i] + d) for i in active]
        if any(a > b for a, b in zip(lo, hi, strict=True)) or not sum(lo) <= gbs <= sum(hi):
            return None
        return lo, hi

    ordered = sorted(candidates)
    lo_k, hi_k = 0, len(ordered) - 1  # feasibility is monotone in D; the largest is feasible
    while bounds(ordered[hi_k]) is None:  # (cannot happen for a state within 2 samples)
        ordered.append(ordered[-1] + 1)
        hi_k = len(ordered) - 1
    while lo_k < hi_k:
        mid = (lo_k + hi_k) // 2
        if bounds(ordered[mid]) is None:
            lo_k = mid + 1
        else:
            hi_k = mid
    found = bounds(ordered[lo_k])
    assert found is not None
    lo, hi = found
    n = list(lo)
    heap = [(-(deficit[i] - n[j]), ranks[i], j) for j, i in enumerate(active) if n[j] < hi[j]]
    heapq.heapify(heap)
    for _ in range(gbs - sum(n)):
        _, _, j = heapq.heappop(heap)
        n[j] += 1
        if n[j] < hi[j]:
            heapq.heappush(heap, (-(deficit[active[j]] - n[j]), ranks[active[j]], j))
    out = [0] * len(weights)
    for j, i in enumerate(active):
        out[i] = n[j]
    return out


def _spread(counts: Sequence[int], ranks: Sequence[int]) -> np.ndarray:
    """A step's slots in order, given its per-source counts: source i's k-th sample
    sits at (2k+1)/(2 counts[i]) of the step, ties to the smaller name."""
    src = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    n = np.asarray(counts, dtype=np.int64)[src]
    k = np.arange(len(src), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    key = (2 * k + 1) / (2 * n)  # correctly rounded: equal fractions give equal floats
    return src[np.lexsort((np.asarray(ranks, dtype=np.int64)[src], key))]


@dataclass
class _Segment:
    """Steps [first_step, end_step) of the stream: one weight vector, one pattern."""

    weights: list[Fraction]  # per source, mixture order
    first_step: int
    end_step: int | None
    first_slot: int
    end_slot: int | None
    start_counts: np.ndarray  # per source
    start_targets: list[Fraction]  # exact per-source targets at first_slot
    pattern: _Pattern
    report: tuple[Fraction, int, int] | None = None
    """(worst deviation, source, first step) over its step ends, sources of weight > 0."""

    def counts(self, slot: int) -> np.ndarray:
        """Per-source counts of slots [0, slot) of the whole stream (slot in this segment)."""
        out = self.start_counts.copy()
        out[self.pattern.active] += self.pattern.counts(slot - self.first_slot)
        return out

    def sources(self, slot: int, count: int) -> np.ndarray:
        """Source indices of slots [slot, slot + count) (all in this segment)."""
        return self.pattern.active[self.pattern.local_at(slot - self.first_slot, count)]

    def step_ends(self, schedule: BatchSchedule) -> tuple[np.ndarray, np.ndarray]:
        """(steps, pattern positions) of this segment's step ends, each step end
        position folded into the pattern's table. Enough steps to meet every
        position the infinite segment ever folds to: after the table, a
        constant batch size walks the period with period C / gcd(C, G)."""
        pat = self.pattern
        length = len(pat.local)
        steps_out, pos_out = [], []
        entries = schedule.entries
        for k, (a, g) in enumerate(entries):
            b = entries[k + 1][0] if k + 1 < len(entries) else None
            lo = max(a, self.first_step)
            hi = (
                b
                if self.end_step is None
                else (self.end_step if b is None else min(b, self.end_step))
            )
            if hi is not None and lo >= hi:
                continue
            x0 = schedule.first_position(lo) + g - self.first_slot
            count = None if hi is None else hi - lo
            if pat.cycle:
                direct = (length - x0) // g + 1 if x0 <= length else 0
                bound = direct + pat.cycle // math.gcd(pat.cycle, g)
                count = bound if count is None else min(count, bound)
            assert count is not None, "an infinite segment has a periodic pattern"
            kk = np.arange(count, dtype=np.int64)
            x = x0 + kk * g
            if pat.cycle:
                over = x > length
                x[over] = pat.prefix + (x[over] - pat.prefix) % pat.cycle
            steps_out.append(lo + kk)
            pos_out.append(x)
        if not steps_out:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        return np.concatenate(steps_out), np.concatenate(pos_out)

    def deviations(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """At each pattern position: the worst |target - count| among the sources
        of weight > 0, times the returned integer, and which source it is."""
        pat = self.pattern
        residual = [t - int(c) for t, c in zip(self.start_targets, self.start_counts, strict=True)]
        active = pat.active.tolist()
        scale = math.lcm(
            *(self.weights[i].denominator for i in active),
            *(residual[i].denominator for i in active),
        )
        big = max(abs(residual[i]) for i in active) * scale + scale * (
            int(positions.max(initial=0)) + 2
        )
        dtype: Any = np.int64 if big < 1 << 62 else object
        order = np.argsort(pat.local, kind="stable")
        bounds_ = np.searchsorted(pat.local[order], np.arange(len(active) + 1))
        pos = positions.astype(dtype)
        worst = np.full(len(positions), -1, dtype=dtype)
        who = np.zeros(len(positions), dtype=np.int64)
        for j, i in enumerate(active):
            picks = order[bounds_[j] : bounds_[j + 1]]  # slots source i takes, ascending
            taken = np.searchsorted(picks, positions, side="left").astype(dtype)
            dev = int(residual[i] * scale) + int(self.weights[i] * scale) * pos - scale * taken
            dev = np.abs(dev)
            better = dev > worst
            worst = np.where(better, dev, worst)
            who[better] = i
        return worst, who, scale


def _worst_of(
    steps: np.ndarray, worst: np.ndarray, who: np.ndarray, scale: int
) -> tuple[Fraction, int, int]:
    """(largest deviation, its source, its first step) of ``_Segment.deviations``."""
    if not steps.size:
        return Fraction(0), 0, 1
    top = worst.max()
    k = int(np.flatnonzero(worst == top)[np.argmin(steps[worst == top])])
    return Fraction(int(top), scale), int(who[k]), int(steps[k])


def deviation_warning(worst: Fraction, who: str, step: int) -> str | None:
    """A sentence for a ``MixturePlan.deviation_report`` over one sample, else None."""
    if worst <= 1:
        return None
    return (
        f"mixture source {who!r} ends step {step} {float(worst):.3f} samples "
        f"({fraction_text(worst)}) from its exact target, more than one: from the counts "
        "the earlier steps left, no counts of that step keep every source within one sample "
        "(weight 0 draws nothing, and earlier steps do not depend on later weights). Other "
        f"weights at step {step}, or a change one step earlier or later, may stay within one "
        "sample: `zephon plan --mixture` prints a schedule's worst deviation."
    )


class _Repeat:
    """Steps that repeat an earlier block of segments: ``block`` covers the
    ``span`` steps from slot ``block_slot``, and every repetition adds ``delta``
    to each source's count (the residuals are the same at each block start).
    The last repetition may be partial (``end_step`` need not be a whole number
    of spans away)."""

    def __init__(
        self,
        weights: list[Fraction],
        first_step: int,
        end_step: int | None,
        first_slot: int,
        start_counts: np.ndarray,
        start_targets: list[Fraction],
        block: list[_Segment],
        block_slot: int,
        delta: np.ndarray,
        span: int,
    ) -> None:
        self.weights = weights
        self.first_step, self.end_step = first_step, end_step
        self.first_slot = first_slot
        self.slots = first_slot - block_slot
        self.end_slot = (  # one batch size throughout: slots // span per step
            None
            if end_step is None
            else first_slot + (end_step - first_step) * (self.slots // span)
        )
        self.start_counts, self.start_targets = start_counts, start_targets
        self.block, self.block_slot, self.delta, self.span = block, block_slot, delta, span
        self._starts = [b.first_slot for b in block]

    def _locate(self, slot: int) -> tuple[int, int, _Segment]:
        q, within = divmod(slot - self.first_slot, self.slots)
        orig = self.block_slot + within
        return q + 1, orig, self.block[bisect.bisect_right(self._starts, orig) - 1]

    def counts(self, slot: int) -> np.ndarray:
        q, orig, seg = self._locate(slot)
        return seg.counts(orig) + q * self.delta

    def sources(self, slot: int, count: int) -> np.ndarray:
        parts = []
        while count > 0:
            _, orig, seg = self._locate(slot)
            take = min(count, int(seg.end_slot) - orig)
            parts.append(seg.sources(orig, take))
            slot, count = slot + take, count - take
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


class MixturePlan:
    """(source, sample id) of every global step, rank slice and micro-batch of a mixture.

    Built once per job from a ``MixtureSpec``, the seed and the global batch
    schedule; immutable afterwards (safe to share between loader threads).
    """

    def __init__(self, spec: MixtureSpec, seed: int, schedule: BatchSchedule) -> None:
        self.spec = spec
        self.seed = int(seed)
        self.schedule = schedule
        self.names = spec.names
        n = len(self.names)
        self.num_samples = np.array([s.num_samples for s in spec.sources], dtype=np.int64)
        self.max_epochs = [s.max_epochs for s in spec.sources]
        self._limited = any(x is not None for x in self.max_epochs)
        self.source_seeds = [source_seed(self.seed, name) for name in self.names]
        self._streams = [
            DataPlan(int(k), sd, BatchSchedule([(1, 1)]))
            for k, sd in zip(self.num_samples, self.source_seeds, strict=True)
        ]
        order = sorted(range(n), key=lambda i: self.names[i])
        ranks = [0] * n
        for r, i in enumerate(order):
            ranks[i] = r
        self.segments: list[_Segment | _Repeat] = []
        self.corrected_steps = 0
        self.first_correction: int | None = None
        counts = np.zeros(n, dtype=np.int64)
        targets = [Fraction(0)] * n
        entries = [e for _, e in _effective_entries(spec, 2**63)]
        for k, entry in enumerate(entries):
            end_step = entries[k + 1].from_step if k + 1 < len(entries) else None
            counts, targets = self._build_entry(entry, end_step, counts, targets, ranks)
        self._starts = [s.first_slot for s in self.segments]
        self.warnings = self._small_source_warnings()

    def _build_entry(
        self,
        entry: WeightEntry,
        end_step: int | None,
        counts: np.ndarray,
        targets: list[Fraction],
        ranks: list[int],
    ) -> tuple[np.ndarray, list[Fraction]]:
        """Append the segments of steps [entry.from_step, end_step); return the
        per-source counts and targets at ``end_step``.

        Earliest deadline first from the residuals the entry inherits, cut at the
        first step whose end would leave a source of weight > 0 more than one
        sample from its target; that step takes ``_least_worst_counts`` instead
        and the pattern restarts after it. When the residuals after a corrected
        step repeat those after an earlier one under the same batch size, the
        steps from there on repeat those between (the state is the same), up to
        the next batch-size change: one ``_Repeat`` holds them, and its last
        repetition may be partial, so a later entry cuts it without changing
        any step before.
        """
        schedule = self.schedule
        n = len(self.names)
        weights = [entry.weights[name] for name in self.names]
        end = None if end_step is None else schedule.first_position(end_step)
        starts = [s for s, _ in schedule.entries]
        step, corrections = entry.from_step, 0
        seen: dict[tuple[Any, ...], tuple[int, int, np.ndarray]] = {}
        while True:
            first = schedule.first_position(step)
            residual = [t - int(c) for t, c in zip(targets, counts, strict=True)]
            seg, bad, chosen = self._pattern_until_bad(
                weights, residual, ranks, step, end_step, counts, targets, corrections
            )
            if seg.end_slot is None or seg.end_slot > seg.first_slot:
                self.segments.append(seg)
            if bad is None or chosen is None:
                if end is None:
                    return counts, targets
                return seg.counts(end), [
                    t + w * (end - first) for t, w in zip(targets, weights, strict=True)
                ]
            # step `bad` takes the counts with the least worst deviation instead
            cut, gbs = schedule.first_position(bad), schedule.gbs(bad)
            counts = seg.counts(cut)
            targets = [t + w * (cut - first) for t, w in zip(targets, weights, strict=True)]
            after = [t + w * gbs for t, w in zip(targets, weights, strict=True)]
            active = seg.pattern.active
            where = np.zeros(n, dtype=np.int64)
            where[active] = np.arange(len(active))
            order = where[_spread(chosen, ranks)].astype(seg.pattern.local.dtype)
            fixed = _Segment(
                weights, bad, bad + 1, cut, cut + gbs, counts, targets,
                _Pattern(active, order, gbs, 0),
            )  # fmt: skip
            ends = [
                (abs(t - int(c) - k), i)
                for i, (t, c, k) in enumerate(zip(after, counts, chosen, strict=True))
            ]
            top = max(d for d, i in ends if weights[i] > 0)
            fixed.report = (top, next(i for d, i in ends if weights[i] > 0 and d == top), bad)
            self.segments.append(fixed)
            self.corrected_steps += 1
            if self.first_correction is None:
                self.first_correction = bad
            corrections += 1
            counts = counts + np.array(chosen, dtype=np.int64)
            targets, step = after, bad + 1
            if end_step is not None and step >= end_step:
                return counts, targets
            # the same residuals under the same batch size: the steps since repeat
            region = bisect.bisect_right(starts, step) - 1
            key = (region, *(t - int(c) for t, c in zip(targets, counts, strict=True)))
            if key not in seen:
                seen[key] = (len(self.segments), step, counts)
                continue
            index, step0, counts0 = seen[key]
            limit = starts[region + 1] if region + 1 < len(starts) else None
            if end_step is not None:
                limit = end_step if limit is None else min(limit, end_step)
            block = self.segments[index:]
            rep = _Repeat(
                weights, step, limit, schedule.first_position(step), counts, targets,
                block, schedule.first_position(step0), counts - counts0, step - step0,
            )  # fmt: skip
            self.segments.append(rep)
            if limit is None:
                return counts, targets
            last = schedule.first_position(limit)
            counts = rep.counts(last)
            targets = [
                t + w * (last - rep.first_slot) for t, w in zip(targets, weights, strict=True)
            ]
            step = limit
            seen.clear()
            if end_step is not None and step >= end_step:
                return counts, targets

    def _pattern_until_bad(
        self,
        weights: list[Fraction],
        residual: list[Fraction],
        ranks: list[int],
        step: int,
        end_step: int | None,
        counts: np.ndarray,
        targets: list[Fraction],
        corrections: int,
    ) -> tuple[_Segment, int | None, list[int] | None]:
        """The earliest-deadline segment from ``step`` with these residuals, cut at
        the first step it would end more than one sample off where other counts do
        better; that step and those counts (None, None if none or no correction is
        allowed). A short probe of the next steps comes first: right after a
        correction the next miss is often close."""
        schedule = self.schedule
        first = schedule.first_position(step)
        end = None if end_step is None else schedule.first_position(end_step)
        period = math.lcm(*(w.denominator for w in weights))
        probe_step = step + _PROBE_STEPS if end_step is None else min(end_step, step + _PROBE_STEPS)
        probe = schedule.first_position(probe_step) - first
        tries = [(probe_step, probe)] if probe < period and probe_step != end_step else []
        for last_step, length in [*tries, (end_step, None if end is None else end - first)]:
            active, local, prefix, cycle = _simulate(weights, residual, ranks, length)
            seg = _Segment(
                weights, step, last_step, first, None if length is None else first + length,
                counts, targets, _Pattern(active, local, prefix, cycle),
            )  # fmt: skip
            if corrections >= _MAX_CORRECTIONS or len(active) < 2:
                if last_step == end_step:
                    return seg, None, None
                continue
            steps, positions = seg.step_ends(schedule)
            worst, who, scale = seg.deviations(positions)
            bad = chosen = None
            for k in np.flatnonzero(worst > scale)[np.argsort(steps[worst > scale])]:
                chosen = self._better_counts(
                    seg, int(steps[k]), Fraction(int(worst[k]), scale), ranks
                )
                if chosen is not None:
                    bad = int(steps[k])
                    break
            if bad is not None:
                seg.end_step, seg.end_slot = bad, schedule.first_position(bad)
                keep = steps < bad
                steps, worst, who = steps[keep], worst[keep], who[keep]
            seg.report = _worst_of(steps, worst, who, scale)
            if bad is not None or last_step == end_step:
                return seg, bad, chosen
        return seg, None, None

    def _better_counts(
        self, seg: _Segment, step: int, worst: Fraction, ranks: list[int]
    ) -> list[int] | None:
        """``_least_worst_counts`` of ``step`` (in ``seg``) if they end it closer than
        the pattern's ``worst`` (the sources of weight > 0), else None."""
        slot, gbs = self.schedule.first_position(step), self.schedule.gbs(step)
        counts = seg.counts(slot)
        after = [
            t + w * (slot - seg.first_slot + gbs)
            for t, w in zip(seg.start_targets, seg.weights, strict=True)
        ]
        deficit = [t - int(c) for t, c in zip(after, counts, strict=True)]
        chosen = _least_worst_counts(deficit, seg.weights, gbs, ranks)
        best = max(
            abs(d - k) for d, k, w in zip(deficit, chosen, seg.weights, strict=True) if w > 0
        )
        return chosen if best < worst else None

    # ------------------------------------------------------------ accounting

    def _small_source_warnings(self) -> list[str]:
        out = []
        sched = self.schedule.entries
        entries = [e for _, e in _effective_entries(self.spec, 2**63)]
        for k, entry in enumerate(entries):
            lo = entry.from_step
            hi = entries[k + 1].from_step if k + 1 < len(entries) else None
            sizes = {g for s, g in sched if (hi is None or s < hi) and s >= lo}
            sizes.add(self.schedule.gbs(lo))
            gbs = max(sizes)
            for i, name in enumerate(self.names):
                w = entry.weights[name]
                share = math.ceil(w * gbs)
                if share > self.num_samples[i]:
                    out.append(
                        f"mixture source {name!r} has {self.num_samples[i]} training "
                        f"samples but weight {fraction_text(w)} of a global batch of {gbs} "
                        f"(schedule entry from_step {lo}) asks up to {share} per step: its "
                        "samples repeat within a step."
                    )
        return out

    def _segment_of(self, slot: int) -> _Segment | _Repeat:
        return self.segments[bisect.bisect_right(self._starts, slot) - 1]

    def step_slots(self, step: int) -> tuple[int, int]:
        """(first slot, number of slots) of global step ``step``."""
        return self.schedule.first_position(step), self.schedule.gbs(step)

    def counts_at_slot(self, slot: int) -> np.ndarray:
        """Per-source number of slots among [0, slot) (int64, mixture order)."""
        if slot < 0:
            raise ValueError(f"slots are >= 0, got {slot}.")
        return self._segment_of(slot).counts(slot)

    def counts_before(self, step: int) -> np.ndarray:
        """Per-source samples drawn by steps 1 .. step-1 (each source's next stream position)."""
        return self.counts_at_slot(self.step_slots(step)[0])

    def step_counts(self, step: int) -> np.ndarray:
        """Per-source samples of step ``step``."""
        first, gbs = self.step_slots(step)
        return self.counts_at_slot(first + gbs) - self.counts_at_slot(first)

    def targets_before(self, step: int) -> list[Fraction]:
        """Exact per-source targets ``sum over steps < step of w x GBS``."""
        slot = self.step_slots(step)[0]
        seg = self._segment_of(slot)
        return [
            t + w * (slot - seg.first_slot)
            for t, w in zip(seg.start_targets, seg.weights, strict=True)
        ]

    def epochs(self, step: int) -> np.ndarray:
        """Per-source epoch of the next sample each source draws at ``step``."""
        return self.counts_before(step) // self.num_samples

    def max_deviation(self) -> tuple[Fraction, str]:
        """(worst |count - target| over the end of every step of the infinite
        stream, its source). Exact. Below 1 for a single schedule entry."""
        worst, who, _ = self.deviation_report()
        return worst, who

    def deviation_report(self) -> tuple[Fraction, str, int]:
        """``max_deviation`` and the first step whose end reaches it."""
        worst, who, when = Fraction(0), self.names[0], 1
        for seg in self.segments:
            if isinstance(seg, _Repeat):  # the same deviations as its block, earlier
                continue
            for i, w in enumerate(seg.weights):  # sources of weight 0 keep their residual
                r = abs(seg.start_targets[i] - int(seg.start_counts[i]))
                if w == 0 and r > worst:
                    worst, who, when = r, self.names[i], seg.first_step
            if seg.report is None:
                steps, positions = seg.step_ends(self.schedule)
                seg.report = _worst_of(steps, *seg.deviations(positions))
            value, source, step = seg.report
            if value > worst:
                worst, who, when = value, self.names[source], step
        return worst, who, when

    def check_max_epochs(self, last_step: int) -> None:
        """Raise MixtureError if steps 1..``last_step`` run a source past its max_epochs."""
        total = self.counts_before(last_step + 1)
        for i, limit in enumerate(self.max_epochs):
            if limit is None or total[i] <= limit * self.num_samples[i]:
                continue
            lo, hi = 1, last_step  # first step whose end exceeds the limit
            while lo < hi:
                mid = (lo + hi) // 2
                if self.counts_before(mid + 1)[i] > limit * self.num_samples[i]:
                    hi = mid
                else:
                    lo = mid + 1
            raise self._epoch_error(i, lo)

    def _epoch_error(self, i: int, step: int | None) -> MixtureError:
        limit, n = self.max_epochs[i], int(self.num_samples[i])
        when = "" if step is None else f" at step {step}"
        return MixtureError(
            f"mixture source {self.names[i]!r} runs past max_epochs={limit}{when}: it has {n} "
            f"training samples and its share of the steps so far needs more than {limit * n}. "
            "Raise its max_epochs, lower its weight, train fewer steps or add data."
        )

    # ------------------------------------------------------------ sample ids

    def slot_sources(self, first: int, count: int) -> np.ndarray:
        """Source index (int64) of each slot in [first, first + count)."""
        out = np.empty(count, dtype=np.int64)
        done = 0
        while done < count:
            slot = first + done
            k = bisect.bisect_right(self._starts, slot) - 1
            seg = self.segments[k]
            stop = first + count if seg.end_slot is None else min(first + count, seg.end_slot)
            out[done : done + stop - slot] = seg.sources(slot, stop - slot)
            done += stop - slot
        return out

    def ids_for_slots(
        self, first: int, count: int, *, step: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(source index, sample id) arrays (int64) of slots [first, first + count)."""
        return self.ids_for_ranges([(first, count)], step=step)

    def ids_for_ranges(
        self, ranges: Sequence[tuple[int, int]], *, step: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(source index, sample id) of the slots of ``ranges`` ([first, first + count)
        each), concatenated in order: a window of a DP rank's stream across steps.

        Each slot's source comes from its segment's pattern, its position in that
        source's stream from the counts before its range; the ids are then looked up
        with one permutation call per source and epoch for the whole window.
        """
        merged: list[tuple[int, int]] = []
        for first, count in ranges:  # adjacent ranges (one DP rank of one) as one
            if merged and merged[-1][0] + merged[-1][1] == first:
                merged[-1] = (merged[-1][0], merged[-1][1] + count)
            elif count:
                merged.append((first, count))
        sources_parts, positions_parts = [], []
        for first, count in merged:
            src = self.slot_sources(first, count)
            order = np.argsort(src, kind="stable")  # each source's slots, in slot order
            sorted_src = src[order]
            starts = np.searchsorted(sorted_src, sorted_src, side="left")
            occurrence = np.empty(count, dtype=np.int64)
            occurrence[order] = np.arange(count, dtype=np.int64) - starts
            sources_parts.append(src)
            positions_parts.append(self.counts_at_slot(first)[src] + occurrence)
        if not sources_parts:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        sources = np.concatenate(sources_parts)
        positions = np.concatenate(positions_parts)
        return sources, self._stream_ids(sources, positions, step)

    def _stream_ids(
        self, sources: np.ndarray, positions: np.ndarray, step: int | None
    ) -> np.ndarray:
        """Sample ids of stream ``positions`` of ``sources``: the (source, epoch)
        permutations evaluated together (``map_many``), each built once per call."""
        epochs, within = np.divmod(positions, self.num_samples[sources])
        stride = int(epochs.max()) + 1 if epochs.size else 1
        if (len(self.names) + 1) * stride < 1 << 62:  # (source, epoch) as one int64
            codes, which = np.unique(sources * stride + epochs, return_inverse=True)
            first, second = np.divmod(codes, stride)
        else:
            (first, second), which = np.unique(
                np.stack([sources, epochs]), axis=1, return_inverse=True
            )
        pairs = list(zip(first.tolist(), second.tolist(), strict=True))
        if self._limited:
            for i, epoch in pairs:
                limit = self.max_epochs[i]
                if limit is not None and epoch >= limit:
                    raise self._epoch_error(i, step)
        streams = self._streams
        perms = [streams[i].permutation(epoch) for i, epoch in pairs]
        return map_many(perms, which.ravel(), within)

    def global_ids(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source index, sample id) of every slot of global step ``step``, in order."""
        first, gbs = self.step_slots(step)
        return self.ids_for_slots(first, gbs, step=step)

    def rank_slots(self, step: int, dp_rank: int, dp_degree: int) -> tuple[int, int]:
        """(first slot, count) of DP rank ``dp_rank``'s contiguous slice of ``step``."""
        return rank_slice(*self.step_slots(step), step, dp_rank, dp_degree)

    def rank_ids(self, step: int, dp_rank: int, dp_degree: int) -> tuple[np.ndarray, np.ndarray]:
        """Slots [r*G/D, (r+1)*G/D) of the step: (source index, sample id)."""
        return self.ids_for_slots(*self.rank_slots(step, dp_rank, dp_degree), step=step)

    def microbatch_ids(
        self, step: int, dp_rank: int, dp_degree: int, local_batch_size: int
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """The rank slice cut, in order, into micro-batches of ``local_batch_size``."""
        check_batch_layout(self.schedule.gbs(step), dp_degree, local_batch_size)
        src, ids = self.rank_ids(step, dp_rank, dp_degree)
        b = local_batch_size
        return [(src[k : k + b], ids[k : k + b]) for k in range(0, len(ids), b)]
