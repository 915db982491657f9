"""A step's gradients, gradient norm and loss, each summed exactly (``fixed_point``).

Invariant: with every micro-batch's gradient computed alone (the same samples give
the same bits on any rank: the plan fixes each micro-batch's samples, and the loss
is normalised by the step's labelled tokens, an exact integer sum), the gradient
every rank holds after ``ExactGradients.finish`` is ``to_float`` of the integer sum
of every micro-batch's limbs over the whole global batch: the same bits whatever
the DP degree, so however the micro-batches were spread over ranks and summed.
The same holds for the gradient norm (``exact_norm``: the squares of those
gradients, summed exactly over the elements and the shards) and for the step's
loss (``StepLoss``). Nothing falls back to a float sum: a module FSDP did not
reduce once per micro-batch, or a reduction that is not a sum, is an error.

Two ways the gradients reach the sum:
- under FSDP (``dp_shard`` > 1) each FSDP module reduces with ``ExactReduceScatter``
  (its ``set_custom_reduce_scatter``): every micro-batch's unsharded gradient goes
  to limbs, the limbs are reduce-scattered as int64 and added to the module's own
  sum; FSDP accumulates zeros, and at the step's end the sum, as float32, is
  written into the buffer FSDP's sharded gradients are views of;
- on one rank (no FSDP, or FSDP over one rank) ``ExactGradients`` takes each parameter's gradient after
  each micro-batch into its sum and hands the sum back after the last.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor

from torchtitan_zephon.titan.reproducible.fixed_point import (
    GRADIENTS,
    SQUARES,
    carry,
    scratch,
    to_float,
    to_limbs,
    total,
)

CHUNK = 1 << 22
"""Elements turned into limbs at a time where a whole tensor is not needed at once."""


class ExactReduceScatter(ReduceScatter):
    """FSDP's reduce-scatter of one module, exact: each call's gradient goes to int64
    limbs, reduce-scattered with SUM and added to the module's sum for the step. FSDP
    is handed zeros; its first output of the step is the buffer its sharded gradients
    are views of (FSDP accumulates later outputs into them in place), so ``flush``
    writes the sum there. Under HSDP (``replicate``: the group of the module's replicas)
    the sum is also added over the replicas, as int64, before it is written; FSDP's own
    all-reduce then only adds the zeros it was handed."""

    def __init__(self, name: str, replicate: dist.ProcessGroup | None = None) -> None:
        self.name = name
        self.replicate = replicate
        self.sum: torch.Tensor | None = None
        self.first: torch.Tensor | None = None

    def allocate(
        self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        if op != dist.ReduceOp.SUM:
            raise RuntimeError(
                f"zephon.reproducible: FSDP reduced the gradients of {self.name} with {op}, "
                "not a plain sum (a gradient divide factor other than 1)"
            )
        world, n, k = group.size(), output_tensor.numel(), GRADIENTS.limbs
        device = output_tensor.device
        limbs = to_limbs(
            input_tensor, GRADIENTS, what=f"the gradient of {self.name}",
            out=scratch("limbs", k * world * n, torch.int64, device).view(k, -1),
        )  # fmt: skip
        send = scratch("send", k * world * n, torch.int64, device).view(world, k, n)
        send.copy_(limbs.view(k, world, n).transpose(0, 1))  # rank-major: rank r's chunk
        got = scratch("got", k * n, torch.int64, device)
        dist.reduce_scatter_tensor(got, send.view(-1), op=dist.ReduceOp.SUM, group=group)
        if self.sum is None:
            self.sum, self.first = got.view(k, n).clone(), output_tensor
        else:
            self.sum.add_(got.view(k, n))  # fewer than 2**31 addends: no carry needed
        output_tensor.zero_()
        return None

    def flush(self) -> None:
        if self.sum is None or self.first is None:
            raise RuntimeError(
                f"zephon.reproducible: FSDP did not reduce the gradients of {self.name} in "
                "this step"
            )
        if self.replicate is not None:
            dist.all_reduce(self.sum, op=dist.ReduceOp.SUM, group=self.replicate)
        self.first.copy_(to_float(self.sum, GRADIENTS, self.first.dtype).view_as(self.first))
        self.sum = self.first = None


class ExactGradients:
    """The exact gradient sum of one model (part) over a step's micro-batches and the
    data-parallel ranks. ``begin()`` at the step's start, ``after()`` after each
    micro-batch's backward, ``finish()`` once all have run: then every parameter's
    ``.grad`` is the exact sum (checked: under FSDP every gradient must be a view of
    a buffer the sum was written to)."""

    def __init__(self, model: nn.Module) -> None:
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.reducers: list[ExactReduceScatter] = []
        states: set[int] = set()  # fully_shard([a, b]) makes a and b share one state
        # FSDP over a shard group of one rank copies instead of reducing (it never calls a
        # reducer): then this rank's gradients are summed here (``after``)
        sharded = any(_shard_size(p) > 1 for _, p in self.params)
        for name, module in model.named_modules():
            if sharded and isinstance(module, FSDPModule) and _manages_parameters(module):
                state = id(module._get_fsdp_state())
                if state in states:
                    continue
                states.add(state)
                reducer = ExactReduceScatter(name or "the model's root", _replicas(module))
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
                module.set_reduce_scatter_unused_params(True, recurse=False)
                module.set_custom_reduce_scatter(reducer)
                self.reducers.append(reducer)
        self.sums: dict[str, torch.Tensor] = {}  # on one rank: each parameter's limbs

    @property
    def sharded(self) -> bool:
        return bool(self.reducers)

    def begin(self) -> None:
        for r in self.reducers:
            r.sum = r.first = None
        self.sums = {}

    def after(self) -> None:
        """After a micro-batch's backward: on one rank, its gradients join the sum."""
        if self.sharded:
            return
        for name, p in self.params:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            g = g.to_local() if isinstance(g, DTensor) else g
            s = self.sums.get(name)
            if s is None:
                self.sums[name] = to_limbs(g, GRADIENTS, what=f"the gradient of {name}")
            else:
                out = scratch("limbs", s.numel(), torch.int64, s.device).view(s.shape)
                s.add_(to_limbs(g, GRADIENTS, what=f"the gradient of {name}", out=out))
            p.grad = None

    def finish(self, across: Callable[[torch.Tensor], Any] | None = None) -> None:
        """Every parameter's ``.grad`` becomes the step's exact sum. ``across`` (torchft)
        sums an int64 tensor over the participating replica groups in place: the limbs of
        this group's sums go through it in one call first."""
        if across is not None:
            self._sum_across(across)
        if not self.sharded:
            for name, p in self.params:
                grad = torch.zeros_like(p)  # a DTensor like p under FSDP on one rank
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                local.copy_(to_float(self.sums.pop(name), GRADIENTS, p.dtype))
                p.grad = grad
            return
        buffers = set()
        for r in self.reducers:
            if r.first is not None:
                buffers.add(r.first.untyped_storage().data_ptr())
            r.flush()
        for name, p in self.params:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if g is None or g.untyped_storage().data_ptr() not in buffers:
                raise RuntimeError(
                    f"zephon.reproducible: the gradient of {name} is not held where FSDP's "
                    "exact reduction wrote it; its sum would not be exact"
                )

    def _sum_across(self, across: Callable[[torch.Tensor], Any]) -> None:
        if self.sharded:
            missing = [r.name for r in self.reducers if r.sum is None]
            if missing:
                raise RuntimeError(
                    f"zephon.reproducible: FSDP did not reduce the gradients of {missing[0]} "
                    "in this step"
                )
            parts = [r.sum for r in self.reducers]
        else:
            for name, p in self.params:  # a group without micro-batches adds zeros
                if name not in self.sums:
                    local = p.to_local() if isinstance(p, DTensor) else p
                    self.sums[name] = torch.zeros(
                        (GRADIENTS.limbs, *local.shape), dtype=torch.int64, device=local.device
                    )
            parts = [self.sums[name] for name, _ in self.params]
        flat = torch.cat([t.reshape(GRADIENTS.limbs, -1) for t in parts], dim=1)
        across(flat)
        at = 0
        for t in parts:
            n = t[0].numel()
            t.copy_(flat[:, at : at + n].reshape(t.shape))
            at += n


def _shard_size(p: torch.Tensor) -> int:
    """How many ranks hold a shard of ``p`` (1: a plain tensor or a replicated one)."""
    if not isinstance(p, DTensor):
        return 1
    size = 1
    for dim, placement in enumerate(p.placements):
        if placement.is_shard():
            size *= p.device_mesh.size(dim)
    return size


def _replicas(module: nn.Module) -> dist.ProcessGroup | None:
    """The group over which FSDP module ``module``'s parameters are replicated (HSDP),
    None when they are only sharded."""
    for p in module.parameters():
        if isinstance(p, DTensor):
            dims = [d for d, pl in enumerate(p.placements) if pl.is_replicate()]
            return p.device_mesh.get_group(dims[0]) if dims else None
    return None


def _manages_parameters(module: nn.Module) -> bool:
    """Whether FSDP module ``module`` manages parameters of its own (those of no FSDP
    module below it): a root whose parameters all sit in its children reduces nothing."""
    below = {
        id(p)
        for sub in module.modules()
        if sub is not module and isinstance(sub, FSDPModule)
        for p in sub.parameters()
    }
    return any(id(p) not in below for p in module.parameters())


def exact_norm(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of the gradients (float64 scalar): squares exact in float64, summed
    exactly over elements, parameters and the ranks that hold shards of a DTensor
    (its mesh's sharded dimensions; replicas are counted once)."""
    acc = torch.zeros(SQUARES.limbs, dtype=torch.int64)
    layouts = set()
    for g in grads:
        local = g
        if isinstance(g, DTensor):
            shard_dims = tuple(d for d, pl in enumerate(g.placements) if pl.is_shard())
            layouts.add((g.device_mesh, shard_dims))
            local = g.to_local()
        flat = local.detach().reshape(-1)
        for start in range(0, flat.numel(), CHUNK):
            piece = flat[start : start + CHUNK]
            sq = scratch("square", piece.numel(), torch.float64, piece.device)
            sq.copy_(piece).square_()  # exact: a float32's square has 48 bits
            out = scratch("limbs", SQUARES.limbs * piece.numel(), torch.int64, piece.device)
            limbs = to_limbs(sq, SQUARES, "a squared gradient", out.view(SQUARES.limbs, -1))
            acc += total(limbs, SQUARES).cpu()
            carry(acc)
    if len(layouts) > 1:
        raise RuntimeError(
            "zephon.reproducible: the gradients are sharded in more than one layout; the "
            "exact norm is built for FSDP / HSDP alone"
        )
    for mesh, shard_dims in layouts:
        for dim in shard_dims:
            device_acc = acc.to(mesh.device_type)
            dist.all_reduce(device_acc, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
            acc = device_acc.cpu()
    return to_float(acc, SQUARES, torch.float64).sqrt()


def clip_exact(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with the exact norm: the float32 norm, and
    every gradient scaled by ``max_norm / (norm + 1e-6)`` where that is below 1."""
    norm = exact_norm(grads).to(torch.float32)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        torch._foreach_mul_(locals_, coef.to(locals_[0].device) if locals_ else coef)
    return norm


class StepLoss:
    """The step's loss: each micro-batch's (its labels' loss sum over the step's
    labelled tokens) summed exactly over the micro-batches and the ranks; and the
    largest micro-batch mean (TorchTitan's max loss is a rank's mean, which another
    DP degree would cut differently)."""

    def __init__(self) -> None:
        self.sum = torch.zeros(GRADIENTS.limbs, 1, dtype=torch.int64)
        self.max = -float("inf")

    def add(self, loss: torch.Tensor, global_tokens: torch.Tensor, tokens: torch.Tensor) -> None:
        value = loss.detach().to(torch.float32).reshape(1).cpu()
        self.sum = carry(self.sum.add_(to_limbs(value, GRADIENTS, what="the loss")))
        if int(tokens) > 0:
            mean = value * global_tokens.cpu().to(torch.float32) / tokens.cpu().to(torch.float32)
            self.max = max(self.max, float(mean))

    def reduce(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        across: Callable[[torch.Tensor], Any] | None = None,
    ) -> tuple[float, float]:
        """(the step's loss, the largest micro-batch mean), the same on every rank:
        summed over ``group`` (the DP ranks) and, with ``across`` (torchft), over the
        replica groups (the mean is then this group's largest)."""
        s, m = self.sum.to(device), torch.tensor([self.max], dtype=torch.float64, device=device)
        if group is not None:
            dist.all_reduce(s, op=dist.ReduceOp.SUM, group=group)
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        if across is not None:
            across(s)
        return float(to_float(s.cpu(), GRADIENTS, torch.float32)), float(m.item())
