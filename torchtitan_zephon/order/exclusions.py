"""Left-out samples: sample ids deleted from a source's stream from a step on (bad data).

Role: ``Exclusions`` is the setting ``zephon.exclude = FILE``, a JSON-lines file of
entries ``{"source": NAME, "ids": [...], "from_step": S}`` (``source`` omitted for a
single store, required for a mixture), parsed and checked against the job's data with
errors that name the line and what was expected. Its canonical form binds the data
config (``EXCLUDE_FIELD``: per entry its step, source, count and a sha256 of its ids,
never the file's path or layout). ``ExclusionMap`` is one source's map from an
*effective* stream position (what the skip map, ``order.skips``, gives) to the
position of the source's sample stream (epoch ``q // n``, ``Permutation(n, seed,
epoch)[q % n]``), built by the stream that owns the source (``order.stream.DataPlan``,
``order.mixture.plan.MixturePlan``).

The composition, per source: training position p -> skip map -> effective position
e -> exclusion map -> stream position q -> epoch / permutation -> sample id.

The map. Entries are merged per (source, from_step) and then canonical: entry j of a
source holds only the ids no earlier entry of that source left out (lists are unioned
across entries: an id left out from an earlier step stays left out). Let t_j be the
source's effective position where step S_j starts: its count at the first position of
step S_j plus what the skip entries with S <= S_j skip from it (so a skip at S_j or
before consumes its data before the entry takes effect, a skip after S_j consumes
data the entry already left out), and A_j the ids of entries 1..j.
Effective positions e < t_1 are stream positions unchanged. For t_j <= e < t_{j+1},
e maps to the (e - t_j + 1)-th stream position >= R_j whose sample is not in A_j,
where R_j is one past the stream position of e = t_j - 1 (R_1 = t_1).

Invariants:
- From step S_j on, no sample of A_j is trained: every stream position the map gives
  from t_j on holds a sample outside A_j; within an epoch every other sample still
  appears at most once (the map is increasing), so each epoch trains exactly the
  n - |A_j| samples not left out, in the permutation's order.
- Effective positions before t_j are not moved by entry j: an entry for a step not
  yet trained changes no trained step. A step's ids digest binds the entries with
  from_step <= its step only (``order.data_config.DataConfig.step_key``).
- The map is a function of the effective position alone: the same at every DP
  degree, rank slice, micro-batch and window; a mixture keeps its per-source counts
  (the position assignment is untouched: the source's next sample fills the position).
- Cost: per (entry level, epoch) the sorted in-epoch positions of the left-out ids,
  through ``Permutation.inverse`` (O(|A| log |A|), cached); a lookup is one
  ``searchsorted`` (O(log |A|)), whatever the step: no scan of the stream.
- The way back (``ExclusionMap.effective``, what ``zephon where`` asks): the map is
  strictly increasing, and every stream position q it does not reach holds a sample
  left out there. Stream position q lies in level j when R_j <= q < R_{j+1} (level 0:
  q < R_1 = t_1, where e = q). ``effective(raw(e)) == (e, 0)`` for every effective
  position e, and a q that ``raw`` never gives is ``(-1, S)``: its sample is in A_j,
  and S is the from_step of the one entry (of 1..j) that holds it ("left out from
  step S"). Same cost: one ``searchsorted`` per position (plus one permutation
  lookup for a left-out one).
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchtitan_zephon.order.permutation import Permutation
from torchtitan_zephon.order.skips import MAX_STEP

EXCLUDE_FIELD = "exclude"
"""The extra config field holding the canonical left-out entries (``Exclusions.to_json``);
absent when nothing is left out."""
EXCLUDE_HELP = (
    'expected one JSON object per line: {"source": NAME, "ids": [ID, ...], "from_step": S} '
    '(S >= 1; "source" omitted for a single store, one of the mixture\'s sources otherwise), '
    'e.g. {"ids": [17, 4242], "from_step": 1200}'
)
_KEYS = {"source", "ids", "from_step"}
_CACHED_EPOCHS = 4  # (level, epoch) tables kept per source: consecutive steps share one


@dataclass(frozen=True)
class SourceRange:
    """A source's sample ids as a left-out list may name them: training ids
    ``[first, first + count)``, held-out (validation) ids ``[first + count, total)``."""

    first: int
    count: int
    total: int


@dataclass(frozen=True, eq=False)
class ExcludeEntry:
    """One canonical entry: ``ids`` (sorted, unique int64) left out of ``source`` (None:
    the only store) from step ``from_step`` on, none of them left out by an earlier entry."""

    source: str | None
    from_step: int
    ids: np.ndarray

    @functools.cached_property
    def sha256(self) -> str:
        return hashlib.sha256(b"zephon-exclude-v1:" + self.ids.astype("<i8").tobytes()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"from_step": self.from_step, "ids": int(self.ids.size)}
        if self.source is not None:
            out["source"] = self.source
        out["sha256"] = self.sha256
        return out


class Exclusions:
    """The left-out entries of a ``zephon.exclude`` file (module docstring), canonical."""

    def __init__(self, lines: Sequence[tuple[int, str | None, int, np.ndarray]], origin: str):
        self.origin = origin
        self._lines = list(lines)  # (line number, source, from_step, ids) as written
        merged: dict[tuple[int, str], list[np.ndarray]] = {}
        for _, source, step, ids in self._lines:
            merged.setdefault((step, source or ""), []).append(ids)
        seen: dict[str, np.ndarray] = {}
        entries = []
        for step, name in sorted(merged):
            ids = np.unique(np.concatenate(merged[(step, name)]).astype(np.int64))
            before = seen.get(name)
            if before is not None:
                ids = ids[~np.isin(ids, before, assume_unique=True)]
            if ids.size:
                seen[name] = ids if before is None else np.union1d(before, ids)
                entries.append(ExcludeEntry(name or None, step, ids))
        self.entries: tuple[ExcludeEntry, ...] = tuple(entries)

    @classmethod
    def load(cls, path: str, setting: str = "zephon.exclude") -> Exclusions:
        """Read and parse ``path``; ValueError (one line, naming the line) otherwise."""
        origin = f"{setting} file {path}"
        try:
            with open(path, "rb") as f:
                text = f.read().decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"cannot read {origin}: it is not UTF-8 text ({e.reason} at byte {e.start}); "
                f"{EXCLUDE_HELP}."
            ) from None
        except OSError as e:
            raise ValueError(
                f"cannot read {origin}: {e.strerror or e}. Point {setting} at a JSON-lines "
                f"file of left-out sample ids; {EXCLUDE_HELP}."
            ) from None
        return cls.parse(text, origin)

    @classmethod
    def parse(cls, text: str, origin: str = "zephon.exclude") -> Exclusions:
        lines = []
        for number, raw in enumerate(text.splitlines(), start=1):
            if not raw.strip():
                continue
            where = f"{origin}, line {number}"
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where} is not JSON ({e.msg}); {EXCLUDE_HELP}.") from None
            except RecursionError:
                raise ValueError(
                    f"{where} is not JSON this reader takes (nested too deeply); {EXCLUDE_HELP}."
                ) from None
            if not isinstance(obj, dict):
                raise ValueError(
                    f"{where} is {raw.strip()[:60]}, not a JSON object; {EXCLUDE_HELP}."
                )
            unknown = sorted(set(obj) - _KEYS)
            if unknown:
                raise ValueError(f"{where} has unknown key(s) {unknown}; {EXCLUDE_HELP}.")
            step = obj.get("from_step")
            if "from_step" not in obj or not _whole(step):
                raise ValueError(
                    f"{where}: from_step is {json.dumps(step) if 'from_step' in obj else 'missing'}"
                    f", expected a whole number >= 1 (the first step that leaves the ids out); "
                    f"{EXCLUDE_HELP}."
                )
            if step < 1:
                raise ValueError(
                    f"{where}: from_step is {step}; steps are 1-based, so from_step must be "
                    f">= 1; {EXCLUDE_HELP}."
                )
            if step > MAX_STEP:
                raise ValueError(
                    f"{where}: from_step is {step}, past the largest step a plan takes "
                    f"({MAX_STEP}); {EXCLUDE_HELP}."
                )
            source = obj.get("source")
            if "source" in obj and (not isinstance(source, str) or not source):
                raise ValueError(
                    f"{where}: source is {json.dumps(source)}, expected the name of a mixture "
                    f"source (a non-empty string); {EXCLUDE_HELP}."
                )
            ids = obj.get("ids")
            if not isinstance(ids, list) or not all(_whole(i) for i in ids):
                bad = ids if not isinstance(ids, list) else next(i for i in ids if not _whole(i))
                raise ValueError(
                    f"{where}: ids {'holds ' if isinstance(ids, list) else 'is '}"
                    f"{json.dumps(bad)[:60]}, expected a list of whole sample ids; {EXCLUDE_HELP}."
                )
            if any(abs(i) >= 1 << 62 for i in ids):
                raise ValueError(f"{where}: ids holds a sample id beyond 2**62; {EXCLUDE_HELP}.")
            lines.append((number, source, int(step), np.array(ids, dtype=np.int64)))
        return cls(lines, origin)

    def check(self, sources: Mapping[str | None, SourceRange]) -> None:
        """Refuse entries that do not fit the data: ``sources`` maps each source name
        (None: the job's only store) to its ids. ValueError, one line, names the line."""
        mixture = None not in sources
        names = sorted(str(n) for n in sources)
        for number, source, _, ids in self._lines:
            where = f"{self.origin}, line {number}"
            if mixture and source is None:
                raise ValueError(
                    f'{where} has no "source": the job reads a mixture, so each entry names '
                    f"one of its sources ({', '.join(map(repr, names))})."
                )
            if mixture and source not in sources:
                raise ValueError(
                    f"{where}: source {source!r} is not a source of the mixture; its sources "
                    f"are {', '.join(map(repr, names))}."
                )
            if not mixture and source is not None:
                raise ValueError(
                    f'{where} names "source": {json.dumps(source)}, but the job reads one store '
                    'and no mixture: drop "source" from the entry.'
                )
            r = sources[source]
            what = "the store" if source is None else f"source {source!r}"
            train = f"[{r.first}, {r.first + r.count})"
            outside = ids[(ids < 0) | (ids >= r.total) | (ids < r.first)]
            if outside.size:
                raise ValueError(
                    f"{where}: id {int(outside[0])} is not a sample of {what}, whose training "
                    f"samples are ids {train} (as `zephon plan` prints them); fix or drop it."
                )
            held = ids[ids >= r.first + r.count]
            if held.size:
                raise ValueError(
                    f"{where}: id {int(held[0])} is a held-out (validation) sample of {what} "
                    f"(ids [{r.first + r.count}, {r.total}) are held out, {train} trained): "
                    "validation reads it and it is never trained; drop it from the list."
                )
        for name, r in sources.items():
            left = sum(int(e.ids.size) for e in self.entries if e.source == name)
            if left >= r.count > 0:
                what = "the store" if name is None else f"source {name!r}"
                raise ValueError(
                    f"{self.origin} leaves out all {r.count} training samples of {what}: an "
                    "epoch would have no sample to draw. Leave out fewer ids"
                    + (", or give the source weight 0 in the mixture." if name else ".")
                )

    def __bool__(self) -> bool:
        return bool(self.entries)

    def to_json(self) -> list[dict[str, Any]]:
        """The canonical entries as the data config binds them (field ``exclude``)."""
        return [e.to_json() for e in self.entries]

    def for_source(self, name: str | None) -> list[ExcludeEntry]:
        return [e for e in self.entries if e.source == name]

    def describe(self) -> list[str]:
        """One sentence per canonical entry, for ``zephon plan`` and logs."""
        out = []
        for e in self.entries:
            shown = ", ".join(map(str, e.ids[:8].tolist())) + (", ..." if e.ids.size > 8 else "")
            who = "" if e.source is None else f" of source {e.source!r}"
            out.append(
                f"from step {e.from_step}, leave out {e.ids.size} sample id"
                f"{'s' * (e.ids.size != 1)}{who} ({shown}): they are never trained from "
                f"step {e.from_step} on, each source's next sample fills their slots"
            )
        return out


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def entries_up_to(value: Any, step: int) -> list[Any]:
    """The saved canonical entries (``Exclusions.to_json``) with from_step <= ``step``."""
    return [e for e in (value or []) if int(e["from_step"]) <= step]


def describe_saved(entries: Sequence[Mapping[str, Any]]) -> str:
    """Saved canonical entries in words (``(none)`` for none)."""
    if not entries:
        return "(none)"
    return "; ".join(
        f"from step {e['from_step']}, {e['ids']} id{'s' * (e['ids'] != 1)}"
        + (f" of source {e['source']!r}" if "source" in e else "")
        + f" (sha256 {str(e['sha256'])[:12]})"
        for e in entries
    )


class ExclusionMap:
    """One source's map from effective positions to stream positions (module docstring).

    ``thresholds[j]`` is t_j (non-decreasing), ``new_ids[j]`` the permutation indices
    (``[0, n)``) entry j adds, ``from_steps[j]`` its from_step S_j; ``n`` and ``seed``
    are the source's permutation's."""

    def __init__(
        self,
        n: int,
        seed: int,
        thresholds: Sequence[int],
        new_ids: Sequence[np.ndarray],
        from_steps: Sequence[int],
    ) -> None:
        self.n, self.seed = int(n), int(seed)
        self.thresholds = np.asarray(thresholds, dtype=np.int64)
        if np.any(np.diff(self.thresholds) < 0):
            raise ValueError("exclusion thresholds must be non-decreasing.")
        self._ids = [np.asarray(x, dtype=np.int64) for x in new_ids]
        self.from_steps = [int(s) for s in from_steps]
        if len(self.from_steps) != len(self._ids) or len(self._ids) != self.thresholds.size:
            raise ValueError("an exclusion map needs one threshold and from_step per entry.")
        self.left_out = np.concatenate([[0], np.cumsum([x.size for x in self._ids])])
        if self.left_out[-1] >= self.n:
            raise ValueError(f"an exclusion map leaves none of {self.n} samples.")
        self._tables: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        k = len(self._ids)
        self._m0 = np.zeros(k + 1, dtype=np.int64)  # level L's index, among kept, of R_L
        self._starts = np.zeros(k, dtype=np.int64)  # R_1 .. R_k
        for level in range(1, k + 1):
            t = int(self.thresholds[level - 1])
            start = 0 if t == 0 else int(self.raw(np.array([t - 1]))[0]) + 1
            self._starts[level - 1] = start
            self._m0[level] = self._kept_before(level, start)

    def table(self, level: int, epoch: int) -> np.ndarray:
        """D = sorted in-epoch positions of the ids of entries 1..``level``, minus
        0, 1, 2, ...: D[i] is how many kept positions come before the i-th left out."""
        key = (level, epoch)
        with self._lock:
            found = self._tables.get(key)
            if found is not None:
                self._tables.move_to_end(key)
                return found
            ids = np.concatenate(self._ids[:level])
            positions = np.sort(Permutation(self.n, self.seed, epoch).inverse(ids))
            positions -= np.arange(positions.size, dtype=np.int64)
            self._tables[key] = positions
            while len(self._tables) > _CACHED_EPOCHS:
                self._tables.popitem(last=False)
            return positions

    def _kept_before(self, level: int, q: int) -> int:
        """Stream positions before ``q`` whose sample entries 1..``level`` keep."""
        epoch, within = divmod(q, self.n)
        kept = self.n - int(self.left_out[level])
        d = self.table(level, epoch)
        below = int(np.searchsorted(d + np.arange(d.size, dtype=np.int64), within, side="left"))
        return epoch * kept + within - below

    def raw(self, effective: np.ndarray) -> np.ndarray:
        """Stream positions (int64) of the effective positions ``effective`` (any shape)."""
        e = np.asarray(effective, dtype=np.int64)
        if not e.size:
            return e.copy()
        level = np.searchsorted(self.thresholds, e, side="right")
        lo, hi = int(level.min()), int(level.max())
        if hi == 0:
            return e.copy()
        if lo == hi:  # the usual case: one level (and one epoch) for a whole step
            return self._raw_at(lo, e)
        out = e.copy()
        for lv in range(max(lo, 1), hi + 1):
            sel = level == lv
            if sel.any():
                out[sel] = self._raw_at(lv, e[sel])
        return out

    def _raw_at(self, level: int, e: np.ndarray) -> np.ndarray:
        """``raw`` of effective positions that all lie in ``level``'s range."""
        kept = self.n - int(self.left_out[level])
        epochs, r = np.divmod(self._m0[level] + (e - self.thresholds[level - 1]), kept)
        first, last = int(epochs.min()), int(epochs.max())
        if first == last:
            return first * self.n + r + np.searchsorted(self.table(level, first), r, "right")
        z = np.empty_like(r)
        for epoch in range(first, last + 1):
            at = epochs == epoch
            if at.any():
                rr = r[at]
                z[at] = rr + np.searchsorted(self.table(level, epoch), rr, side="right")
        return epochs * self.n + z

    def effective(self, stream: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The inverse of ``raw`` (module docstring, the way back): per stream position
        in ``stream`` (any shape), (its effective position, 0), or (-1, S) when its
        sample is left out there by the entry with from_step S."""
        q = np.asarray(stream, dtype=np.int64)
        e, by = q.copy(), np.zeros(q.shape, dtype=np.int64)
        level = np.searchsorted(self._starts, q, side="right")
        for lv in np.unique(level[level > 0]).tolist():
            sel = level == lv
            epochs, within = np.divmod(q[sel], self.n)
            out, left = np.empty_like(within), np.zeros_like(within)
            for epoch in np.unique(epochs).tolist():
                at = epochs == epoch
                w = within[at]
                d = self.table(lv, epoch)
                positions = d + np.arange(d.size, dtype=np.int64)  # left-out, in the epoch
                below = np.searchsorted(positions, w, side="left")
                hit = below < positions.size
                hit[hit] = positions[below[hit]] == w[hit]
                out[at] = epoch * (self.n - int(self.left_out[lv])) + w - below
                if hit.any():
                    left[np.flatnonzero(at)[hit]] = self._left_out_by(
                        lv, Permutation(self.n, self.seed, epoch).map(w[hit])
                    )
            kept = self.thresholds[lv - 1] + out - self._m0[lv]
            e[sel] = np.where(left == 0, kept, -1)
            by[sel] = left
        return e, by

    def _left_out_by(self, level: int, indices: np.ndarray) -> np.ndarray:
        """The from_step of the entry (of 1..``level``) holding each permutation index."""
        out = np.zeros(indices.shape, dtype=np.int64)
        for j in range(level):
            found = (out == 0) & np.isin(indices, self._ids[j])
            out[found] = self.from_steps[j]
        return out
