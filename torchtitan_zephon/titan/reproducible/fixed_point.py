"""The exact, order-free sum of floating-point values: fixed point in int64 limbs.

A value ``x`` on a ``Grid`` is held as ``limbs`` int64 integers ``L[0..k-1]`` with
``x ~= sum_j L[j] * 2**(top - 32 * j)``: ``L[0]`` is the signed whole part at the
grid's top weight, each later limb 32 more bits of fraction, so the finest weight
(the grid's step) is ``2**(top - 32 * (k - 1))``. ``to_limbs`` rounds each value to
that step once (in float64, where every step of the split is exact); from then on
values are added as integers, which is associative: any grouping and any order of
the same addends gives the same integers, so ``to_float`` gives the same bits.

Invariant (what issue 46 rests on): for any finite values below the grid's bound,
``to_float(sum of to_limbs(x) over a multiset)`` depends on the multiset only, not on
how it was split into partial sums, in what order, or on how many processes; a value
at or above the bound, or not finite, is refused (``NotRepresentable``), never
wrapped. An addend's limbs are below 2**31 in magnitude, so up to 2**31 addends are
summed without overflow (and without ``carry``, which only gives the canonical form).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LIMB_BITS = 32
_LIMB = float(2**LIMB_BITS)
_MASK = 2**LIMB_BITS - 1


class NotRepresentable(ArithmeticError):
    """A value that is not finite, or too large for the grid: an exact sum cannot
    hold it (the message says which and how large)."""


@dataclass(frozen=True)
class Grid:
    """``limbs`` int64 limbs, the first of weight ``2**top``; values below
    ``2**(top + 31)`` in magnitude are representable."""

    top: int
    limbs: int

    @property
    def bound(self) -> float:
        return 2.0 ** (self.top + LIMB_BITS - 1)

    @property
    def step(self) -> float:
        return 2.0 ** (self.top - LIMB_BITS * (self.limbs - 1))


GRADIENTS = Grid(top=0, limbs=3)
"""Gradients and losses: |x| < 2**31, rounded to 2**-64 (every float32 of magnitude
>= 2**-40 exactly)."""

SQUARES = Grid(top=32, limbs=4)
"""Squares of float32 gradients (exact in float64): |x| < 2**63, rounded to 2**-64."""


_ROUND = 1.5 * 2.0**52
"""Added and subtracted in float64, it rounds a value below 2**51 to the nearest integer
(ties to even): two additions, each rounding once, and far cheaper than ``floor``."""


_SCRATCH: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


def scratch(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A work buffer of ``numel`` elements kept between calls: one per (name, dtype,
    device), grown to the largest size asked for and sliced for smaller ones (so what is
    kept is bounded by the largest tensor). A fresh buffer of tens of MB costs more in
    page faults than the arithmetic done in it."""
    key = (name, dtype, torch.device(device))
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[key] = torch.empty(int(numel), dtype=dtype, device=device)
    return buf[: int(numel)]


def to_limbs(
    x: torch.Tensor, grid: Grid, what: str = "a value", out: torch.Tensor | None = None
) -> torch.Tensor:
    """The limbs of every element of ``x``: int64 of shape ``(grid.limbs, *x.shape)``
    (written into ``out`` when given), each limb the nearest integer of what is left
    (so in [-2**31, 2**31] after the first). Raises ``NotRepresentable`` naming ``what``
    for a value not finite or too large. Computed in place in float64 work buffers
    (``scratch``): the conversion is bound by memory."""
    x = x.detach()
    if x.numel():
        peak = torch.linalg.vector_norm(x, float("inf")).item()  # nan propagates
        if not peak < grid.bound:
            raise NotRepresentable(
                f"{what} holds {peak!r}: an exact sum takes finite values below "
                f"{grid.bound:g} in magnitude"
            )
    n = x.numel()
    v = scratch("value", n, torch.float64, x.device).view(x.shape)
    part = scratch("part", n, torch.float64, x.device).view(x.shape)
    v.copy_(x)
    if grid.top:
        v.mul_(2.0**-grid.top)  # a power of two: exact
    if out is None:
        out = torch.empty((grid.limbs, *x.shape), dtype=torch.int64, device=x.device)
    for j in range(grid.limbs):
        if j:
            v.mul_(_LIMB)  # a power of two: exact
        torch.add(v, _ROUND, out=part).sub_(_ROUND)  # the nearest integer, exactly
        out[j].copy_(part)
        v.sub_(part)  # exact: v has 24 (float32) or 48 (its square) significant bits
    return out


def carry(limbs: torch.Tensor) -> torch.Tensor:
    """The same value with every fraction limb in [0, 2**32), in place (limb 0 takes
    the carry, as a signed integer): ``to_float``'s canonical form. A sum needs it only
    before 2**31 addends."""
    high = scratch("carry", limbs[0].numel(), torch.int64, limbs.device).view(limbs[0].shape)
    for j in range(limbs.shape[0] - 1, 0, -1):
        torch.bitwise_right_shift(limbs[j], LIMB_BITS, out=high)  # floor: negatives borrow
        limbs[j].bitwise_and_(_MASK)
        limbs[j - 1].add_(high)
    return limbs


def total(limbs: torch.Tensor, grid: Grid, chunk: int = 1 << 22) -> torch.Tensor:
    """The sum over all elements of a ``to_limbs`` result (shape ``(grid.limbs, ...)``)
    as limbs of shape ``(grid.limbs,)``, carried every ``chunk`` elements."""
    flat = limbs.reshape(grid.limbs, -1)
    acc = torch.zeros(grid.limbs, dtype=torch.int64, device=limbs.device)
    for start in range(0, flat.shape[1], chunk):
        acc += flat[:, start : start + chunk].sum(dim=1)
        carry(acc)
    return acc


def to_float(limbs: torch.Tensor, grid: Grid, dtype: torch.dtype) -> torch.Tensor:
    """The value of carried limbs as ``dtype``: a function of the integers alone (so of
    the multiset summed, not of how), rounded through float64."""
    c = carry(limbs)  # the same value, in place
    v = scratch("value", c[0].numel(), torch.float64, c.device).view(c[0].shape)
    part = scratch("part", c[0].numel(), torch.float64, c.device).view(c[0].shape)
    v.copy_(c[0])
    for j in range(1, grid.limbs):
        part.copy_(c[j]).mul_(2.0 ** (-LIMB_BITS * j))  # exact: a 32-bit integer, scaled
        v.add_(part)
    if grid.top:
        v.mul_(2.0**grid.top)
    return v.to(dtype, copy=True)
