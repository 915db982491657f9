"""What Zephon reads of a TorchTitan job, in one frozen record.

Role: the preflight, the setting checks, the dataloader and the validator read a
``JobView`` instead of TorchTitan's config tree, whose layout changes between
releases (0.2.2 ``job.dump_folder`` is 0.3 ``dump_folder``, ``validation`` is
``validator``, ``model.name`` / ``model.flavor`` are the registry's
``model_spec``). ``job_view`` is the one place that knows TorchTitan 0.3's paths.

Invariant: a view holds exactly the fields Zephon reads and is never written
back; whatever Zephon decides that TorchTitan must follow (the checkpoint step
the preflight checked) the trainer sets on TorchTitan's config itself.
Messages keep naming options as the user spells them on the command line
(``--training.*``, ``--checkpoint.*``, ``--zephon.*``; 0.3 spellings where 0.2.2's
no longer exist: ``--dump_folder``, ``--hf_assets_path``, ``--validator.*``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.titan.settings.zephon_section import Zephon


@dataclass(frozen=True)
class CheckpointView:
    enable: bool
    folder: str
    interval: int
    load_step: int
    initial_load_path: str | None
    initial_load_model_only: bool
    initial_load_in_hf: bool
    exclude_from_loading: tuple[str, ...]


@dataclass(frozen=True)
class ValidationView:
    enable: bool
    freq: int
    steps: int
    local_batch_size: int
    """Held-out micro-batch size (0 in the config: training.local_batch_size)."""


@dataclass(frozen=True)
class FaultToleranceView:
    """TorchTitan's ``fault_tolerance`` section (torchft replica groups), as Zephon reads it."""

    enable: bool = False
    replica_id: int = 0
    group_size: int = 0
    min_replica_size: int = 1
    semi_sync_method: str | None = None
    process_group: str = "gloo"


@dataclass(frozen=True)
class JobView:
    dump_folder: str
    hf_assets_path: str
    model_name: str
    model_flavor: str
    vocab_size: int | None
    """The model's embedding size (None: the model config has none)."""
    n_heads: int | None
    n_kv_heads: int | None
    seq_len: int
    local_batch_size: int
    global_batch_size: int
    steps: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    checkpoint: CheckpointView
    validation: ValidationView
    log_freq: int
    seed: int | None
    num_workers: int
    pin_memory: bool
    zephon: Zephon = field(default_factory=Zephon)
    num_experts: int | None = None
    """Routed experts per MoE layer (None: the model has no MoE layer)."""
    fault_tolerance: FaultToleranceView = field(default_factory=FaultToleranceView)
    mixed_precision_param: str = "float32"
    """``training.mixed_precision_param``: the dtype FSDP computes in (on 1 rank
    TorchTitan computes in the parameters' own dtype)."""
    deterministic: bool = False
    """``debug.deterministic``: TorchTitan's deterministic kernels (and algorithms)."""
    optimizers: tuple[str, ...] = ("AdamW",)
    """The optimizer of each of ``optimizer.param_groups`` (TorchTitan's names)."""
    optimizer_flags: frozenset[str] = frozenset()
    """The boolean optimizer options some parameter group turns on (``amsgrad``, ...)."""

    @property
    def model(self) -> str:
        """``llama3 flavor debugmodel``: how messages name the model."""
        return f"{self.model_name} flavor {self.model_flavor}"

    def dp_shard_degree(self, world_size: int) -> int | None:
        """``data_parallel_shard_degree`` as TorchTitan resolves it on ``world_size`` ranks
        (-1: the ranks the other degrees leave); None when the degrees do not multiply out
        to ``world_size`` (``start.checks`` says why). The one place Zephon derives it."""
        fixed = self.dp_replicate * self.cp * self.tp * self.pp
        if fixed < 1 or (self.dp_shard != -1 and self.dp_shard < 1):
            return None
        shard = world_size // fixed if self.dp_shard == -1 else self.dp_shard
        return shard if shard >= 1 and fixed * shard == world_size else None

    def dp_degree(self, world_size: int) -> int | None:
        """The data-parallel degree on ``world_size`` ranks (replicate x shard), which
        splits each step's global batch; None as for ``dp_shard_degree``."""
        shard = self.dp_shard_degree(world_size)
        return None if shard is None else self.dp_replicate * shard


