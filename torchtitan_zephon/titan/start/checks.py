"""Job checks that run before TorchTitan builds anything.

Role: refuse settings that TorchTitan would otherwise reject later with a bare
or misleading ``AssertionError`` (stripped entirely under ``python -O``), a
``ZeroDivisionError`` at the first checkpoint, or a tensor shape error deep in
the model: the parallelism degrees against the world size, ``training.seq_len``
against TP and CP, the TP degree against the model's attention heads, the EP
degree against the model's routed experts and the ranks it borrows, and the step
frequencies; the ``--fault_tolerance.*`` settings (``ft.settings``); and the settings of remote stores (``zephon.read_ahead_steps``,
``read_ahead_bytes``, ``request_timeout_s``, ``cache_bytes``), for every job, local store
or not, by asking ``job.settings.remote_options`` (their owner) rather than at the
first remote open.

Invariant: ``check_job_config`` reads only the job's view (``titan.settings.job_view``)
and the world size; it changes nothing. A job it accepts passes these
TorchTitan asserts; one it refuses raises ``ValueError`` naming the setting,
the value found, what would work and the flag to change.
"""

from __future__ import annotations

import math
import os

from torchtitan_zephon.job.settings import remote_options
from torchtitan_zephon.order.layout import divisors
from torchtitan_zephon.titan.ft.settings import check_fault_tolerance
from torchtitan_zephon.titan.reproducible.coverage import check_reproducible
from torchtitan_zephon.titan.settings.job_view import JobView


def check_job_config(job: JobView, world_size: int | None = None) -> None:
    """Raise ValueError for a job TorchTitan would assert on; ``world_size``
    defaults to ``$WORLD_SIZE`` (torchrun sets it; 1 without torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    tp, cp = _check_parallelism(job, world)
    _check_sequence(job, tp, cp)
    _check_heads(job, tp)
    _check_experts(job, world, tp, cp)
    _check_frequencies(job)
    remote_options(job)  # raises ValueError for a remote setting out of range
    check_fault_tolerance(job, world)
    check_reproducible(job, world)


def _check_parallelism(job: JobView, world: int) -> tuple[int, int]:
    """The degrees multiply out to the world size (dp_shard -1: whatever is left)."""
    degrees = {
        "data_parallel_replicate_degree": job.dp_replicate,
        "context_parallel_degree": job.cp,
        "tensor_parallel_degree": job.tp,
        "pipeline_parallel_degree": job.pp,
    }
    for name, value in degrees.items():
        if value < 1:
            raise ValueError(
                f"parallelism.{name} = {value}: a parallelism degree must be >= 1 (1 disables "
                f"it). Set --parallelism.{name} 1 or more."
            )
    shard = job.dp_shard
    if shard != -1 and shard < 1:
        raise ValueError(
            f"parallelism.data_parallel_shard_degree = {shard}: it must be -1 (all ranks the "
            "other degrees leave) or >= 1. Set --parallelism.data_parallel_shard_degree -1."
        )
    fixed = math.prod(degrees.values())
    named = " x ".join(f"{k.removesuffix('_degree')} {v}" for k, v in degrees.items())
    if shard == -1 and world % fixed:
        raise ValueError(
            f"the job has {world} ranks, which is not a multiple of {named} = {fixed}, so "
            "data_parallel_shard_degree -1 cannot take the rest. Launch a multiple of "
            f"{fixed} ranks, or choose degrees whose product divides {world} "
            f"({divisors(world)})."
        )
    if shard != -1 and fixed * shard != world:
        raise ValueError(
            f"{named} x data_parallel_shard {shard} = {fixed * shard}, but the job has {world} "
            "ranks: the degrees must multiply to the number of ranks. Set "
            "--parallelism.data_parallel_shard_degree -1 to use every rank the others leave."
        )
    return degrees["tensor_parallel_degree"], degrees["context_parallel_degree"]


def _check_sequence(job: JobView, tp: int, cp: int) -> None:
    """TorchTitan's trainer asserts seq_len % (TP x (2 x CP when CP > 1)) == 0."""
    seq_len = job.seq_len
    if seq_len < 1:
        raise ValueError(f"training.seq_len = {seq_len}: it must be >= 1. Set --training.seq_len.")
    if job.local_batch_size < 1:
        raise ValueError(
            f"training.local_batch_size = {job.local_batch_size}: it must be >= 1. "
            "Set --training.local_batch_size."
        )
    divisor = tp * (2 * cp if cp > 1 else 1)
    if seq_len % divisor:
        lower, upper = seq_len - seq_len % divisor, seq_len - seq_len % divisor + divisor
        near = f"{lower} or {upper}" if lower else str(upper)
        raise ValueError(
            f"training.seq_len = {seq_len} must be a multiple of TP degree {tp}"
            + (f" x 2 x CP degree {cp}" if cp > 1 else "")
            + f" = {divisor}: sequence parallelism splits each sequence over the TP ranks"
            + (" and context parallelism into 2 x CP chunks" if cp > 1 else "")
            + f". Use --training.seq_len {near}."
        )


