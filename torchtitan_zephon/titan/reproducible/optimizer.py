"""Adam and AdamW whose update is the same bits for an element wherever it sits.

Why: under FSDP a rank updates its shard of each parameter, so an element's place
in the local tensor depends on the DP degree. PyTorch's CPU kernels compute the
bulk of a tensor in vector registers and its last few elements with scalar code,
and a kernel that multiplies and adds in one expression (``addcmul``, ``addcdiv``,
``lerp``, ``add`` with ``alpha``) may round the two paths differently (a fused
multiply-add in one of them): the same Adam step gave other bits for the last
elements of a shard (measured: ``exp_avg_sq`` of 1-D norm weights at DP 3).

Invariant: ``exact_step`` updates each element with a fixed sequence of kernels
that each round once (``mul`` by a scalar, ``mul``, ``div``, ``sqrt``, and ``add``
or ``sub`` with alpha 1, whose fused and unfused forms are the same number), so
an element's new parameter and moments depend on its own old values, its gradient
and the step's hyperparameters alone, on any layout, in vector or scalar code. The
state is PyTorch's (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints load into
either. The numbers differ from PyTorch's own kernels by rounding: a reproducible
run is compared with reproducible runs.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torchtitan_zephon.titan.reproducible.fixed_point import scratch

SUPPORTED = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}
"""The optimizers ``exact_step`` computes (TorchTitan's names)."""

UNSUPPORTED_FLAGS = frozenset({"amsgrad", "maximize"})
"""Options of theirs it does not compute (refused at start)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def exact_step(optimizer: torch.optim.Optimizer, closure: Any = None) -> None:
    """One Adam / AdamW step of ``optimizer`` (``torch.optim.Adam`` or ``AdamW``), in
    kernels that each round once."""
    if closure is not None:
        raise RuntimeError("zephon.reproducible: the exact optimizer step takes no closure")
    decoupled = isinstance(optimizer, torch.optim.AdamW)
    for group in optimizer.param_groups:
        lr, (beta1, beta2) = float(group["lr"]), group["betas"]
        eps, decay = group["eps"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state[p]
            if not state:  # PyTorch's layout of the state
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            step = float(state["step"])
            x, g = _local(p), _local(p.grad)
            m, v = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
            if decay != 0:
                if decoupled:
                    x.mul_(1 - lr * decay)
                else:
                    g = g + x * decay
            t = scratch("adam", g.numel(), g.dtype, g.device).view(g.shape)  # no page faults
            m.mul_(beta1).add_(torch.mul(g, 1 - beta1, out=t))
            v.mul_(beta2).add_(torch.mul(g, g, out=t).mul_(1 - beta2))
            torch.sqrt(v, out=t).div_(math.sqrt(1 - beta2**step)).add_(eps)  # the denominator
            x.sub_(torch.div(m, t, out=t).mul_(lr / (1 - beta1**step)))


def use_exact_steps(optimizers: list[torch.optim.Optimizer]) -> None:
    """Make every optimizer of TorchTitan's container step with ``exact_step``;
    refuse (``ValueError``) one it cannot compute exactly."""
    for opt in optimizers:
        if type(opt) not in SUPPORTED.values():
            raise ValueError(
                f"zephon.reproducible computes Adam and AdamW updates exactly, not "
                f"{type(opt).__name__}: use AdamW (optimizer.name), or turn zephon.reproducible off"
            )
        for group in opt.param_groups:
            for flag in sorted(UNSUPPORTED_FLAGS):
                if group.get(flag):
                    raise ValueError(
                        f"zephon.reproducible computes Adam and AdamW without {flag}: turn "
                        f"{flag} off, or turn zephon.reproducible off"
                    )
        opt.step = types.MethodType(exact_step, opt)  # type: ignore[method-assign]
