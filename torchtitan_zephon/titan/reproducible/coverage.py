"""What ``zephon.reproducible`` covers, checked at start: a job it cannot make exact
is refused in one line, before anything is built, never trained inexactly.

Invariant: ``check_reproducible`` accepts a job only where every sum that feeds the
update or the log goes through ``gradients`` (1 rank, or FSDP / HSDP over the ranks,
or torchft replica groups of one rank; float32 compute, MoE at EP 1, Adam or AdamW:
``optimizer``; TorchTitan's deterministic kernels); everything else it refuses, naming the
setting and what to set instead.
"""

from __future__ import annotations

from torchtitan_zephon.titan.reproducible.optimizer import SUPPORTED, UNSUPPORTED_FLAGS
from torchtitan_zephon.titan.settings.job_view import JobView

WHAT = "zephon.reproducible"


def check_reproducible(job: JobView, world: int) -> None:
    """Raise ``ValueError`` for a job of ``world`` ranks (a torchft group's own) the
    setting does not cover (nothing when it is off)."""
    if not job.zephon.reproducible:
        return
    if job.dp_replicate > 1 and job.dp_shard_degree(world) == 1:
        raise ValueError(
            f"{WHAT} covers HSDP with a shard group of 2 ranks or more, not "
            f"parallelism.data_parallel_replicate_degree = {job.dp_replicate} over shards of "
            f"one rank: set --parallelism.data_parallel_shard_degree -1 (FSDP over every "
            f"rank), or turn {WHAT} off"
        )
    for name, degree in (
        ("tensor_parallel_degree", job.tp),
        ("context_parallel_degree", job.cp),
        ("pipeline_parallel_degree", job.pp),
    ):
        if degree != 1:
            raise ValueError(
                f"{WHAT} covers data parallelism (FSDP, HSDP) only, not parallelism."
                f"{name} = {degree}: set --parallelism.{name} 1, or turn {WHAT} off"
            )
    if job.ep != 1:
        raise ValueError(
            f"{WHAT} covers MoE models at expert_parallel_degree 1 only, not "
            f"parallelism.expert_parallel_degree = {job.ep}: set "
            f"--parallelism.expert_parallel_degree 1, or turn {WHAT} off"
        )
    if job.fault_tolerance.enable and world > 1:
        raise ValueError(
            f"{WHAT} covers torchft replica groups of one rank each, not groups of {world} "
            f"ranks (FSDP inside a group) yet: launch each group on one rank, or turn "
            f"{WHAT} off"
        )
    if not job.deterministic:
        raise ValueError(
            f"{WHAT} needs debug.deterministic = true: a kernel that adds in whatever order "
            "its threads finish (a GPU's atomics) computes another gradient on every run. "
            "Set --debug.deterministic"
        )
    if job.mixed_precision_param != "float32":
        raise ValueError(
            f"{WHAT} is built and tested for float32 compute, not "
            f"training.mixed_precision_param = {job.mixed_precision_param} yet. Set "
            "--training.mixed_precision_param float32, or turn it off"
        )
    for name in job.optimizers:
        if name not in SUPPORTED:
            raise ValueError(
                f"{WHAT} computes {' and '.join(SUPPORTED)} updates exactly, not {name}: use "
                f"AdamW (optimizer.name), or turn {WHAT} off"
            )
    for flag in sorted(job.optimizer_flags & UNSUPPORTED_FLAGS):
        raise ValueError(
            f"{WHAT} computes Adam and AdamW without {flag}: turn {flag} off, or turn {WHAT} off"
        )
