"""Validation on held-out samples, independent of the DP degree and the micro-batch size.

The last ``zephon.heldout_samples`` samples of the store are never trained on.
A validation pass reads them in order, in global batches of the run's first
global batch size ``G``; DP rank ``r`` of ``D`` takes the plan's rank slice of
each (``DataPlan.rank_positions``: the contiguous ``[r*G/D, (r+1)*G/D)``), cut
into micro-batches of ``validator.microbatch_size`` (0: training.local_batch_size);
the last micro-batch of
a slice may be smaller. With pipeline parallelism the schedule takes what training
gives it: ``training.local_batch_size`` samples a call, in micro-batches of
``parallelism.pipeline_parallel_microbatch_size`` (``G/D`` is a multiple of it), and
every stage logs the loss the last stage computed.

Samples have the training ``seq_len`` (held-out samples are windows of the same
store layout) and per-document positions as training batches have, and
``validator.steps`` caps the number of global batches per pass (-1: every full
global batch of held-out data). ``validator.freq``: every that many steps (and
at step 1), as TorchTitan's validator.

With a mixture (``zephon.mixture``) each source has its own held-out samples
(the last ``heldout_samples`` of its store; sources with none are not
validated) and the pass reads each source's in turn, as above. Besides the
overall loss (``validation_metrics/loss``: every validated token of every
source) it logs each source's as ``validation/loss/<name>``.

Invariant: every validation pass covers the same samples whatever ``D`` and the
micro-batch size, and each reported loss is the global sum of token losses over
the global token count (one all-reduce of the per-source sums at the end of the
pass), so it is the same for every layout up to floating-point summation order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.validate import BaseValidator, Validator
from torchtitan.tools import utils
from torchtitan.tools.logging import logger

from torchtitan_zephon.job.source import Source, unlabel
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.stream import DataPlan
from torchtitan_zephon.store.format import DataUnreadable, StoreError
from torchtitan_zephon.titan.components.attention import document_positions, with_document_masks
from torchtitan_zephon.titan.settings.job_view import batch_schedule
from torchtitan_zephon.titan.start.job_data import (
    ZephonJob,
    eos_id_of,
    heldout_parts,
    job_to_build,
)


def microbatch_size(per_rank: int, requested: int, *, equal: bool) -> int:
    """The validation micro-batch size for a rank slice of ``per_rank`` samples.

    ``requested`` when it fits (the last micro-batch may be smaller), ``per_rank``
    when larger; with ``equal`` (pipeline parallelism) the largest divisor of
    ``per_rank`` not above ``requested``.
    """
    if requested < 1:
        raise ValueError(f"validator.microbatch_size must be >= 1, got {requested}")
    size = min(requested, per_rank)
    if equal:
        while per_rank % size:
            size -= 1
    return size


class HeldoutLoader(BaseDataLoader):
    """One DP rank's micro-batches of a validation pass (a fresh pass per ``iter``)."""

    def __init__(
        self,
        source: Source,
        *,
        seq_len: int,
        first_sample: int,
        global_batch: int,
        num_batches: int,
        dp_rank: int,
        dp_degree: int,
        local_batch_size: int,
        equal_microbatches: bool = False,
        eos_id: int | None = None,
    ) -> None:
        # Held-out samples are read in order: the plan supplies the rank slicing
        # (positions), and position p of the pass is sample first_sample + p.
        self.plan = DataPlan(num_batches * global_batch, 0, BatchSchedule([(1, global_batch)]))
        self.source, self.seq_len, self.first_sample = source, seq_len, first_sample
        self.eos_id = eos_id  # None: batches without positions
        self.num_batches, self.dp_rank, self.dp_degree = num_batches, dp_rank, dp_degree
        _, per_rank = self.plan.rank_positions(1, dp_rank, dp_degree)
        self.local_batch_size = microbatch_size(
            per_rank, local_batch_size, equal=equal_microbatches
        )
        if self.local_batch_size != local_batch_size and dp_rank == 0:
            logger.info(
                f"Zephon validation: micro-batches of {self.local_batch_size} samples "
                f"(validator.microbatch_size={local_batch_size}; each of the {dp_degree} DP "
                f"ranks reads {per_rank} samples per global batch"
                + (", split equally for pipeline parallelism)" if equal_microbatches else ")")
            )

    def sample_ids(self) -> np.ndarray:
        """This rank's sample ids of one pass, in delivery order."""
        rows = []
        for step in range(1, self.num_batches + 1):
            first, count = self.plan.rank_positions(step, self.dp_rank, self.dp_degree)
            rows.append(np.arange(first, first + count, dtype=np.int64) + self.first_sample)
        return np.concatenate(rows) if rows else np.empty(0, dtype=np.int64)

    def microbatch_ids(self) -> list[np.ndarray]:
        """This rank's micro-batches of one pass: each global batch's slice, cut in order."""
        out = []
        per_batch = np.split(self.sample_ids(), self.num_batches) if self.num_batches else []
        for ids in per_batch:
            out += [
                ids[k : k + self.local_batch_size]
                for k in range(0, len(ids), self.local_batch_size)
            ]
        return out

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        for ids in self.microbatch_ids():
            # The rows and the inputs that train no label (packed samples: a document's
            # last token, the padding), in one pass.
            rows, unlabelled = self.source.rows(ids, self.seq_len)
            w = torch.from_numpy(rows.astype(np.int64))
            inputs, labels = w[:, :-1], w[:, 1:]
            if unlabelled is not None:
                labels = labels.clone()
                unlabel(labels, unlabelled)
            batch = {"input": inputs}
            if self.eos_id is not None:
                batch["positions"] = document_positions(inputs, self.eos_id)
            yield batch, labels

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None


