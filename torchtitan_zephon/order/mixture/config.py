"""A mixture file: its ``[[source]]`` entries and its weight schedule, parsed and checked.

Role: turn the TOML (or its JSON record) into a ``MixtureConfig``: the sources
by name with their store values (relative paths taken relative to the file,
``rebase``), and the weight schedule (``parse_schedule``: exact rationals,
normalized by their sum). Nothing here opens a store: ``job.stores.open_mixture_stores``
does.

Invariants: weights are exact (decimals as written, never binary floats); every
entry's common denominator is at most ``MAX_PATTERN``; source names are unique
and every entry weighs exactly the declared sources. Errors are ``MixtureError``
naming the file, the entry and what to write instead.
"""

from __future__ import annotations

import decimal
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from torchtitan_zephon.order.data_config import config_text
from torchtitan_zephon.store.format import BUILTIN_PREFIX
from torchtitan_zephon.store.urls import is_url, mistyped_url, redact

MAX_PATTERN = 10**6
"""Largest common denominator of one schedule entry's normalized weights: the
length of its position pattern. 0.7/0.3 gives 10, three weights of 0.001/0.499/0.5
give 1000; seven-decimal weights that do not simplify are refused."""
_SOURCE_KEYS = {"name", "store", "heldout_samples", "max_epochs"}
_ENTRY_KEYS = {"from_step", "weights"}


class MixtureError(ValueError):
    """A mixture file, spec or plan request is invalid."""


def fraction_text(value: Fraction) -> str:
    """Exact text of a weight: ``"7/10"``, ``"1/1"``, ``"0/1"``."""
    return f"{value.numerator}/{value.denominator}"


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
        """Common denominator of the weights: the position pattern length."""
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
class SourceEntry:
    """A ``[[source]]`` of a mixture file. ``None`` fields take the job's defaults."""

    name: str
    store: str
    heldout_samples: int | None = None
    max_epochs: int | None = None


def _parse_sources(raw: Any, origin: str, base_dir: Path | None) -> tuple[SourceEntry, ...]:
    if not isinstance(raw, list) or not raw:
        raise MixtureError(
            f"{origin}: needs at least one [[source]] with name and store, "
            'e.g. [[source]] name = "web" store = "/data/web".'
        )
    out: list[SourceEntry] = []
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
        out.append(SourceEntry(name, store, held, max_epochs))
    return tuple(out)


@dataclass(frozen=True)
class MixtureConfig:
    """A parsed mixture file: sources (with store paths) and the weight schedule."""

    sources: tuple[SourceEntry, ...]
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
        """Read a mixture file; relative store paths are taken relative to its folder.
        The file itself is local (its stores may be URLs)."""
        if is_url(path):
            raise MixtureError(
                f"mixture file {redact(str(path))!r} is a URL; a mixture file is read from a "
                "local path (a URL is never taken as a path). Copy it next to the job; its "
                "[[source]] store values may be URLs."
            )
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


def rebase(value: str, base: Path) -> str:
    """``value`` with its relative paths (or each relative item of a comma list) taken
    relative to ``base`` (a mixture file's folder); builtin parts and URLs stay (a URL is
    never taken as a path)."""
    if value.startswith(BUILTIN_PREFIX) or os.path.isabs(value) or is_url(value):
        return value
    if mistyped_url(value):  # refused where it is opened, as written
        return value
    if os.path.lexists(base / value) or "," not in value:
        return str(base / value)
    return ",".join(
        p if os.path.isabs(p.strip()) or mistyped_url(p.strip()) else str(base / p.strip())
        for p in value.split(",")
    )