def _check_heads(job: JobView, tp: int) -> None:
    """Tensor parallelism gives every TP rank a whole number of query and key/value heads."""
    if job.n_heads is None or tp == 1:
        return
    heads = job.n_heads
    kv_heads = job.n_kv_heads or heads
    if heads % tp or kv_heads % tp:
        good = divisors(math.gcd(heads, kv_heads))
        raise ValueError(
            f"parallelism.tensor_parallel_degree = {tp} does not divide the {heads} attention "
            f"heads ({kv_heads} key/value heads) of {job.model}: each TP "
            f"rank must hold whole heads. TP degrees that work: {good}."
        )


def _check_experts(job: JobView, world: int, tp: int, cp: int) -> None:
    """Expert parallelism gives every EP rank a whole number of routed experts, and its
    ranks come from data_parallel_shard x context_parallel x tensor_parallel (TorchTitan
    0.3's sparse mesh: efsdp = dp_shard x cp x tp / ep)."""
    ep = job.ep
    if ep < 1:
        raise ValueError(
            f"parallelism.expert_parallel_degree = {ep}: a parallelism degree must be >= 1 "
            "(1 disables it). Set --parallelism.expert_parallel_degree 1 or more."
        )
    if ep == 1:
        return
    experts = job.num_experts
    if experts is None:
        raise ValueError(
            f"parallelism.expert_parallel_degree = {ep}, but {job.model} has no MoE layer "
            "(no experts to spread). Set --parallelism.expert_parallel_degree 1."
        )
    shard = job.dp_shard_degree(world) or 1  # the degrees were checked above
    borrowed = shard * cp * tp
    good = divisors(math.gcd(experts, borrowed))
    if experts % ep:
        raise ValueError(
            f"parallelism.expert_parallel_degree = {ep} does not divide the {experts} routed "
            f"experts of {job.model}: each EP rank must hold whole experts. EP degrees that "
            f"work here: {good}."
        )
    if borrowed % ep:
        raise ValueError(
            f"parallelism.expert_parallel_degree = {ep} does not divide data_parallel_shard "
            f"{shard} x context_parallel {cp} x tensor_parallel {tp} = {borrowed} ranks, which "
            f"expert parallelism takes its ranks from. EP degrees that work here: {good}."
        )


def _check_frequencies(job: JobView) -> None:
    """``step % freq`` in TorchTitan: a zero frequency is a ZeroDivisionError mid-run."""
    # (checkpoint.interval: TorchTitan 0.3's checkpoint config refuses 0 itself, clearly.)
    freqs = [("metrics.log_freq", job.log_freq, True)]
    freqs.append(("validator.freq", job.validation.freq, job.validation.enable))
    for name, value, used in freqs:
        if used and value < 1:
            raise ValueError(
                f"{name} = {value}: it is a number of steps and must be >= 1. Set --{name}."
            )
