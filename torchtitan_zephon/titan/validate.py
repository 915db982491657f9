"""Validation on held-out samples, independent of the DP degree.

The last ``zephon.heldout_samples`` samples of the store are never trained on.
A validation pass reads them in order, in global batches of the run's first
global batch size ``G``; DP rank ``r`` of ``D`` takes the contiguous slice
``[r*G/D, (r+1)*G/D)`` of each, cut into micro-batches of
``validation.local_batch_size``.

Samples have the training ``seq_len`` (``validation.seq_len`` is not used: held-out
samples are windows of the same store layout), and ``validation.steps`` caps the
number of global batches per pass (-1: every full global batch of held-out data).

Invariant: every validation pass covers the same samples whatever ``D``, and
since every sample is a full window (no ignored labels), TorchTitan's validation
loss (per-micro-batch loss sum over the global token count, averaged over
micro-batch rounds) equals the mean token loss over those samples for every
``D``, up to floating-point summation order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.validate import Validator

from torchtitan_zephon.data.store import TokenStore
from torchtitan_zephon.titan.dataloader import batch_schedule, resolve_store


class HeldoutLoader(BaseDataLoader):
    """One DP rank's micro-batches of a validation pass (a fresh pass per ``iter``)."""

    def __init__(
        self,
        store: TokenStore,
        *,
        seq_len: int,
        first_sample: int,
        global_batch: int,
        num_batches: int,
        dp_rank: int,
        dp_degree: int,
        local_batch_size: int,
    ) -> None:
        per_rank = global_batch // dp_degree
        if global_batch % dp_degree or per_rank % local_batch_size:
            raise ValueError(
                f"validation: the global batch of {global_batch} samples does not split into "
                f"{dp_degree} DP ranks x micro-batches of validation.local_batch_size="
                f"{local_batch_size}; choose a validation.local_batch_size dividing {per_rank}"
            )
        self.store, self.seq_len = store, seq_len
        self.first_sample, self.global_batch, self.num_batches = (
            first_sample,
            global_batch,
            num_batches,
        )
        self.dp_rank, self.per_rank, self.local_batch_size = dp_rank, per_rank, local_batch_size

    def sample_ids(self) -> np.ndarray:
        """This rank's sample ids of one pass, in delivery order."""
        rows = []
        for b in range(self.num_batches):
            start = self.first_sample + b * self.global_batch + self.dp_rank * self.per_rank
            rows.append(np.arange(start, start + self.per_rank, dtype=np.int64))
        return np.concatenate(rows) if rows else np.empty(0, dtype=np.int64)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        ids = self.sample_ids()
        for i in range(0, len(ids), self.local_batch_size):
            w = torch.from_numpy(
                self.store.windows(ids[i : i + self.local_batch_size], self.seq_len).astype(
                    np.int64
                )
            )
            yield {"input": w[:, :-1]}, w[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None


class ZephonValidator(Validator):
    """TorchTitan's Validator reading the held-out samples instead of a HF dataset."""

    def __init__(
        self,
        job_config: Any,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: Any,
        parallel_dims: Any,
        loss_fn: Any,
        validation_context: Any,
        maybe_enable_amp: Any,
        metrics_processor: Any,
        pp_schedule: Any = None,
        pp_has_first_stage: bool | None = None,
        pp_has_last_stage: bool | None = None,
    ) -> None:
        zc, vc = job_config.zephon, job_config.validation
        store = resolve_store(job_config)
        seq_len = job_config.training.seq_len
        total = store.num_samples(seq_len)
        gbs = batch_schedule(job_config).gbs(1)
        held = zc.heldout_samples
        if held < gbs:
            raise ValueError(
                f"validation needs at least one global batch ({gbs} samples) of held-out data; "
                f"zephon.heldout_samples is {held}. Set --zephon.heldout_samples to a multiple of {gbs}."
            )
        available = held // gbs
        num_batches = available if vc.steps == -1 else min(vc.steps, available)
        self.job_config = job_config
        self.tokenizer = tokenizer
        self.parallel_dims = parallel_dims
        self.loss_fn = loss_fn
        self.validation_dataloader = HeldoutLoader(
            store,
            seq_len=seq_len,
            first_sample=total - held,
            global_batch=gbs,
            num_batches=num_batches,
            dp_rank=dp_rank,
            dp_degree=dp_world_size,
            local_batch_size=vc.local_batch_size,
        )
        self.validation_context = validation_context
        self.maybe_enable_amp = maybe_enable_amp
        self.metrics_processor = metrics_processor
        self.pp_schedule = pp_schedule
        self.pp_has_first_stage = pp_has_first_stage
        self.pp_has_last_stage = pp_has_last_stage

    def validate(self, model_parts: list[torch.nn.Module], step: int) -> None:
        # TorchTitan stops after validation.steps *micro-batch rounds*; our pass length
        # is already fixed in global batches, so let it read the whole pass.
        steps, self.job_config.validation.steps = self.job_config.validation.steps, -1
        try:
            super().validate(model_parts, step)
        finally:
            self.job_config.validation.steps = steps


def build_zephon_validator(**kwargs: Any) -> ZephonValidator:
    return ZephonValidator(**kwargs)
