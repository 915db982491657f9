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
wrapped. Addends keep their fraction limbs in [0, 2**32] (``carry`` brings a sum
back there), so 2**30 addends may be summed between two carries without overflow.
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


def to_limbs(x: torch.Tensor, grid: Grid, what: str = "a value") -> torch.Tensor:
    """The limbs of every element of ``x``: int64 of shape ``(grid.limbs, *x.shape)``.
    Raises ``NotRepresentable`` naming ``what`` for a value not finite or too large."""
    v = x.detach().to(torch.float64)
    if v.numel():
        peak = v.abs().max().item()  # nan propagates through max
        if not peak < grid.bound:
            raise NotRepresentable(
                f"{what} holds {peak!r}: an exact sum takes finite values below "
                f"{grid.bound:g} in magnitude"
            )
    if grid.top:
        v = v * 2.0**-grid.top  # a power of two: exact
    out = torch.empty((grid.limbs, *v.shape), dtype=torch.int64, device=v.device)
    whole = torch.floor(v)
    out[0] = whole.to(torch.int64)
    rest = v - whole  # exact: v has 24 (float32) or 48 (its square) significant bits
    for j in range(1, grid.limbs):
        rest = rest * _LIMB
        part = torch.round(rest) if j == grid.limbs - 1 else torch.floor(rest)
        out[j] = part.to(torch.int64)
        rest = rest - part
    return out


def carry(limbs: torch.Tensor) -> torch.Tensor:
    """The same value with every fraction limb in [0, 2**32), in place (limb 0 takes
    the carry, as a signed integer)."""
    for j in range(limbs.shape[0] - 1, 0, -1):
        high = limbs[j] >> LIMB_BITS  # floor division: negative limbs borrow
        limbs[j] &= _MASK
        limbs[j - 1] += high
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
    c = carry(limbs.clone())
    v = c[0].to(torch.float64)
    for j in range(1, grid.limbs):
        v = v + c[j].to(torch.float64) * 2.0 ** (-LIMB_BITS * j)
    if grid.top:
        v = v * 2.0**grid.top
    return v.to(dtype)
