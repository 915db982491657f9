"""The exact, order-free sum (titan/reproducible/fixed_point.py): whatever grouping,
order or number of ranks adds the same float32 values, the sum is the same bits."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_zephon.titan.reproducible.fixed_point import (
    GRADIENTS,
    SQUARES,
    NotRepresentable,
    carry,
    to_float,
    to_limbs,
    total,
)

finite32 = st.floats(
    min_value=-(2.0**20), max_value=2.0**20, allow_nan=False, allow_infinity=False, width=32
)


def _value(limbs: torch.Tensor, grid) -> Fraction:
    """The exact rational value of one element's limbs."""
    return sum(
        (Fraction(int(limbs[j])) * Fraction(2) ** (grid.top - 32 * j) for j in range(grid.limbs)),
        Fraction(0),
    )


def _grouped_sum(rows: list[torch.Tensor], groups: list[list[int]]) -> torch.Tensor:
    """Limbs of ``rows`` summed group by group (a rank's micro-batches), then the
    groups' sums added in the order given (the ranks' reduction)."""
    partial = []
    for g in groups:
        acc = torch.zeros((GRADIENTS.limbs, rows[0].numel()), dtype=torch.int64)
        for i in g:
            carry(acc.add_(to_limbs(rows[i], GRADIENTS)))
        partial.append(acc)
    out = torch.zeros_like(partial[0])
    for p in partial:
        carry(out.add_(p))
    return to_float(out, GRADIENTS, torch.float32)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.lists(finite32, min_size=3, max_size=3), min_size=1, max_size=12),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_grouping_and_order_gives_the_same_bits(values, seed):
    rows = [torch.tensor(v, dtype=torch.float32) for v in values]
    rng = random.Random(seed)
    one = _grouped_sum(rows, [list(range(len(rows)))])
    order = list(range(len(rows)))
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, len(rows)), rng.randint(0, len(rows) - 1)))
    groups = [order[a:b] for a, b in zip([0, *cuts], [*cuts, len(rows)], strict=True)]
    rng.shuffle(groups)
    other = _grouped_sum(rows, groups)
    assert torch.equal(one.view(torch.int32), other.view(torch.int32)), (groups, one, other)
    # and the value is the exact sum, rounded once (within float64's rounding to float32)
    for k in range(3):
        exact = sum((Fraction(float(r[k])) for r in rows), Fraction(0))
        assert float(one[k]) == pytest.approx(float(exact), rel=2**-23, abs=2**-60)


def test_a_float32_sum_depends_on_the_order_and_the_exact_one_does_not():
    """What issue 46 is about: float32 addition does not associate."""
    rng = np.random.default_rng(0)
    rows = [
        torch.tensor(rng.standard_normal(4096).astype(np.float32) * 10.0**k) for k in range(-3, 4)
    ]
    forward = rows[0].clone()
    for r in rows[1:]:
        forward += r
    backward = rows[-1].clone()
    for r in reversed(rows[:-1]):
        backward += r
    assert not torch.equal(forward, backward)  # the float sums disagree somewhere
    a = _grouped_sum(rows, [list(range(len(rows)))])
    b = _grouped_sum(rows, [[i] for i in reversed(range(len(rows)))])
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@settings(max_examples=100, deadline=None)
@given(
    x=st.floats(allow_nan=False, allow_infinity=False, width=32).filter(
        lambda v: 2.0**-40 <= abs(v) < 2.0**31 or v == 0
    )
)
def test_a_float32_goes_through_unchanged(x):
    t = torch.tensor([x], dtype=torch.float32)
    limbs = to_limbs(t, GRADIENTS)
    assert _value(limbs[:, 0], GRADIENTS) == Fraction(x)
    assert to_float(limbs, GRADIENTS, torch.float32).item() == x


@settings(max_examples=60, deadline=None)
@given(values=st.lists(finite32, min_size=1, max_size=200), chunk=st.integers(1, 64))
def test_squares_sum_exactly_whatever_the_chunking(values, chunk):
    t = torch.tensor(values, dtype=torch.float32).to(torch.float64).square()
    limbs = to_limbs(t, SQUARES)
    summed = total(limbs, SQUARES, chunk=chunk)
    exact = sum((Fraction(float(v)) ** 2 for v in values), Fraction(0))
    grid = Fraction(2) ** -64
    assert abs(_value(summed, SQUARES) - exact) <= len(values) * grid  # one rounding each
    assert torch.equal(summed, total(limbs, SQUARES, chunk=len(values)))
    got = to_float(summed, SQUARES, torch.float64).item()
    assert got == pytest.approx(math.fsum(float(v) ** 2 for v in values), rel=1e-15, abs=1e-17)


def test_carry_keeps_the_value_and_normalises_the_fractions():
    limbs = torch.tensor([[3], [-5], [2**33 + 7]], dtype=torch.int64)
    before = _value(limbs[:, 0], GRADIENTS)
    carry(limbs)
    assert _value(limbs[:, 0], GRADIENTS) == before
    assert all(0 <= int(limbs[j, 0]) < 2**32 for j in (1, 2))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 2.0**31, -(2.0**40)])
def test_what_an_exact_sum_cannot_hold_is_refused_by_name(bad):
    with pytest.raises(NotRepresentable) as e:
        to_limbs(torch.tensor([1.0, bad]), GRADIENTS, what="the gradient of layers.0.w")
    assert "the gradient of layers.0.w holds" in str(e.value)
    assert "below 2.14748e+09" in str(e.value)


def test_negative_values_and_tiny_ones_round_deterministically():
    x = torch.tensor([-0.5, -(2.0**-70), -3.25, 2.0**-70], dtype=torch.float32)
    limbs = to_limbs(x, GRADIENTS)
    back = to_float(limbs, GRADIENTS, torch.float32)
    assert back.tolist() == [-0.5, 0.0, -3.25, 0.0]  # below the grid's 2**-64: rounded away
    assert not torch.signbit(back[1])  # an exact zero is +0 whatever was summed
