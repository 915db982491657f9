"""The loader's read-ahead stops at the run's last step (``last_step``, the trainer's
training.steps): nothing after it is announced or made ahead of the caller, the
batches delivered are the same, and a short run on a bucket fetches ~ its own bytes."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_zephon.job.data import JobData
from torchtitan_zephon.job.loader import ZephonLoader
from torchtitan_zephon.job.source import WindowSource
from torchtitan_zephon.migrate.old_stores import add_block_checksums
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.state import DataState
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.writer import write_derived_store


class Recorded(JobData):
    """A local store's job data that records what the loader announces and reads."""

    def __init__(self, store: TokenStore, seq_len: int) -> None:
        super().__init__([WindowSource(store, seq_len)], seq_len)
        self.announced: list[np.ndarray] = []
        self.read: list[np.ndarray] = []
        self.events: list[str] = []  # "announce" / "read", in order
        self._lock = threading.Lock()

    def read_ahead(self, keys: np.ndarray, seq_len: int) -> None:
        with self._lock:
            self.announced.append(np.asarray(keys).copy())
            self.events.append("announce")

    def drop_read_ahead(self) -> None:
        pass

    def rows(self, keys: np.ndarray, seq_len: int) -> tuple[np.ndarray, None]:
        with self._lock:
            self.read.append(np.asarray(keys).copy())
            self.events.append("read")
        return super().rows(keys, seq_len)


def _loader(source, *, d: int, r: int, b: int, gbs: int, **kw) -> ZephonLoader:
    return ZephonLoader(
        source,
        seq_len=source.seq_len if isinstance(source, JobData) else kw.pop("seq_len"),
        seed=5,
        schedule=BatchSchedule.parse(f"1:{gbs}"),
        dp_rank=r,
        dp_degree=d,
        local_batch_size=b,
        **kw,
    )


@settings(max_examples=25, deadline=None)
@given(
    d=st.sampled_from([1, 2, 4]),
    b=st.integers(1, 3),
    accum=st.integers(1, 3),
    workers=st.integers(0, 2),
    prefetch=st.integers(0, 3),
    read_ahead=st.integers(0, 5),
    last_step=st.integers(1, 12),
    extra=st.integers(0, 3),
    resume=st.integers(0, 6),
    data=st.data(),
)
def test_nothing_past_the_last_step_is_read_ahead(
    store, d, b, accum, workers, prefetch, read_ahead, last_step, extra, resume, data
) -> None:
    """Whatever the layout, workers, prefetch and read-ahead: no step after ``last_step``
    is announced, no window of one is read before the caller asks for it, the lead is
    within ``lead_steps``, the first step after a (re)start is read before later steps
    are announced, and the batches equal those of a loader without an end."""
    r = data.draw(st.integers(0, d - 1))
    gbs, seq = d * b * accum, 8
    kw = dict(d=d, r=r, b=b, gbs=gbs, num_workers=workers, prefetch=prefetch)
    source = Recorded(store, seq)
    bounded = _loader(source, read_ahead_steps=read_ahead, last_step=last_step, **kw)
    free = _loader(JobData.of_store(store, seq), **kw)
    start = min(resume, last_step) + 1
    if start > 1:  # a resume: the loader continues at ``start``
        now = free.data_state()  # as saved after step start - 1
        state = DataState(
            now.config, start, free.plan.step_positions(start)[0], now.position_anchor
        )
        bounded.load_state_dict(state)
        free.load_state_dict(state)

    def ids_of(first: int, stop: int) -> set[int]:
        return {
            int(i) for s in range(first, stop + 1) for i in bounded.plan.rank_ids(s, r, d).tolist()
        }

    within = ids_of(start, last_step)
    with bounded, free:
        for _ in range(start, last_step + 1):  # the run: steps start .. last_step
            step = bounded.next_step
            for _ in range(accum):
                x, y = next(bounded)
                fx, fy = next(free)
                assert torch.equal(x["input"], fx["input"]) and torch.equal(y, fy)
                assert bounded.announced_through - step <= bounded.lead_steps(step)
        assert bounded.next_step == last_step + 1
        time.sleep(0.01)  # a window wrongly started ahead would have been read by now
        announced = {int(i) for keys in source.announced for i in keys.tolist()}
        read = {int(i) for keys in source.read for i in keys.tolist()}
        assert bounded.announced_through <= last_step
        assert announced <= within and read <= within
        if read_ahead and start <= last_step and workers <= 1:
            # the first window (one micro-batch of step ``start``) is announced alone and
            # read before the read-ahead of later steps is announced: it runs behind
            assert source.events[:2] == ["announce", "read"]
        if read_ahead:  # every step of the run was announced, in order
            assert bounded.announced_through == last_step
            assert [keys.tolist() for keys in source.announced] == [
                bounded.plan.rank_ids(s, r, d).tolist() for s in range(start, last_step + 1)
            ]
        for _ in range(extra * accum):  # past the end: made on demand, the same batches
            x, y = next(bounded)
            fx, fy = next(free)
            assert torch.equal(x["input"], fx["input"]) and torch.equal(y, fy)
        assert bounded.announced_through <= last_step


