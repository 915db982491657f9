"""A store file read by page as an array (store/paged.py), against a real S3 API on
loopback: any index gives what ``np.load`` of the file gives, pages beyond what is kept
are evicted, and an array's reads fetch its pages, not the file."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchtitan_zephon.store.location import ObjectFiles
from torchtitan_zephon.store.paged import PAGE_BYTES, PagedArray
from torchtitan_zephon.store.urls import parse_url


@pytest.fixture(scope="module")
def arrays(s3, tmp_path_factory):
    rng = np.random.default_rng(1)
    pieces = rng.integers(0, 1 << 40, (30_000, 3)).astype(np.int64)  # 720 KB: 11 pages
    offsets = np.cumsum(rng.integers(1, 100, 50_000)).astype("<i8")
    root = tmp_path_factory.mktemp("paged")
    np.save(root / "pieces.npy", pieces)
    offsets.tofile(root / "offsets.bin")
    for name in ("pieces.npy", "offsets.bin"):
        s3.put(f"paged/{name}", (root / name).read_bytes())
    files = ObjectFiles(parse_url(f"s3://{s3.bucket}/paged"))
    yield files, pieces, offsets
    files.close()


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_index_reads_what_the_file_holds(arrays, data):
    files, pieces, offsets = arrays
    paged = PagedArray.of_npy(files, "pieces.npy", "pieces.npy")
    flat = PagedArray(files, "offsets.bin", "<i8", (offsets.size,), pages_kept=3)
    rows = np.array(
        data.draw(st.lists(st.integers(0, pieces.shape[0] - 1), max_size=50)), dtype=np.int64
    )
    assert np.array_equal(paged[rows], pieces[rows])
    ids = np.array(
        data.draw(st.lists(st.integers(0, offsets.size - 1), max_size=50)), dtype=np.int64
    )
    assert np.array_equal(flat[ids], offsets[ids]) and len(flat._pages) <= 3
    i = data.draw(st.integers(0, pieces.shape[0] - 1))
    assert np.array_equal(paged[i], pieces[i]) and int(flat[i]) == int(offsets[i])
    a = data.draw(st.integers(0, pieces.shape[0]))
    assert np.array_equal(paged[a : a + 7], pieces[a : a + 7])
    assert np.array_equal(paged[rows[:5], 2] if rows.size else pieces[:0, 2], pieces[rows[:5], 2])


def test_a_lookup_fetches_its_pages_not_the_file(arrays):
    files, pieces, _ = arrays
    paged = PagedArray.of_npy(files, "pieces.npy", "pieces.npy")
    before = files.fetched_bytes
    assert np.array_equal(paged[np.array([5, 20_000])], pieces[[5, 20_000]])
    assert files.fetched_bytes - before <= 3 * PAGE_BYTES < pieces.nbytes
    assert np.array_equal(np.asarray(paged), pieces)  # the whole, asked for explicitly


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_read_by_row_any_index_reads_what_the_file_holds(arrays, data):
    """``exact``: the same values as the file for any index (repeats, any order, 2-D)."""
    files, pieces, _ = arrays
    exact = PagedArray.of_npy(files, "pieces.npy", "pieces.npy", exact=True)
    rows = np.array(
        data.draw(st.lists(st.integers(0, pieces.shape[0] - 1), max_size=50)), dtype=np.int64
    )
    assert np.array_equal(exact[rows], pieces[rows])
    pairs = np.stack([rows, np.minimum(rows + 1, pieces.shape[0] - 1)], axis=1)
    assert np.array_equal(exact[pairs], pieces[pairs])
    a = data.draw(st.integers(0, pieces.shape[0]))
    assert np.array_equal(exact[a : a + 7], pieces[a : a + 7])
    assert not exact._pages  # nothing kept


def test_read_by_row_fetches_the_rows_alone_one_request_per_run(arrays):
    files, pieces, _ = arrays
    exact = PagedArray.of_npy(files, "pieces.npy", "pieces.npy", exact=True)
    before, requests = files.fetched_bytes, files.requests
    rows = np.array([7, 5, 6, 20_000, 5], dtype=np.int64)  # runs 5-7 and 20,000
    assert np.array_equal(exact[rows], pieces[rows])
    assert files.fetched_bytes - before == 4 * 24 and files.requests - requests == 2
