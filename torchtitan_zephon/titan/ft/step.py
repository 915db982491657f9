"""One training step under torchft, as Zephon's trainer runs it: the quorum first, then
this group's part of B(s), one reduction, the commit.

Role: ``train_step_ft`` replaces TorchTitan's ``train_step`` when
``--fault_tolerance.enable`` is set. Each attempt at step s: a synchronous quorum
(``quorum.join_quorum``: participant i of n is known before any data is drawn; the
first step of a group waits, up to ``comm.init_timeout_seconds``, for a quorum of all
``fault_tolerance.group_size`` groups, so groups started together begin together); this
rank's micro-batches of part i of n of B(s), cut over the group's inner DP ranks
(``ZephonLoader.part_microbatches``); forward and backward with every loss divided by
the tokens of all of B(s); one SUM across the participants of every gradient and of
the loss sum (``quorum.reduce_step``); gradient clipping; the group's commit vote.
With ``zephon.reproducible`` the parts are cut in whole micro-batches
(``order.layout.part_slice``, each part a multiple of the local batch size) and the gradients
and the loss are exact sums over the group's micro-batches and, as int64 limbs, over
the groups (``titan.reproducible.gradients``), clipped by the exact norm: the same bits
as one group at any quorum. On a commit the optimizer, the LR schedule and the data state move on
(``ZephonLoader.committed``); otherwise the gradients are dropped and step s is drawn
again, on the same B(s), by the next quorum. The sequence log says so: a ``quorum``
event (the groups, torchft's quorum id) before the first step a new quorum trains, a
``retry`` event for each attempt not committed; the step still has one record.

Invariants:
- The committed update is the gradient of the mean loss over B(s) (up to the order of
  floating-point sums), whatever the quorum's size, and the logged loss is the mean
  over all of B(s): the numbers one group without torchft has at that step. For a
  mixture of experts the expert-balancing token counts are summed over the groups in
  the same collective (the experts' bias moves as one group's would) and cleared when
  a step is not committed.
- torchft's step (``Manager.current_step``) is the number of committed steps, the
  trainer's step minus one, so the quorum can tell a group that is behind.
- A group the quorum heals from its peers (one that joins a running job, or restarts
  behind them) becomes their replica before it draws any data (``heal.Healing``) and
  trains their next step.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger

from torchtitan_zephon.job.documents import document_positions
from torchtitan_zephon.titan.ft.quorum import (
    check_replica_ids,
    join_quorum,
    reduce_step,
    sum_across_groups,
)
from torchtitan_zephon.titan.reproducible.gradients import ExactGradients, StepLoss, clip_exact
from torchtitan_zephon.tracker import window_digests


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP, TP), else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _gradients(model_parts: list[torch.nn.Module]) -> list[torch.Tensor]:
    """Every trainable parameter's gradient, in the model's order, zeros where a
    parameter took no part (an expert no token reached): every group reduces the same
    list."""
    grads = []
    for model in model_parts:
        for p in model.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(_local(p.grad))
    return grads


def _expert_counts(model_parts: list[torch.nn.Module]) -> list[torch.Tensor]:
    """Every MoE layer's expert-balancing token counts (``tokens_per_expert_E``, which
    TorchTitan's optimizer hook turns into the experts' bias at the step), local shards,
    in the model's order."""
    counts = []
    for model in model_parts:
        for module in model.modules():
            count = getattr(module, "tokens_per_expert_E", None)
            if isinstance(count, torch.Tensor):
                counts.append(_local(count))
    return counts


