"""One simulated rank of ``zephon bench corpus``, in a process of its own (so its
resident memory is its own): ``python -m torchtitan_zephon.bench.corpus_rank URL
SEQ_LEN BATCH DP PACKING STEPS``.

It opens the store at URL as a trainer does (``TokenStore.open``; with PACKING 1 its
packing index at SEQ_LEN, ``job.packing.open_packing``: the one kept with the store,
read by page), makes the last DP rank's loader of a run at DP degree DP (local batch
BATCH, global batch BATCH x DP, seed 0) and takes its first micro-batch: the time to the
first batch. It prints one JSON line (``{"phase": "first", ...}``) and waits for a line
on stdin, takes one more step and lets what is in flight land (from then on each step
reads as far ahead as the one before: a steady state), says so (``"steady"``) and waits
again (the bench resets the server's request counts there), then takes STEPS more
steps, lets what was announced land (``JobData.settle_read_ahead``) and prints the last line (``"phase": "steps"``):
bytes fetched and requests sent over those steps (the read-ahead window slid by STEPS
steps: what they cost), and the bytes of the samples delivered per step. Local disk is whatever
``$ZEPHON_CACHE`` (a fresh folder, set by the bench) holds at the end.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any


def _rss_mb() -> float:
    """Resident memory now (Linux: /proc/self/statm), else the peak so far."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str]) -> None:
    url, seq_len, batch, dp, packing, steps = argv[0], *map(int, argv[1:6])
    from torchtitan_zephon.job.data import JobData
    from torchtitan_zephon.job.loader import ZephonLoader
    from torchtitan_zephon.job.packing import open_packing
    from torchtitan_zephon.order.layout import BatchSchedule
    from torchtitan_zephon.store.reader import TokenStore

    base_rss = _rss_mb()
    t0 = time.perf_counter()
    store = TokenStore.open(url)
    packed = open_packing(store, seq_len)[0] if packing else None
    data = JobData.of_store(store, seq_len, packed=packed)
    loader = ZephonLoader(
        data,
        seq_len=seq_len,
        seed=0,
        schedule=BatchSchedule.parse(f"1:{batch * dp}"),
        dp_rank=dp - 1,
        dp_degree=dp,
        local_batch_size=batch,
    )
    it = iter(loader)
    first: Any = next(it)
    first_s = time.perf_counter() - t0
    say(phase="first", first_batch_s=first_s, base_rss_mb=base_rss, rss_mb=_rss_mb(),
        opened_bytes=store.fetched_bytes, opened_requests=store.requests,
        num_documents=store.num_documents, num_tokens=store.num_tokens)  # fmt: skip
    sys.stdin.readline()
    next(it)  # from here on, each step reads ahead as far as the last one did
    data.settle_read_ahead()  # what was announced has landed (packed spans too)
    steady = (store.fetched_bytes, store.requests, loader.announced_through)
    say(phase="steady")
    sys.stdin.readline()
    for _ in range(steps):
        next(it)
    data.settle_read_ahead()  # what was announced has landed (packed spans too)
    say(
        phase="steps",
        fetched_bytes=store.fetched_bytes - steady[0],
        requests=store.requests - steady[1],
        steps_read=loader.announced_through - steady[2],
        step_bytes=batch * (seq_len + 1) * store.dtype.itemsize,
        rss_mb=_rss_mb(),
        first_shape=list(first[0]["input"].shape),
    )
    loader.close()
    store.close()


def say(**values: Any) -> None:
    print(json.dumps(values), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
