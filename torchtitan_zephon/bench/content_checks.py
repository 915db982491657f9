"""What the store's content checks cost the Zephon loader: tokens/s with checks on vs off.

Role: ``content_check_cost`` measures, side by side, a first epoch (a freshly
opened store: every chunk hashed once) and the steady state (every chunk but one
already checked), with loaders that do not prefetch, so each figure is the whole
cost of producing a batch.

Invariant: the on and off figures of each phase are measured alternately in the
same call, with different seeds, so neither loader reads what the other just
cached.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from torchtitan_zephon.bench.measure import paired_latency, ratio
from torchtitan_zephon.job.loader import ZephonLoader
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.store.reader import TokenStore


def _sync_loader(
    store: TokenStore, seq_len: int, batch: int, samples: int, seed: int
) -> ZephonLoader:
    """A loader without prefetch: each ``next`` does all the work, checks included."""
    return ZephonLoader(
        store,
        seq_len=seq_len,
        seed=seed,
        schedule=BatchSchedule([(1, batch)]),
        dp_rank=0,
        dp_degree=1,
        local_batch_size=batch,
        num_samples=samples,
        prefetch=0,
    )


def _epoch_seconds(path: Path, seq_len: int, batch: int, verify: bool, seed: int) -> float:
    """CPU seconds of this thread to open the store afresh and read one whole epoch (every
    chunk is new). The loader has no threads, so this is all its work, and unlike wall
    time it does not count the moments other processes held the CPU."""
    t0 = time.thread_time()
    store = TokenStore.open(path, verify=verify)
    loader = _sync_loader(store, seq_len, batch, store.num_samples(seq_len), seed)
    for _ in range(store.num_samples(seq_len) // batch):
        next(loader)
    return time.thread_time() - t0


def content_check_cost(
    path: Path, seq_len: int, batch: int, seconds: float, epochs: int
) -> dict[str, Any]:
    """Loader tokens/s with the store's content checks on vs off, measured side by side.

    The loaders run without prefetch, so the figures are the whole cost of producing a
    batch (a prefetch thread would hide part of it from the consumer). First epoch: a
    freshly opened store read for one whole epoch (opening included), so every chunk is
    hashed once and batches look their chunks up until all are checked; tokens per CPU
    second (the same as tokens/s on an idle core), the median over ``epochs`` epochs, on
    and off alternating, each epoch with its own seed. Steady
    state: the loader reads all samples but those touching the last chunk (as with
    held-out samples), so one chunk stays unchecked and every batch still looks its
    chunks up, the costlier steady state (with every chunk checked a read tests one
    counter); the median time per batch, the two loaders taking turns batch by batch
    over ``seconds`` (with different seeds: neither reads what the other just cached).
    """
    epoch_s: dict[bool, list[float]] = {True: [], False: []}
    for k in range(epochs):
        for verify in (True, False) if k % 2 else (False, True):  # neither always goes first
            epoch_s[verify].append(_epoch_seconds(path, seq_len, batch, verify, seed=k))
    first = {v: statistics.median(t) for v, t in epoch_s.items()}
    on, off = TokenStore.open(path), TokenStore.open(path, verify=False)
    last_chunk = (on.num_chunks - 1) * on.chunk_tokens
    samples = max(batch, (last_chunk - seq_len) // seq_len)  # windows end before the last chunk
    samples = min(samples, on.num_samples(seq_len))
    loaders = {
        v: _sync_loader(s, seq_len, batch, samples, seed=int(v))
        for v, s in ((True, on), (False, off))
    }
    for _ in range(samples // batch):  # check every chunk these samples read
        next(loaders[True])
    t0 = time.perf_counter()
    next(loaders[False])
    repeats = max(20, int(seconds / (2 * (time.perf_counter() - t0))))
    steady = paired_latency({v: ld.__next__ for v, ld in loaders.items()}, repeats)
    unchecked = on.unchecked_chunks
    for ld in loaders.values():
        ld.close()
    tokens_epoch = (on.num_samples(seq_len) // batch) * batch * seq_len
    per_batch = batch * seq_len

    def side_by_side(on_rate: float, off_rate: float) -> dict[str, float]:
        return {
            "on_tokens_per_s": on_rate,
            "off_tokens_per_s": off_rate,
            "ratio": ratio(on_rate, off_rate),
        }

    return {
        "chunk_tokens": on.chunk_tokens,
        "chunks": on.num_chunks,
        "epoch_tokens": tokens_epoch,
        "epochs_timed": epochs,
        "steady_batches_timed": repeats,
        "steady_unchecked_chunks": unchecked,
        "first_epoch": side_by_side(tokens_epoch / first[True], tokens_epoch / first[False]),
        "steady": side_by_side(
            per_batch / steady[True]["median_s"], per_batch / steady[False]["median_s"]
        ),
    }