class ZephonValidator(Validator):
    """The validator on held-out samples (any model's ``validator=ZephonValidator.Config``):
    TorchTitan's validator inputs (its ``post_dataloading_process``), reading the
    held-out samples instead of a dataset, and averaging over tokens rather than over
    micro-batch rounds."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseValidator.Config):
        enable: bool = False
        """Validate every ``freq`` steps (and at step 1) on zephon.heldout_samples."""

        steps: int = -1
        """Global batches of held-out samples per pass (-1: every full one)."""

        microbatch_size: int = 0
        """Held-out micro-batch size per DP rank (0: training.local_batch_size; 0.2.2:
        validation.local_batch_size; ``local_batch_size`` is a build argument in 0.3)."""

        def __post_init__(self) -> None:
            if self.steps < 1 and self.steps != -1:
                raise ValueError(
                    f"validator.steps = {self.steps}: it must be >= 1, or -1 for every full "
                    "global batch of held-out samples. Set --validator.steps."
                )

    def __init__(
        self,
        config: Config,
        *,
        parallelism: Any,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: Any,
        parallel_dims: Any,
        loss_fn: Any,
        validation_context: Any,
        metrics_processor: Any,
        seq_len: int,
        local_batch_size: int,
        pp_schedule: Any = None,
        pp_has_first_stage: bool | None = None,
        pp_has_last_stage: bool | None = None,
        job: ZephonJob | None = None,
        **_: Any,
    ) -> None:
        """TorchTitan's build keywords, and ``job`` as ``ZephonDataLoader`` takes it."""
        # Validator.__init__ would prepare TorchTitan's dataset loader; the fields its
        # methods read besides that one are set here the same way.
        BaseValidator.__init__(self, config)
        handoff = job_to_build(job, "validator (ZephonValidator.Config)")
        self.zephon_job = handoff  # the job it validates: the preflight's opened data
        job, data = handoff.view, handoff.data
        self.parallelism, self.tokenizer = parallelism, tokenizer
        self.parallel_dims, self.loss_fn = parallel_dims, loss_fn
        self.validation_context = validation_context
        self.metrics_processor = metrics_processor
        self.dp_world_size, self.dp_rank = dp_world_size, dp_rank
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.pp_schedule = pp_schedule
        self.pp_has_first_stage, self.pp_has_last_stage = pp_has_first_stage, pp_has_last_stage

        gbs = batch_schedule(job).gbs(1)
        parts = heldout_parts(job, data)
        eos_id = eos_id_of(data)
        micro = config.microbatch_size or local_batch_size
        self.pp_microbatches = 1  # pipeline micro-batches per schedule call
        if parallel_dims.pp_enabled:  # the schedule's shape: n micro-batches of its size
            self.pp_microbatches = local_batch_size // parallelism.pipeline_parallel_microbatch_size
            if micro != local_batch_size and dp_rank == 0:
                logger.info(
                    f"Zephon validation: with pipeline parallelism held-out samples are read "
                    f"{local_batch_size} at a time (training.local_batch_size, as the pipeline "
                    f"schedule takes them: {self.pp_microbatches} pipeline micro-batches), not "
                    f"validator.microbatch_size={micro}"
                )
            micro = local_batch_size
        self.heldout_loaders: list[tuple[str | None, HeldoutLoader]] = []
        for h in parts:
            available = h.count // gbs
            loader = HeldoutLoader(
                h.source,
                seq_len=data.seq_len,
                first_sample=h.first,
                global_batch=gbs,
                num_batches=available if config.steps == -1 else min(config.steps, available),
                dp_rank=dp_rank,
                dp_degree=dp_world_size,
                local_batch_size=micro,
                equal_microbatches=bool(parallel_dims.pp_enabled),
                eos_id=eos_id,
            )
            self.heldout_loaders.append((h.name, loader))
        self.validation_dataloader = self.heldout_loaders[0][1]

    def post_dataloading_process(
        self,
        input_dict: dict[str, torch.Tensor],
        labels: torch.Tensor,
        model_parts: list[torch.nn.Module],
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """TorchTitan's, with the document mask for ``DocumentSDPA`` (as in training)."""
        with_document_masks(getattr(model_parts[0], "config", None), input_dict)
        return super().post_dataloading_process(input_dict, labels, model_parts)

    @torch.no_grad()
    def pass_totals(
        self, model_parts: list[torch.nn.Module], loader: HeldoutLoader | None = None
    ) -> torch.Tensor:
        """``[sum of token losses, number of tokens]`` (float64) of this rank's share
        of one pass over ``loader`` (default: the first source's held-out samples; 0
        losses off the last pipeline stage)."""
        device_type = utils.device_type
        loss_sum = torch.zeros((), dtype=torch.float64, device=device_type)
        tokens = torch.zeros((), dtype=torch.float64, device=device_type)
        for input_dict, labels in loader or self.validation_dataloader:
            self.metrics_processor.ntokens_since_last_log += labels.numel()
            input_dict = {k: v.to(device_type) for k, v in input_dict.items()}
            if self.parallel_dims.pp_enabled:
                loss, count = self._pipeline_loss_sum(model_parts, input_dict, labels)
            else:
                inputs, labels, extra_kwargs = self.post_dataloading_process(
                    input_dict, labels.to(device_type), model_parts
                )
                loss = self._loss_sum(model_parts, inputs, labels, extra_kwargs)
                count = (labels != IGNORE_INDEX).sum()
            loss_sum += loss
            tokens += count
        return torch.stack([loss_sum, tokens])

    @torch.no_grad()
    def validate(self, model_parts: list[torch.nn.Module], step: int) -> None:
        """One pass; logs sum(token losses) / number of tokens over all DP (and CP) ranks."""
        for model in model_parts:
            model.eval()
        pd = self.parallel_dims
        try:
            totals = [self.pass_totals(model_parts, ld) for _, ld in self.heldout_loaders]
        except StoreError as e:
            what = f"the held-out samples of the validation at step {step}"
            raise DataUnreadable(e, step, what) from e
        totals = torch.stack(totals)
        if pd.pp_enabled:  # only the last stage computes losses: every stage logs them
            losses = totals[:, 0].contiguous()
            dist.all_reduce(losses, group=pd.get_mesh("pp").get_group())
            totals[:, 0] = losses
        if pd.dp_cp_enabled:
            dist.all_reduce(totals, group=pd.get_optional_mesh("loss").get_group())
        per_source: dict[str, float] = {}
        loss = float(totals[:, 0].sum() / totals[:, 1].sum())
        for (name, _), t in zip(self.heldout_loaders, totals, strict=True):
            if name is not None:
                per_source[name] = float(t[0] / t[1])
        if per_source:
            self.metrics_processor.log_validation(
                loss=loss,
                step=step,
                extra_metrics={f"validation/loss/{k}": v for k, v in per_source.items()},
            )
            logger.info(
                "Zephon validation loss per source: "
                + ", ".join(f"{k} {v:.4f}" for k, v in per_source.items())
            )
        else:
            self.metrics_processor.log_validation(loss=loss, step=step)
        for model in model_parts:
            model.train()

    def _loss_sum(
        self,
        model_parts: list[torch.nn.Module],
        inputs: torch.Tensor,
        labels: torch.Tensor,
        extra_kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """Sum of token losses of one micro-batch on this rank (no pipeline)."""
        # Context parallelism is handled by post_dataloading_process (as in TorchTitan).
        with self.validation_context():
            total, _ = self.loss_fn(model_parts[0](inputs, **extra_kwargs), labels)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        return total.detach().to(torch.float64)

    def _pipeline_loss_sum(
        self,
        model_parts: list[torch.nn.Module],
        input_dict: dict[str, torch.Tensor],
        labels: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum of token losses (0 off the last stage) and number of labelled tokens of one
        read of ``training.local_batch_size`` samples, cut in order into the schedule's
        pipeline micro-batches (the shape training gives it)."""
        device_type = utils.device_type
        n = self.pp_microbatches
        dict_mbs = [dict(zip(input_dict, parts, strict=True))
                    for parts in zip(*(v.chunk(n) for v in input_dict.values()), strict=True)]  # fmt: skip
        arg_mbs, kwarg_mbs, target_mbs = [], [], []
        count = torch.zeros((), dtype=torch.int64, device=device_type)
        for mb, mb_labels in zip(dict_mbs, labels.to(device_type).chunk(n), strict=True):
            inputs, mb_labels, extra_kwargs = self.post_dataloading_process(
                mb, mb_labels, model_parts
            )
            arg_mbs.append((inputs,))
            kwarg_mbs.append(extra_kwargs)
            target_mbs.append(mb_labels)
            count += (mb_labels != IGNORE_INDEX).sum()
        losses: list[torch.Tensor] | None = [] if self.pp_has_last_stage else None
        with self.validation_context():
            self.pp_schedule.eval(
                arg_mbs=arg_mbs if self.pp_has_first_stage else None,
                kwarg_mbs=kwarg_mbs,
                target_mbs=target_mbs if self.pp_has_last_stage else None,
                losses=losses,
            )
        if not losses:
            return torch.zeros((), dtype=torch.float64, device=device_type), count
        total = torch.sum(torch.stack(losses)).to(device_type)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        return total.detach().to(torch.float64), count
