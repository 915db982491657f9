"""The chunk count of TorchTitan 0.3's chunked loss, fitted to the job's sequence length.

TorchTitan 0.3's ``ChunkedLossWrapper`` splits each rank's local sequence
(``training.seq_len`` / context-parallel degree) into ``loss.num_chunks`` equal
chunks (8 by default) and fails at the first step when the count does not divide
it; 0.2.2 computed the loss in one piece, so any ``seq_len`` trained. A config
function's count is chosen before ``--training.seq_len`` is applied, so the count
is fitted here, once the command line is parsed and before TorchTitan builds the
loss.

Invariant: a job whose chunk count was set explicitly (``--loss.num_chunks`` on the
command line) trains with that count or is refused, naming the counts and sequence
lengths that work; otherwise the count used is the largest divisor of the local
sequence length not above the configured count, so every ``seq_len`` trains (with
fewer, longer chunks where it must), and the change is said in one line. A job
whose loss is not chunked is left as it is.
"""

from __future__ import annotations

from typing import Any

from torchtitan.components.loss import ChunkedLossWrapper

from torchtitan_zephon.order.layout import divisors


def largest_divisor_up_to(n: int, limit: int) -> int:
    """The largest divisor of ``n`` (>= 1) that is not above ``limit`` (>= 1)."""
    return max(d for d in divisors(n) if d <= limit)


def fit_loss_chunks(config: Any, *, explicit: bool) -> str | None:
    """Fit ``config.loss.num_chunks`` (a ``ChunkedLossWrapper.Config``) to the local
    sequence length; returns the one-line note of a change (None when nothing
    changed). Raises ``ValueError`` for an explicit count that does not divide it, or
    a count below 1. Sequence lengths or CP degrees that ``checks.check_job_config``
    refuses are left to it."""
    loss = getattr(config, "loss", None)
    if not isinstance(loss, ChunkedLossWrapper.Config):
        return None
    chunks = loss.num_chunks
    if chunks < 1:
        raise ValueError(
            f"loss.num_chunks = {chunks}: the chunked loss needs at least 1 chunk. Set "
            "--loss.num_chunks 1 or more (1: the loss in one piece)."
        )
    seq_len = config.training.seq_len
    cp = config.parallelism.context_parallel_degree
    if seq_len < 1 or cp < 1 or seq_len % cp:
        return None  # check_job_config refuses these with their own message
    local = seq_len // cp
    if local % chunks == 0:
        return None
    per_rank = f" / context-parallel degree {cp} = {local} tokens per rank" if cp > 1 else ""
    if explicit:
        step = chunks * cp
        lower, upper = seq_len - seq_len % step, seq_len - seq_len % step + step
        near = f"{lower} or {upper}" if lower else str(upper)
        working = [d for d in divisors(local) if d <= max(chunks, 1)]
        raise ValueError(
            f"loss.num_chunks = {chunks} does not divide training.seq_len {seq_len}{per_rank}: "
            "the chunked loss splits each sequence into equal chunks. Chunk counts that work "
            f"up to {chunks}: {working}; sequence lengths that work with {chunks} chunks: "
            f"multiples of {step} ({near}). Set --loss.num_chunks or --training.seq_len, or "
            "drop --loss.num_chunks to let Zephon choose."
        )
    fitted = largest_divisor_up_to(local, chunks)
    loss.num_chunks = fitted
    return (
        f"the chunked loss splits training.seq_len {seq_len}{per_rank} into {fitted} chunk(s) "
        f"of {local // fitted} tokens, not {chunks} (the largest divisor not above {chunks}); "
        "--loss.num_chunks N sets the count."
    )