def train_step_ft(trainer: Any, step: int) -> tuple[int, bytes | None]:
    """Train ``step`` under torchft until a quorum commits it (module docstring);
    returns the step trained (a later one when the quorum healed this group from its
    peers) and, at ``zephon.audit tokens``, the per-sample token digests of all of B(s)
    in order (every participant's, gathered): what the sequence log records."""
    manager, dl = trainer.ft, trainer.dataloader
    loader = dl.loader
    exact = trainer.exact  # zephon.reproducible: parts of whole micro-batches, exact sums
    multiple_of = loader.local_batch_size if exact is not None else 1
    if manager.current_step() != step - 1:  # a fresh start or a resume at step - 1
        manager.load_state_dict({"step": step - 1, "batches_committed": 0})
    parallel_dims = trainer.parallel_dims
    while True:
        trainer.optimizers.zero_grad()
        first = getattr(trainer, "ft_quorum", None) is None  # this process's first step:
        quorum = join_quorum(  # wait for the groups started with this one (bounded)
            manager,
            wait_for=trainer.config.fault_tolerance.group_size if first else 1,
            within_s=float(trainer.config.comm.init_timeout_seconds) if first else 0.0,
            say=lambda text: logger.info(f"Zephon: {text}"),
        )
        if manager.current_step() != step - 1:  # the quorum healed this group
            behind = step - 1
            step = trainer.ft_healing.apply()
            trainer.step = step
            logger.info(
                f"Zephon: torchft healed this group from its peers at step {step - 1} (it was "
                f"at step {behind}): weights, optimizer, LR schedule, data state and the "
                f"{step - 1 - behind} sequence-log record(s) it missed; it trains step {step}"
            )
        if dl.tracker.enabled:
            dl.ids_digests.ahead(step)
        total = torch.tensor(step_label_tokens(loader, step), dtype=torch.int64)
        total = total.to(trainer.device)
        lr_metrics = trainer.lr_schedulers.get_metrics()
        should_log = trainer.metrics_processor.should_log(step)
        if quorum != getattr(trainer, "ft_quorum", None):  # said once per quorum change
            ft = trainer.config.fault_tolerance
            members = check_replica_ids(manager, ft.replica_id, ft.group_size, quorum.part)
            first, count = loader.plan.layout.part_positions(
                step, quorum.part, quorum.parts, multiple_of
            )
            logger.info(
                f"Zephon: torchft quorum of {quorum.parts} group(s) from step {step}: this "
                f"group trains part {quorum.part} ({count} of the step's "
                f"{loader.plan.schedule.gbs(step)} samples)"
            )
            trainer.ft_quorum = quorum
            dl.tracker.annotate(  # who trains which part: this group's, and every one's
                "quorum",
                step,
                {"groups": quorum.parts, "quorum_id": _quorum_id(manager), "part": quorum.part,
                 "members": members},
            )  # fmt: skip
        loss_sum = torch.zeros((), dtype=torch.float32, device=trainer.device)
        digests = _Digests(trainer, step, quorum, multiple_of) if dl.audit == "tokens" else None
        drawn = time.perf_counter()
        microbatches = loader.part_microbatches(step, quorum.part, quorum.parts, multiple_of)
        if exact is not None:
            exact.begin()
            exact_loss = StepLoss()
        trainer.metrics_processor.data_loading_times.append(time.perf_counter() - drawn)
        for input_dict, labels in microbatches:
            if digests is not None:
                digests.add(input_dict["input"], labels)
            input_dict["positions"] = document_positions(input_dict["input"], dl.eos_id)
            trainer.metrics_processor.ntokens_since_last_log += labels.numel()
            trainer.ntokens_seen += labels.numel()
            loss = trainer.forward_backward_step(
                input_dict={k: v.to(trainer.device) for k, v in input_dict.items()},
                labels=labels.to(trainer.device),
                global_valid_tokens=total,
            )
            loss_sum += loss.detach().float()
            if exact is not None:
                exact.after()
                exact_loss.add(loss, total, (labels != IGNORE_INDEX).sum())
        counts = _expert_counts(trainer.model_parts)  # summed with the gradients: the
        if exact is not None:  # zephon.reproducible: exact sums, over the groups too
            mean_loss, grad_norm = _reduce_exactly(trainer, exact, exact_loss, counts, manager)
        else:
            reduced = _gradients(trainer.model_parts) + counts  # bias update sees all of B(s)
            mean_loss = reduce_step(manager, reduced, loss_sum)
            if parallel_dims.dp_cp_enabled:  # this group's inner ranks each summed their own
                mesh = parallel_dims.get_optional_mesh("loss")
                mean_loss = dist_utils.dist_sum(
                    torch.tensor(mean_loss, device=trainer.device), mesh
                )
            grad_norm = dist_utils.clip_grad_norm_(
                [p for m in trainer.model_parts for p in m.parameters()],
                trainer.config.training.max_norm,
                foreach=True,
                pp_mesh=parallel_dims.get_optional_mesh("pp"),
                ep_enabled=parallel_dims.ep_enabled,
            )
        tokens = digests.gathered(manager) if digests is not None else None
        if manager.should_commit():
            break
        for count in counts:  # this attempt's routing is not the step's: count again
            count.zero_()
        text = (
            f"step {step} was not committed (quorum of {quorum.parts} group(s)); it is "
            "trained again on the same samples by the next quorum"
        )
        logger.warning(f"Zephon: {text}")
        dl.tracker.annotate(
            "retry",
            step,
            {"groups": quorum.parts, "quorum_id": _quorum_id(manager), "text": text},
        )
    trainer.checkpointer.maybe_wait_for_staging()
    trainer.optimizers.step()
    trainer.lr_schedulers.step()
    loader.committed(step)
    if should_log:
        seen = loader.plan.step_positions(step + 1)[0] * loader.seq_len
        trainer.metrics_processor.log(
            step,
            float(mean_loss),
            float(mean_loss),  # the step's mean: no per-rank maximum across groups
            float(grad_norm),
            extra_metrics={"n_tokens_seen": seen, **lr_metrics},
        )
    return step, tokens