def job_view(config: Any) -> JobView:
    """The view of a TorchTitan 0.3 ``Trainer.Config`` (Zephon's trainer config, or a
    stock one: ``zephon`` then has its defaults)."""
    spec = config.model_spec
    model = spec.model if spec is not None else None
    attention = getattr(model, "first_attention", None) if model is not None else None
    n_heads = getattr(attention, "n_heads", None)
    n_kv_heads = getattr(attention, "n_kv_heads", None) or n_heads
    ck, p, v, dl = config.checkpoint, config.parallelism, config.validator, config.dataloader
    lbs = config.training.local_batch_size
    return JobView(
        dump_folder=config.dump_folder,
        hf_assets_path=config.hf_assets_path,
        model_name=spec.name if spec is not None else "",
        model_flavor=spec.flavor if spec is not None else "",
        vocab_size=getattr(model, "vocab_size", None),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        seq_len=config.training.seq_len,
        local_batch_size=lbs,
        global_batch_size=config.training.global_batch_size,
        steps=config.training.steps,
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        ep=p.expert_parallel_degree,
        checkpoint=CheckpointView(
            enable=ck.enable,
            folder=ck.folder,
            interval=ck.interval,
            load_step=ck.load_step,
            initial_load_path=ck.initial_load_path,
            initial_load_model_only=ck.initial_load_model_only,
            initial_load_in_hf=ck.initial_load_in_hf,
            exclude_from_loading=tuple(ck.exclude_from_loading),
        ),
        validation=ValidationView(
            enable=bool(getattr(v, "enable", False)),
            freq=v.freq,
            steps=getattr(v, "steps", -1),
            local_batch_size=getattr(v, "microbatch_size", 0) or lbs,
        ),
        log_freq=config.metrics.log_freq,
        seed=config.debug.seed,
        num_workers=getattr(dl, "num_workers", 0),
        pin_memory=getattr(dl, "pin_memory", False),
        zephon=getattr(config, "zephon", None) or Zephon(),
        num_experts=_num_experts(model),
        fault_tolerance=_fault_tolerance(getattr(config, "fault_tolerance", None)),
        mixed_precision_param=config.training.mixed_precision_param,
        deterministic=bool(config.debug.deterministic),
        optimizers=tuple(g.optimizer_name for g in config.optimizer.param_groups),
        optimizer_flags=frozenset(
            k
            for g in config.optimizer.param_groups
            for k, v in g.optimizer_kwargs.items()
            if v is True
        ),
    )


def _fault_tolerance(ft: Any) -> FaultToleranceView:
    """The view of a ``fault_tolerance`` section (None, a stock config without one: off)."""
    if ft is None:
        return FaultToleranceView()
    return FaultToleranceView(
        enable=bool(ft.enable),
        replica_id=int(ft.replica_id),
        group_size=int(ft.group_size),
        min_replica_size=int(ft.min_replica_size),
        semi_sync_method=ft.semi_sync_method or None,
        process_group=str(ft.process_group),
    )


def _num_experts(model: Any) -> int | None:
    """The fewest routed experts of the model's MoE layers (None: no MoE layer)."""
    if model is None or not hasattr(model, "traverse"):
        return None
    from torchtitan.models.common.moe import MoE

    counts = [moe.num_experts for _, moe, _, _ in model.traverse(MoE.Config)]
    return min(counts) if counts else None


def batch_schedule(job: JobView) -> BatchSchedule:
    """The global batch size schedule: ``zephon.batch_schedule`` or the fixed GBS.

    Elastic determinism needs the global batch size to be a property of the run,
    not of the topology, so it must be given explicitly.
    """
    if job.zephon.batch_schedule:
        return BatchSchedule.parse(job.zephon.batch_schedule)
    gbs = job.global_batch_size
    if gbs is None or gbs <= 0:
        raise ValueError(
            "training.global_batch_size is not set. Zephon needs the global batch size to be "
            "fixed for the run (it defines which samples each step sees, whatever the number "
            "of ranks). Set --training.global_batch_size (e.g. local_batch_size x DP degree x "
            "gradient accumulation steps) or --zephon.batch_schedule."
        )
    return BatchSchedule([(1, gbs)])
