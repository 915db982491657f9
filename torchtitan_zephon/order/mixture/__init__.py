"""Mixtures: several token stores drawn in exact proportions that follow a weight schedule.

Role: the pure index math of a data mixture. A mixture file names the sources
(stores) and a weight schedule; ``MixturePlan`` turns it, with a seed and the
global batch schedule, into the ordered (source, sample id) pairs of every
global step, DP-rank slice and micro-batch, like ``DataPlan`` does for one store. The modules: ``config`` (the
mixture file), ``spec`` (the resolved sources and what changed between two
specs), ``rule`` (the position assignment), ``build`` (the walk that builds a plan's
tables), ``plan`` (``MixturePlan``) and ``stream`` (``MixtureStream``).

The global stream is the positions 0, 1, 2, ...; step ``t`` covers the positions
``[BatchSchedule.first_position(t), + gbs(t))`` and position ``s`` carries the
weights of its step. Each position goes to one source; the k-th position a source gets
is its stream position k, drawn like a single-store plan:
``Permutation(n_source, source_seed(seed, name), k // n_source)[k % n_source]``.

Invariants:
- Pure: the position -> source assignment of steps 1..k depends only on the
  weights in effect at steps 1..k, the batch sizes of steps 1..k and the source
  names. Entries appended after k, sources added with weight 0 up to k and the
  order of the ``[[source]]`` blocks (it only numbers the sources) change
  nothing up to k; ``past_changes`` says whether two specs agree up to a step
  (and names every difference).
- Weight 0 means none: a source never gets a position of a step where its weight
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
  (``rule.least_worst_counts``; at most
  ``build._MAX_CORRECTIONS`` = 4,096 such steps per weight entry before their
  residuals recur; a schedule that needs more, e.g. a weight of 1e-6 at batch
  size 1, follows the pattern alone after them).
  ``MixturePlan.max_deviation`` is the exact worst over every step end. No pure
  plan that keeps "weight 0 means none" can stay within 1 for every schedule
  once weights change: see ``test_weight_changes_can_force_more_than_one_sample``
  (7/6 is forced).
- Each source's ids within one of its epochs are a permutation of its training
  samples ``[0, n_source)``; a source that runs out starts its next epoch
  reshuffled; an optional ``max_epochs`` makes running past it an error.
- Elastic: DP rank r of D gets the contiguous positions ``[r*G/D, (r+1)*G/D)`` of
  the step; the rank slices concatenate to the global batch for every D
  dividing G.
- O(1) in the step: a step's ids cost O(GBS + sources + 512) whatever the
  step number and world size; nothing is replayed from step 1. The plan walks
  the weight segments once when built; within a segment the assignment is
  periodic (period: a multiple of the entry's common denominator, found by
  comparing states) after a prefix, kept as one table per segment with
  per-source counts every 512 positions. A corrected step is its own one-step
  segment; when the residuals after a corrected step recur under the same
  batch size, the steps between repeat as a block (``rule.Repeat``) until the batch
  size or the weights change. The tables depend only on the spec and the batch
  schedule, so every rank builds the same ones.

Warnings (a source smaller than its share of one global batch) are returned as
strings in ``MixturePlan.warnings`` for the caller to log; errors raise
``MixtureError``.
"""
