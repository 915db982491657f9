"""Per-source accounting: what each trained step drew from each source.

Role: ``step_account(plan, step, seq_len)`` gives, for one trained step, per source
(a mixture's sources in name order; one store is one source, named ``store``): the
samples and tokens the step trains, the cumulative samples trained by steps 1..step
beside the exact target, the deviation and the epoch. It asks the plan's O(sources)
counts (``MixturePlan.step_counts`` / ``counts_before`` / ``targets_before``, and
for one store the layout's positions), never the step's sample ids, so it costs the
same at any global batch size and any step. ``documents_started`` counts the
documents that start inside the step's samples: that needs the step's ids (O(global
batch): the plan's global ids, then one ``searchsorted`` over each source's document
offsets on the sorted sample starts), so the trainer computes it off its thread.

Invariants (for every step s the plan trains):
- ``samples[i]`` is the number of positions of step s whose sample comes from source i:
  the count of i among the sources of ``plan.global_ids(s)``; they sum to GBS(s).
  ``tokens[i] = samples[i] x seq_len`` (the input tokens; each label is the next one).
- ``cumulative[i]`` = sum of ``samples[i]`` over steps 1..s: the *trained* count, so
  a skip range (``order.skips``) leaves it unchanged, as it leaves the position
  assignment. ``targets[i]`` = sum over t <= s of w_i(t) x GBS(t), exact (one store:
  the cumulative count itself); ``deviation = cumulative - target``.
- ``epochs[i]`` is the epoch of source i's last trained sample (its stream position
  // its training samples, the plan's ``stream_positions``: skipped and left-out
  samples count, as the stream reads past them; 0 before its first draw). ``wraps`` lists the sources whose epoch grew at step s.
- ``documents_started`` counts, per source and with multiplicity over the step's
  samples, the document offsets d with ``id x seq_len <= d < (id + 1) x seq_len``
  (a document starts at one of the sample's seq_len input tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from torchtitan_zephon.job.source import OFFSETS_FETCH_LIMIT, starts_in_windows
from torchtitan_zephon.order.stream import StreamPlan, split_keys


@dataclass(frozen=True)
class StepAccount:
    """One trained step, per source (``names`` order)."""

    step: int
    names: list[str]
    samples: np.ndarray
    tokens: np.ndarray
    cumulative: np.ndarray
    targets: list[Fraction]
    epochs: np.ndarray
    previous_epochs: np.ndarray
    """Each source's epoch after step - 1."""
    deviations: list[float]
    """Per source: cumulative trained samples minus the exact target."""

    @property
    def wraps(self) -> list[tuple[str, int]]:
        """(source, new epoch) of the sources that entered a new epoch at this step."""
        grew = np.flatnonzero(self.epochs > self.previous_epochs).tolist()
        return [(self.names[i], int(self.epochs[i])) for i in grew]


def source_names(plan: StreamPlan) -> list[str]:
    """The sources a plan draws from, in source-index order."""
    return list(plan.names)


def step_account(plan: StreamPlan, step: int, seq_len: int) -> StepAccount:
    """The accounting of trained step ``step`` (see the module docstring); O(sources)."""
    if not isinstance(plan, StreamPlan):
        raise TypeError(f"no accounting for a {type(plan).__qualname__}")
    draws = plan.step_draws(step)
    samples, cumulative, targets = draws.samples, draws.cumulative, draws.targets
    deviations = [float(c - t) for c, t in zip(cumulative.tolist(), targets, strict=True)]
    return StepAccount(
        step=step,
        names=source_names(plan),
        samples=samples,
        tokens=samples * int(seq_len),
        cumulative=cumulative,
        targets=list(targets),
        epochs=plan.epochs_of_draws(cumulative),
        previous_epochs=plan.epochs_of_draws(cumulative - samples),
        deviations=deviations,
    )


def document_offsets(data: Any, fetch_limit: int = OFFSETS_FETCH_LIMIT) -> list[np.ndarray | None]:
    """Each source's document offsets (token index of every document's first token),
    from the job's data (``job.data.JobData``), in source order
    (``Source.document_offsets``: None for a store in object storage with more than
    ``fetch_limit`` bytes of them, and for packed samples, which are not windows of the
    offsets)."""
    return [source.document_offsets(fetch_limit) for source in data.sources]


def documents_started(
    plan: StreamPlan, step: int, offsets: Sequence[np.ndarray | None], seq_len: int
) -> np.ndarray:
    """Per source, the documents that start inside step ``step``'s samples (module
    docstring); -1 for a source whose offsets are None (not counted). O(global batch):
    the step's ids, sorted per source, then two ``searchsorted`` over the source's
    offsets."""
    keys = np.asarray(plan.global_ids(step), dtype=np.int64)
    if len(offsets) == 1:  # one source: the keys are its sample ids
        sources, ids = np.zeros(keys.size, dtype=np.int64), keys
    else:
        sources, ids = split_keys(keys)
    out = np.zeros(len(offsets), dtype=np.int64)
    for i, off in enumerate(offsets):
        out[i] = -1 if off is None else starts_in_windows(off, ids[sources == i], seq_len)
    return out
