"""Permutation: a keyed bijection with O(1) access; map agrees with indexing."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_zephon.order.permutation import Permutation

SPECIAL_N = [1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 31, 32, 33, 97, 127, 128, 129, 1000, 1024, 4099]


@pytest.mark.parametrize("n", SPECIAL_N)
def test_bijection_special_sizes(n):
    for seed in (0, 1, 12345):
        m = Permutation(n, seed, epoch=0).map(np.arange(n))
        assert m.dtype == np.int64
        assert np.array_equal(np.sort(m), np.arange(n))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**63), epoch=st.integers(0, 10**6))
def test_bijection_random(n, seed, epoch):
    m = Permutation(n, seed, epoch).map(np.arange(n, dtype=np.int64))
    assert np.array_equal(np.sort(m), np.arange(n))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**32), data=st.data())
def test_map_agrees_with_getitem(n, seed, data):
    p = Permutation(n, seed, 3)
    positions = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=30))
    mapped = p.map(np.array(positions, dtype=np.uint64))
    assert [p[i] for i in positions] == mapped.tolist()


def test_large_n_random_access_is_cheap_and_consistent():
    p = Permutation(10**12, seed=7, epoch=2)
    positions = np.array([0, 1, 10**12 - 1, 123456789012], dtype=np.int64)
    values = p.map(positions)
    assert ((values >= 0) & (values < 10**12)).all()
    assert len(set(values.tolist())) == 4
    assert p[int(positions[2])] == values[2]


def test_epochs_and_seeds_differ():
    n = 1000
    base = Permutation(n, 1, 0).map(np.arange(n))
    assert not np.array_equal(base, Permutation(n, 1, 1).map(np.arange(n)))
    assert not np.array_equal(base, Permutation(n, 2, 0).map(np.arange(n)))
    assert np.array_equal(base, Permutation(n, 1, 0).map(np.arange(n)))
    orders = {tuple(Permutation(3, 5, e).map(np.arange(3))) for e in range(20)}
    assert len(orders) > 1  # small n: epochs still reshuffle


def test_index_errors():
    p = Permutation(5, 0, 0)
    assert len(p) == 5
    with pytest.raises(IndexError):
        p[5]
    with pytest.raises(IndexError):
        p[-1]
    with pytest.raises(IndexError):
        p.map(np.array([0, 5]))
    with pytest.raises(ValueError, match="n >= 1"):
        Permutation(0, 0, 0)
    assert Permutation(1, 9, 9)[0] == 0


def test_orders_are_pinned():
    """Changing these orders breaks resuming checkpoints written by earlier versions."""
    assert Permutation(10, 0, 0).map(np.arange(10)).tolist() == [9, 1, 7, 5, 6, 0, 4, 8, 2, 3]
    assert Permutation(10, 0, 1).map(np.arange(10)).tolist() == [0, 5, 2, 4, 1, 6, 8, 3, 7, 9]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 2**40), seed=st.integers(0, 2**32), epoch=st.integers(0, 50))
def test_scalar_and_vector_paths_agree(n, seed, epoch):
    """Small inputs take a pure-Python path, large ones numpy: same values."""
    perm = Permutation(n, seed, epoch)
    rng = np.random.default_rng(seed)
    positions = rng.integers(0, n, size=200, dtype=np.int64)
    whole = perm.map(positions)
    pieces = np.concatenate([perm.map(positions[i : i + 8]) for i in range(0, 200, 8)])
    assert np.array_equal(whole, pieces)


@settings(max_examples=200, deadline=None)
@given(
    perms=st.lists(
        st.tuples(st.integers(1, 5000), st.integers(0, 2**63 - 1), st.integers(0, 10**6)),
        min_size=1,
        max_size=6,
    ),
    data=st.data(),
)
def test_map_many_equals_each_permutation(perms, data):
    """Several permutations evaluated together (a mixture's sources) give exactly each
    one's own values, in the small-batch and the vectorized path."""
    from torchtitan_zephon.order.permutation import map_many

    objs = [Permutation(n, seed, epoch) for n, seed, epoch in perms]
    size = data.draw(st.sampled_from([0, 1, 7, 48, 49, 300]))
    which = np.array(
        data.draw(st.lists(st.integers(0, len(objs) - 1), min_size=size, max_size=size)),
        dtype=np.int64,
    )
    positions = np.array(
        [data.draw(st.integers(0, objs[w].n - 1)) for w in which.tolist()], dtype=np.int64
    )
    got = map_many(objs, which, positions)
    assert got.dtype == np.int64
    assert got.tolist() == [
        objs[w][p] for w, p in zip(which.tolist(), positions.tolist(), strict=True)
    ]
    if size:
        with pytest.raises(IndexError, match="outside"):
            map_many(objs, which[:1], np.array([objs[which[0]].n]))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**63), epoch=st.integers(0, 10**6))
def test_inverse_undoes_map_on_the_whole_domain(n, seed, epoch):
    p = Permutation(n, seed, epoch)
    positions = np.arange(n, dtype=np.int64)
    ids = p.map(positions)
    assert np.array_equal(p.inverse(ids), positions)
    assert np.array_equal(p.map(p.inverse(positions)), positions)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 2**62), seed=st.integers(0, 2**63), data=st.data())
def test_inverse_at_any_size_on_both_paths(n, seed, data):
    p = Permutation(n, seed, 5)
    ids = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=80))
    arr = np.array(ids, dtype=np.int64)
    scalar = np.concatenate([p.inverse(arr[i : i + 1]) for i in range(arr.size)])
    vector = p.inverse(arr)  # > 48 elements take the numpy path
    assert np.array_equal(scalar, vector)
    assert np.array_equal(p.map(vector), arr)


def test_inverse_refuses_an_index_outside_the_domain():
    p = Permutation(10, 1, 0)
    with pytest.raises(IndexError, match=r"sample indices must lie in \[0, 10\)"):
        p.inverse(np.array([3, 10]))
