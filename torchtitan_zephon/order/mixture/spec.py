"""A resolved mixture: what fixes its sample stream, and what changed between two.

Role: ``resolve_mixture`` checks a ``MixtureConfig``'s opened stores against each
other (one tokenizer, enough samples) and fixes each source's training and
held-out samples; the ``MixtureSpec`` it returns (store fingerprints, sample
counts, exact weights) is what the data config records. ``past_changes`` names
every difference between two specs that changes the samples of steps 1..k.

Invariants: ``MixtureSpec.to_json`` is canonical (no paths, no ``max_epochs``),
so the data-config fingerprint hashes exactly what fixes the samples;
``past_changes(old, new, k) == []`` exactly when steps 1..k draw the same samples
under both (the seed, seq_len and batch schedule are the data config's to compare).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from torchtitan_zephon.order.data_config import config_text
from torchtitan_zephon.order.mixture.config import (
    MixtureConfig,
    MixtureError,
    WeightEntry,
    fraction_text,
    parse_schedule,
)
from torchtitan_zephon.order.store_size import no_sample_text, store_fix

SPEC_FORMAT = "zephon-mixture/2"
_OLD_SPEC_FORMATS = ("zephon-mixture/1",)
"""Read, not written. Rule 1 had no corrected steps: for a schedule where rule 2
corrects none (``MixturePlan.first_correction`` is None) both draw the same."""


@dataclass(frozen=True)
class ResolvedSource:
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

    sources: tuple[ResolvedSource, ...]
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
                ResolvedSource(n, f"unfingerprinted:{n}", int(k), 0, me.get(n))
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
        reads (a run continued under its saved rule, ``order.resume.check_resume``)."""
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
                ResolvedSource(
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
    available: Mapping[str, int] | None = None,
) -> MixtureSpec:
    """Check the opened stores against each other and fix each source's sample count.

    ``stores`` maps source name -> an opened store (``TokenStore`` or anything with
    ``fingerprint``, ``tokenizer_hash``, ``vocab_size``, ``eos_id``, ``dtype`` and
    ``num_samples(seq_len)``). All sources must share one tokenizer (hash, vocab
    size, EOS id) and token dtype; ``tokenizer`` (the sha256 of the job's
    tokenizer.json and the setting that names it) tells which is right when the
    sources disagree. A source keeps its last ``heldout_samples`` (default
    ``default_heldout``) for validation. ``available`` (source name -> samples) counts
    another kind of sample than the store's windows: packed samples (``job.packed``).
    """
    missing = [n for n in config.names if n not in stores]
    if missing:
        raise MixtureError(f"no opened store for mixture source {missing[0]!r}.")
    _check_one_tokenizer(config.names, stores, tokenizer)
    ref = stores[config.sources[0].name]
    out = []
    for s in config.sources:
        st = stores[s.name]
        total = int(st.num_samples(seq_len) if available is None else available[s.name])
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
        out.append(ResolvedSource(s.name, st.fingerprint, total - held, held, s.max_epochs))
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


def effective_entries(spec: MixtureSpec, step: int) -> list[tuple[int, WeightEntry]]:
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
    old_past, new_past = effective_entries(old, step), effective_entries(new, step)
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
