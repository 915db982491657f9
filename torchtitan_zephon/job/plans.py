"""A data config's plan, and what it tells, without opening a store.

Role: ``plan_of(config, anchor)`` rebuilds the plan a data config governs (a
``DataPlan`` for one store, a ``MixtureStream`` for a mixture); plans are built
here, never in the engine's resume rule: ``first_correction(config)`` is what
``order.resume.check_resume`` asks of a mixture saved under another rule, and
``decide_resume`` is that rule as every resume asks it (the one decision).
``weights_at`` and ``mixture_progress`` are what ``zephon inspect`` tells of a
mixture's data state. ``exclusions_problem`` is the check that a left-out list is
the one a config binds (``plan_of`` refuses a plan without it).

Invariants:
- ``plan_of(config, anchor)`` gives the same keys as the job data's plan
  (``job.data``), for any process, with no store opened (``zephon inspect``).
- An accepted change of the batch schedule (a position anchor other than
  (1, 0)) keeps the position count exact; a mixture then assigns the positions from the
  anchor on as if the steps before it had been of equal size (an opted-in
  change: each source's next sample follows that plan).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import Any

from torchtitan_zephon.order.data_config import DataConfig
from torchtitan_zephon.order.exclusions import EXCLUDE_FIELD, Exclusions, describe_saved
from torchtitan_zephon.order.layout import Layout
from torchtitan_zephon.order.mixture.config import fraction_text
from torchtitan_zephon.order.mixture.plan import MixturePlan
from torchtitan_zephon.order.mixture.spec import SPEC_FORMAT, MixtureSpec
from torchtitan_zephon.order.mixture.stream import MixtureStream
from torchtitan_zephon.order.resume import ResumeDecision, check_resume
from torchtitan_zephon.order.state import DataState
from torchtitan_zephon.order.stream import DataPlan


def plan_of(
    config: DataConfig,
    anchor: tuple[int, int] = (1, 0),
    *,
    spec: MixtureSpec | None = None,
    exclusions: Exclusions | None = None,
) -> DataPlan | MixtureStream:
    """The plan a data config governs, counted from ``anchor`` (no store opened).

    ``spec`` (a mixture's resolved spec, equal to the config's) keeps guards the
    config does not record (``max_epochs``). ``exclusions``: the left-out list whose
    canonical entries the config binds (field ``exclude``: only their sha256, so the
    ids come from the list); ValueError when the config leaves samples out and no
    list, or another one, is given."""
    problem = exclusions_problem(config, exclusions)
    if problem:
        raise ValueError(
            "the data config's left-out entries (exclude) are not those of the list given "
            f"({problem}): build the config with the job data's data_config, from the same "
            "zephon.exclude file."
        )
    schedule = config.batch_schedule()
    if config.mixture is None:
        return DataPlan(
            config.num_samples,
            config.seed,
            schedule,
            config.sample_offset,
            anchor_step=anchor[0],
            anchor_position=anchor[1],
            skips=config.skip_steps,
            exclusions=exclusions.for_source(None) if exclusions else (),
        )
    return mixture_plan_of(config, anchor, spec=spec, exclusions=exclusions)


def mixture_plan_of(
    config: DataConfig,
    anchor: tuple[int, int] = (1, 0),
    *,
    spec: MixtureSpec | None = None,
    exclusions: Exclusions | None = None,
) -> MixtureStream:
    """``plan_of`` a mixture's data config (its left-out entries already checked)."""
    if spec is None:
        spec = MixtureSpec.from_json(config.mixture)
    layout = Layout(config.batch_schedule(), anchor, config.skip_steps)
    return MixtureStream(MixturePlan(spec, config.seed, layout, exclusions))


def decide_resume(
    saved: DataState, config: DataConfig, allow_changes: Iterable[str] = ()
) -> ResumeDecision:
    """The one decision of a resume: may a job of data config ``config`` continue the
    data state ``saved``, with the fields ``allow_changes`` names opted in? The rule is
    ``order.resume.check_resume``, given what it asks of a plan (``first_correction``:
    a mixture saved under another rule). Raises ``DataStateMismatch`` naming the
    refused fields; the trainer's preflight, the loader's ``load_state_dict`` (a DCP
    load) and torchft healing all decide here."""
    return check_resume(saved, config, allow_changes, first_correction=first_correction)


def exclusions_problem(
    config: DataConfig, exclusions: Exclusions | None, what: str = "the data config"
) -> str | None:
    """None when ``exclusions`` is the left-out list ``config`` binds (field ``exclude``,
    per entry its sha256; no list for none), else what differs, in words (``what``
    names the config): the check ``plan_of`` makes, for callers that say their own fix."""
    given = exclusions.to_json() if exclusions else []
    if given == config.exclude:
        return None
    origin = exclusions.origin if exclusions else ""
    if not config.exclude:
        return f"{what} leaves no samples out, but {origin} holds {describe_saved(given)}"
    saved = describe_saved(config.exclude)
    if not exclusions:
        return f"{what} leaves samples out ({saved}) and no left-out list was given"
    return f"{what} leaves samples out ({saved}), but {origin} holds {describe_saved(given)}"


def first_correction(config: DataConfig) -> int | None:
    """The first step the current mixture rule corrects under ``config``'s weights and
    batch schedule, whatever rule ``config`` records (``MixturePlan.first_correction``);
    None if none, or for one store. What ``order.resume.check_resume`` asks of a mixture
    saved under another rule (no store opened)."""
    if config.mixture is None:
        return None
    spec = MixtureSpec.from_json({**config.mixture, "format": SPEC_FORMAT})
    return MixturePlan(spec, config.seed, config.batch_schedule()).first_correction


def weights_at(config: DataConfig, step: int) -> dict[str, str] | None:
    """A mixture's normalized weights in effect at ``step`` (exact fractions as text)."""
    if config.mixture is None:
        return None
    weights = None
    for entry in config.mixture["schedule"]:
        if int(entry["from_step"]) <= step:
            weights = dict(entry["weights"])
    return weights


def mixture_progress(state: DataState) -> dict[str, Any] | None:
    """Per source of a mixture's data state: samples drawn by the steps before
    ``next_step`` against the exact target, and the epoch the next sample is in
    (counted without left-out samples: the state binds only their sha256, and the
    counts do not depend on them). None for one store. O(1) in the step (the plan
    is not replayed)."""
    config = state.config
    if config.exclude:
        body = config.to_dict()
        del body[EXCLUDE_FIELD]
        config = DataConfig.from_dict(body)
    if config.mixture is None:
        return None
    plan, step = mixture_plan_of(config, state.position_anchor).mixture, state.next_step
    counts = plan.counts_before(step)
    targets: Sequence[Fraction] = plan.targets_before(step)
    epochs = plan.epochs(step)
    worst, who = plan.max_deviation()
    weights = weights_at(config, step) or {}
    sources = []
    for i, s in enumerate(plan.spec.sources):
        sources.append(
            {
                "name": s.name,
                "samples": int(counts[i]),
                "target": fraction_text(targets[i]),
                "deviation": float(int(counts[i]) - targets[i]),
                "epoch": int(epochs[i]),
                "num_samples": int(s.num_samples),
                "heldout_samples": int(s.heldout_samples),
                "weight": weights.get(s.name, "0/1"),
            }
        )
    return {
        "next_step": step,
        "sources": sources,
        "max_deviation": float(worst),
        "max_deviation_exact": fraction_text(worst),
        "max_deviation_source": who,
    }