def _reduce_exactly(
    trainer: Any, exact: ExactGradients, loss: StepLoss, counts: list[torch.Tensor], manager: Any
) -> tuple[float, torch.Tensor]:
    """``zephon.reproducible`` under torchft: the group's exact gradient and loss sums
    (``titan.reproducible.gradients``) summed as integers over the participating groups
    too, and so are the MoE's expert-balancing token counts (whole numbers held in
    float32); then the exact clip. Returns (the step's loss, the gradient norm)."""
    dims = trainer.parallel_dims
    exact.finish(across=lambda limbs: sum_across_groups(manager, limbs))
    if counts:
        flat = torch.cat([c.detach().reshape(-1) for c in counts])
        whole = sum_across_groups(manager, flat.to(torch.int64))
        at = 0
        for c in counts:
            c.copy_(whole[at : at + c.numel()].view_as(c).to(c.dtype))
            at += c.numel()
    group = dims.get_mesh("batch").get_group() if dims.dp_enabled else None
    mean_loss, _ = loss.reduce(
        group, trainer.device, across=lambda s: sum_across_groups(manager, s)
    )
    grads = [p.grad for m in trainer.model_parts for p in m.parameters() if p.grad is not None]
    return mean_loss, clip_exact(grads, trainer.config.training.max_norm)


def step_label_tokens(loader: Any, step: int) -> int:
    """The labels step ``step`` trains over all of B(s), whatever part this group has:
    every token of a window, or (packed samples) what the packing index says."""
    first, gbs = loader.plan.step_positions(step)
    return loader.data.labelled_tokens(loader.plan.ids_for_positions(first, gbs))


def _quorum_id(manager: Any) -> int | None:
    """The id of the manager's current quorum (torchft 0.2 keeps it private)."""
    quorum_id = getattr(manager, "_quorum_id", None)
    return int(quorum_id) if isinstance(quorum_id, int) else None


class _Digests:
    """This rank's per-sample token digests of a step, in the step's slots: 16 bytes per
    sample at its index in B(s); summed over the group's inner ranks, then across the
    participants, every slot holds its sample's digest."""

    def __init__(self, trainer: Any, step: int, quorum: Any, multiple_of: int) -> None:
        loader = trainer.dataloader.loader
        self.trainer = trainer
        self.first = loader.plan.step_positions(step)[0]
        self.slots = np.zeros((loader.plan.schedule.gbs(step), 16), dtype=np.uint8)
        self.cuts = iter(
            loader.plan.layout.part_microbatch_positions(
                step, quorum.part, quorum.parts, loader.dp_rank, loader.dp_degree,
                loader.local_batch_size, multiple_of,
            )
        )  # fmt: skip

    def add(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        at, count = next(self.cuts)
        digests = np.frombuffer(window_digests(inputs, labels), dtype=np.uint8)
        self.slots[at - self.first : at - self.first + count] = digests.reshape(count, 16)

    def gathered(self, manager: Any) -> bytes:
        values = torch.from_numpy(self.slots.view(np.int64).reshape(-1).copy())
        dims = self.trainer.parallel_dims
        if dims.dp_enabled:  # the group's inner ranks: each filled its own slots
            group = dims.get_mesh("batch").get_group()
            torch.distributed.all_reduce(values, group=group)
        return sum_across_groups(manager, values).numpy().view(np.uint8).tobytes()
