"""What a store must hold for a job: the store-size checks and their messages, in one place.

Role: ``check_store_size`` refuses a single store with fewer than ``MIN_STORE_SAMPLES``
training samples and warns when it holds fewer than a global batch of the schedule;
``no_sample_text`` says why a store holds no sample of a seq_len, and ``store_fix``
what to change (the held-out setting, a shorter seq_len, a larger store). The job's
data (``job.settings``, ``job.data``), a mixture's sources (``order.mixture.spec``)
and ``zephon plan`` ask here; ``order.layout`` exports them too.

Invariant: what a single store must hold is a function of its training samples and
the batch schedule only: the same verdict under every DP degree and local batch size,
so a resume at another topology decides alike.
"""

from __future__ import annotations

from typing import Protocol


class Schedule(Protocol):
    """What the check reads of a batch schedule (``layout.BatchSchedule``)."""

    entries: list[tuple[int, int]]

    def gbs(self, step: int) -> int: ...


MIN_STORE_SAMPLES = 2
"""Training samples a single store needs. With one, every step trains on that one
sample, repeated to fill the global batch, whatever the seed, the batch schedule or
the topology: the order has nothing left to decide. Fewer samples than a global batch
(but at least two) is a warning: the steps still differ, their samples repeat."""


def no_sample_text(what: str, num_tokens: int, seq_len: int) -> str:
    """Why a store of ``num_tokens`` tokens holds no sample of ``seq_len``."""
    return (
        f"{what} has {num_tokens} tokens, but a sample of seq_len {seq_len} needs seq_len + 1 "
        f"= {seq_len + 1} tokens (its inputs and the label of the last one), so it holds no "
        "sample"
    )


def store_fix(num_tokens: int, samples: int, seq_len_flag: str, *, first: str = "") -> str:
    """What to change so that a store of ``num_tokens`` tokens holds ``samples`` samples:
    ``first`` (e.g. the held-out setting, as the user writes it), a shorter seq_len, a
    larger store."""
    options = [first] if first else []
    longest = (num_tokens - 1) // samples if samples > 0 else 0
    if longest >= 1:
        options.append(
            f"use {seq_len_flag} {longest} or less (the longest that gives {samples} samples)"
        )
    options.append("use a larger store")
    return "To change it: " + ", or ".join(options) + "."


def check_store_size(what: str, num_samples: int, schedule: Schedule, fix: str) -> str | None:
    """Refuse a single store with fewer than ``MIN_STORE_SAMPLES`` training samples
    (ValueError naming ``what``, the count and the batch, then ``fix``); return the
    warning for one smaller than a global batch of ``schedule`` (None: no step repeats
    a sample)."""
    largest = max(g for _, g in schedule.entries)
    if num_samples < 1:
        raise ValueError(f"{what} has no training sample. {fix}")
    if num_samples < MIN_STORE_SAMPLES:
        raise ValueError(
            f"{what} has {num_samples} training sample: every step would train on that "
            f"one sample alone, repeated to fill the global batch ({schedule.gbs(1)} at step "
            "1), whatever the seed or the number of ranks. A single store needs at least "
            f"{MIN_STORE_SAMPLES}. {fix}"
        )
    first = next(((s, g) for s, g in schedule.entries if g > num_samples), None)
    if first is None:
        return None
    step, gbs = first
    larger = f", and up to {largest} later" if largest > gbs else ""
    return (
        f"{what} has {num_samples} training samples, fewer than the global batch of {gbs} "
        f"from step {step} on (batch schedule entry {step}:{gbs}{larger}): every such step "
        "repeats samples within itself. Use a larger store or a smaller global batch."
    )
