"""The training step of ``zephon.reproducible``: TorchTitan 0.3's ``train_step``
(``Trainer.train_step``) with every sum that feeds the update or the log made exact
(``gradients``).

Invariant: given the same parameters, optimizer state and global batch, a step
leaves the same parameters and optimizer state and logs the same loss and gradient
norm at any DP degree: each micro-batch's forward and backward is computed alone;
the gradients, their norm and the loss are exact sums (``gradients``); the token
count that normalises the loss is an integer sum; clipping and the optimizer act
element by element on tensors that are the same bits everywhere.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import utils as dist_utils

from torchtitan_zephon.titan.reproducible.gradients import ExactGradients, StepLoss, clip_exact


def train_step_reproducible(trainer: Any, exact: ExactGradients, data_iterator: Any) -> None:
    """One step of ``trainer`` (a ``ZephonTrainer``, no pipeline parallelism: refused at
    start) with exact sums."""
    trainer.optimizers.zero_grad()
    lr_metrics = trainer.lr_schedulers.get_metrics()
    should_log = trainer.metrics_processor.should_log(trainer.step)
    parallel_dims = trainer.parallel_dims
    batches = []
    local_tokens = torch.tensor(0, dtype=torch.int64)
    for _ in range(trainer.gradient_accumulation_steps):
        input_dict, labels = next(data_iterator)
        local_tokens += (labels != IGNORE_INDEX).sum()
        batches.append((input_dict, labels))
    if parallel_dims.dp_enabled:  # an integer sum: exact
        global_tokens = dist_utils.dist_sum_tensor(
            local_tokens.to(trainer.device), parallel_dims.get_mesh("batch")
        )
    else:
        global_tokens = local_tokens.to(trainer.device)

    exact.begin()
    loss_sum = StepLoss()
    for input_dict, labels in batches:
        for key, value in input_dict.items():
            if isinstance(value, torch.Tensor):
                input_dict[key] = value.to(trainer.device)
        labels = labels.to(trainer.device)
        loss = trainer.forward_backward_step(
            input_dict=input_dict, labels=labels, global_valid_tokens=global_tokens
        )
        exact.after()
        loss_sum.add(loss, global_tokens, (labels != IGNORE_INDEX).sum())
    exact.finish()

    grads = [p.grad for m in trainer.model_parts for p in m.parameters() if p.grad is not None]
    grad_norm = clip_exact(grads, trainer.config.training.max_norm)
    trainer.checkpointer.maybe_wait_for_staging()
    trainer.optimizers.step()
    trainer.lr_schedulers.step()

    if not should_log:
        return
    group = parallel_dims.get_mesh("batch").get_group() if parallel_dims.dp_enabled else None
    loss, max_loss = loss_sum.reduce(group, trainer.device)
    ntokens = trainer.ntokens_seen
    if parallel_dims.dp_enabled:
        ntokens = int(
            dist_utils.dist_sum(
                torch.tensor(ntokens, dtype=torch.int64, device=trainer.device),
                parallel_dims.get_mesh("batch"),
            )
        )
    if not math.isfinite(loss):
        raise RuntimeError(
            f"Loss is not finite (global_avg_loss={loss}) at step {trainer.step}. Stopping training."
        )
    trainer.metrics_processor.log(
        trainer.step,
        loss,
        max_loss,
        float(grad_norm.item()),
        extra_metrics={"n_tokens_seen": ntokens, **lr_metrics},
    )
