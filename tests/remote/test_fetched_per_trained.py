"""Bytes fetched per byte trained, block checks against chunk checks, on a store 100x
larger than the run trains (so fetching everything cannot meet the target): the
default-like job of seq_len 2048, local batch 8, 40 steps, reading ahead from the plan."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from torchtitan_zephon.job.loader import ZephonLoader
from torchtitan_zephon.migrate.old_stores import add_block_checksums
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.writer import write_derived_store


@pytest.fixture(scope="module")
def stores(store, s3, tmp_path_factory: pytest.TempPathFactory):
    """``make(num_tokens)``: a synthetic store of ``num_tokens`` random tokens (documents
    of 1,000) in the bucket twice, with block checksums and without (chunk checks); its
    (blocks URL, chunks URL, local path)."""
    made: dict[int, tuple[str, str, Path]] = {}

    def make(num_tokens: int) -> tuple[str, str, Path]:
        if num_tokens in made:
            return made[num_tokens]
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, store.eos_id, size=num_tokens, dtype=np.uint16)
        starts = np.arange(0, num_tokens, 1000, dtype=np.int64)
        tokens[np.append(starts[1:], num_tokens) - 1] = store.eos_id
        folder = tmp_path_factory.mktemp("big") / "store"
        folder.mkdir()
        source = {"name": f"synthetic {num_tokens}", "kind": "test"}
        write_derived_store(folder, store, tokens.tobytes(), starts, source)
        del tokens
        add_block_checksums(folder)
        prefix = f"big/{num_tokens}"
        chunks = s3.upload(folder, f"{prefix}/chunks", skip=("blocks.bin", "blocks.json"))
        for name in ("tokens.bin", "doc_offsets.bin", "checksums.bin"):  # copied in the bucket
            s3.client.copy_object(
                Bucket=s3.bucket,
                Key=f"{prefix}/blocks/{name}",
                CopySource=f"{s3.bucket}/{prefix}/chunks/{name}",
            )
        for name in ("blocks.bin", "blocks.json", "manifest.json"):
            s3.put(f"{prefix}/blocks/{name}", (folder / name).read_bytes())
        made[num_tokens] = (f"s3://{s3.bucket}/{prefix}/blocks", chunks, folder)
        return made[num_tokens]

    return make


def _loader(store: TokenStore, seq_len: int, batch: int, **kw) -> ZephonLoader:
    return ZephonLoader(
        store,
        seq_len=seq_len,
        seed=11,
        schedule=BatchSchedule.parse(f"1:{batch}"),
        dp_rank=0,
        dp_degree=1,
        local_batch_size=batch,
        **kw,
    )


def _run(url: str, seq_len: int, batch: int, steps: int) -> dict:
    store = TokenStore.open(url)
    opened = store.fetched_bytes  # the manifest and the checks' metadata
    loader = _loader(store, seq_len, batch, prefetch=2)  # the trainer's default prefetch
    t0 = time.perf_counter()
    batches = [next(loader)[0]["input"] for _ in range(steps)]  # one micro-batch a step
    took = time.perf_counter() - t0
    announced = loader._announced - 1  # steps whose windows were fetched (read ahead)
    deadline = time.time() + 300  # the read-ahead in flight lands: it counts as fetched
    while any(not s.fetch.future.done() for s in store._steps):
        assert time.time() < deadline
        time.sleep(0.01)
    assert not store._queued  # every step announced was fetched
    loader.close()
    store.close()
    row = (seq_len + 1) * 2
    return {
        "fetched": store.fetched_bytes,  # opening included
        "requests": store.requests,
        "announced": announced,
        "per_trained": store.fetched_bytes / (steps * batch * row),
        # per byte of the windows of the steps fetched, opening aside: what a long run
        # approaches (its opening is fetched once)
        "per_step_fetched": (store.fetched_bytes - opened) / (announced * batch * row),
        "opened": opened,
        "seconds": took,
        "batches": batches,
    }


@pytest.mark.parametrize(
    "num_tokens, seq_len, batch, steps",
    [
        (1 << 20, 512, 2, 10),  # 2 MiB store, 20 KiB trained: 102x
        pytest.param(1 << 26, 2048, 8, 40, marks=pytest.mark.slow),  # 128 MiB, 1.25 MiB: 102x
    ],
)
def test_bytes_fetched_per_byte_trained(stores, num_tokens, seq_len, batch, steps) -> None:
    blocks_url, chunks_url, path = stores(num_tokens)
    trained = steps * batch * (seq_len + 1) * 2
    assert num_tokens * 2 >= 100 * trained
    blocks = _run(blocks_url, seq_len, batch, steps)
    chunks = _run(chunks_url, seq_len, batch, steps)
    local = _loader(TokenStore.open(path), seq_len, batch)
    for a, b, c in zip(blocks["batches"], chunks["batches"], local, strict=False):
        assert torch.equal(a, c[0]["input"]) and torch.equal(b, c[0]["input"])
    for name, r in (("blocks", blocks), ("chunks", chunks)):
        print(
            f"{name}: fetched {r['fetched']:,} B in {r['requests']} requests for {trained:,} B "
            f"trained ({steps} steps of {batch} x {seq_len}, store {num_tokens * 2:,} B): "
            f"{r['per_trained']:.3f} per byte trained, {r['announced']} steps read ahead; "
            f"{r['per_step_fetched']:.4f} per byte of the steps fetched; {r['seconds']:.2f} s"
        )
    # Block checks: each window is its blocks (seq_len a multiple of 512: no rounding)
    # plus 8 bytes of block checksum per 512 tokens (opening apart). Beyond the steps
    # trained, the run fetched its last read-ahead (announced - steps steps).
    assert blocks["per_step_fetched"] <= 1.03
    opening = blocks["opened"] / trained
    assert blocks["per_trained"] <= 1.03 * blocks["announced"] / steps + opening
    assert chunks["per_step_fetched"] > 10  # whole chunks of 65,536 tokens per window