@settings(max_examples=20, deadline=None)
@given(
    d=st.sampled_from([1, 2]),
    b=st.integers(1, 3),
    accum=st.integers(1, 4),
    workers=st.integers(0, 1),
    prefetch=st.integers(0, 3),
    read_ahead=st.integers(1, 3),
    steps=st.integers(1, 10),
)
def test_with_read_ahead_a_window_holds_one_step(
    store, d, b, accum, workers, prefetch, read_ahead, steps
) -> None:
    """Issue 43 case 6: a step whose bytes arrived waits for nothing of a later step.
    With read-ahead every read the loader makes holds keys of one step only (a window
    of two steps waited for the later one's bytes, and for its failing reads)."""
    gbs, seq = d * b * accum, 8
    source = Recorded(store, seq)
    loader = _loader(source, d=d, r=d - 1, b=b, gbs=gbs, num_workers=workers,
                     prefetch=prefetch, read_ahead_steps=read_ahead)  # fmt: skip
    with loader:
        for _ in range(steps * accum):
            next(loader)
    per_step = b * accum  # keys of one step on this rank
    at = 0
    for keys in source.read:
        first_step, last_step = at // per_step, (at + len(keys) - 1) // per_step
        assert first_step == last_step, f"a read of steps {first_step + 1}..{last_step + 1}"
        at += len(keys)
    assert at >= steps * per_step


def test_last_step_must_be_positive(store) -> None:
    with pytest.raises(ValueError, match="last_step must be >= 1"):
        _loader(JobData.of_store(store, 8), d=1, r=0, b=1, gbs=1, last_step=0)


@pytest.fixture(scope="module")
def blocks_store(store, s3, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A synthetic store of 2**20 random tokens (documents of 1,000) with block checksums,
    in the bucket; (its URL, the local copy)."""
    num_tokens = 1 << 20
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, store.eos_id, size=num_tokens, dtype=np.uint16)
    starts = np.arange(0, num_tokens, 1000, dtype=np.int64)
    tokens[np.append(starts[1:], num_tokens) - 1] = store.eos_id
    folder = tmp_path_factory.mktemp("bound") / "store"
    folder.mkdir()
    write_derived_store(folder, store, tokens.tobytes(), starts, {"name": "bound", "kind": "test"})
    add_block_checksums(folder)
    return s3.upload(folder, "bound/blocks"), folder


def _fetched_per_trained(
    url: str, local: Path, steps: int, last_step: int | None, *, seq_len: int = 512, batch: int = 2
) -> float:
    remote = TokenStore.open(url)
    here = TokenStore.open(local)
    kw = dict(d=1, r=0, b=batch, gbs=batch, seq_len=seq_len, prefetch=2)  # the trainer's prefetch
    with _loader(remote, last_step=last_step, **kw) as a, _loader(here, **kw) as b:
        for _ in range(steps):
            assert torch.equal(next(a)[0]["input"], next(b)[0]["input"])
        deadline = time.time() + 60  # what is in flight lands: it counts as fetched
        while any(not s.fetch.future.done() for s in remote._steps) or remote._queued:
            assert time.time() < deadline
            time.sleep(0.01)
    remote.close()
    return remote.fetched_bytes / (steps * batch * (seq_len + 1) * remote.dtype.itemsize)


def test_a_short_run_fetches_its_own_bytes(blocks_store) -> None:
    """40 steps of 2 x 512 tokens with the trainer's prefetch and read_ahead_steps 4:
    with last_step 40, bytes fetched (opening and block checksums included) are at most
    1.1 per byte trained; without it the read-ahead runs past the end (its steps only:
    with read-ahead a window holds one step, so windows no longer grow past it)."""
    url, local = blocks_store
    bounded = _fetched_per_trained(url, local, 40, last_step=40)
    assert bounded <= 1.1, bounded
    assert _fetched_per_trained(url, local, 40, last_step=None) > bounded  # what it saves


def test_the_trainer_bounds_read_ahead_by_training_steps(store_path, tmp_path) -> None:
    """ZephonDataLoader hands training.steps to the loader as its last step."""
    from tests.titan.test_dataloader import build_zephon_dataloader, job

    view = job(tmp_path, store=str(store_path))
    dl = build_zephon_dataloader(1, 0, None, view)
    try:
        assert view.steps > 0 and dl.loader.last_step == view.steps
    finally:
        dl.close()
