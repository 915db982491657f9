"""Tokens/s of the three loaders at one shape, in interleaved rounds, and where the
Zephon loader's time goes.

Role: ``loader_throughput`` runs the stock, torchdata and Zephon loaders
(``bench.contenders``) in turns, with 0 and N loader workers, and reports each
one's median round; ``zephon_breakdown`` times the Zephon loader's parts (plan,
gather, tensors) as its prefetch thread does them.

Invariant: every figure compared is measured in the same call, the loaders
taking turns round by round (each round drains what a loader prefetched during
the others' turns before timing it); tokens/s counts input tokens delivered to
the caller.
"""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path
from typing import Any

from torchtitan_zephon.bench.contenders import (
    forever,
    shutdown,
    stock_loader,
    stock_rank_state,
    torchdata_loader,
    zephon_loader,
)
from torchtitan_zephon.bench.measure import rate, ratio, round_rate
from torchtitan_zephon.store.reader import TokenStore


def zephon_breakdown(store: TokenStore, seq_len: int, batch: int, seconds: float) -> dict:
    """Microseconds per micro-batch of the Zephon loader's parts, as its prefetch thread
    does them: plan (the ids of ``max_plan`` micro-batches in one call), gather and
    int64 tensors (``max_bundle`` micro-batches at once)."""
    zl = zephon_loader(store, seq_len, batch, 0)
    plan_ids = zl.max_plan * batch
    starts = itertools.count(0, plan_ids)
    plan_rate = rate(
        lambda: zl.plan.rank_stream_ids(1, next(starts), plan_ids, 0, 1), 1, seconds / 3
    )
    ids = zl.plan.rank_stream_ids(1, 0, zl.max_bundle * batch, 0, 1)
    gather_rate = rate(lambda: store.windows(ids, seq_len), 1, seconds / 3)
    tensor_rate = rate(lambda: zl.batch(ids), 1, seconds / 3)
    zl.close()
    plan_us = 1e6 / plan_rate["per_s"] / zl.max_plan
    batch_us = 1e6 / tensor_rate["per_s"] / zl.max_bundle
    gather_us = 1e6 / gather_rate["per_s"] / zl.max_bundle
    return {
        "bundle": zl.max_bundle,
        "plan": zl.max_plan,
        "plan_us": plan_us,
        "gather_us": gather_us,
        "to_tensors_us": batch_us - gather_us,
        "plan_share": plan_us / (plan_us + batch_us),
    }


LOADERS = ("zephon", "torchdata", "stock")


def loader_throughput(
    store: TokenStore, jsonl: Path, cache: Path, seq_len: int, batch: int, workers: int,
    seconds: float, rounds: int,
) -> dict[str, Any]:  # fmt: skip
    """Tokens/s of the three loaders at one shape, each with 0 and ``workers`` loader
    workers: ``rounds`` interleaved rounds (zephon, torchdata, stock, zephon, ...), of
    ``seconds / rounds`` each per loader, and the median round of each loader.

    The median is robust to the rounds that other processes on a shared machine
    disturbed, for every loader alike; the per-round figures are kept beside it.
    Without workers every loader runs in this process, so its tokens per CPU second
    (all its threads) are measured too: the work per token, whatever the machine's
    load, where tokens/s also rewards a loader's background thread for the CPU
    share it wins on a busy machine.
    """
    tokens_per_batch = batch * seq_len
    per_round: dict[str, list[float]] = {}
    cpu_round: dict[str, list[float]] = {}
    stock_state: tuple[int, int | None] = (0, None)
    for w in [0, workers] if workers else [0]:
        zl = zephon_loader(store, seq_len, batch, w)
        td = torchdata_loader(store, seq_len, batch, w)
        td_it = forever(td)
        stock = stock_loader(jsonl, cache, seq_len, batch, w)
        stock_it = iter(stock)
        nexts = {"zephon": zl.__next__, "torchdata": td_it.__next__, "stock": stock_it.__next__}
        for _ in range(rounds):
            for name, fn in nexts.items():
                r, cpu = round_rate(fn, tokens_per_batch, seconds / rounds)
                per_round.setdefault(f"{name}_workers{w}", []).append(r)
                if w == 0:  # with workers, their processes' CPU time is not ours to see
                    cpu_round.setdefault(f"{name}_workers{w}", []).append(cpu)
        if w == 0:  # a mid-stream state, as a checkpoint would hold it
            stock_state = stock_rank_state(stock)
        zl.close()
        td_it.close()
        shutdown(td)
        shutdown(stock)
        del nexts, stock_it
    tp = {k: statistics.median(v) for k, v in per_round.items()}
    tp_cpu = {k: statistics.median(v) for k, v in cpu_round.items()}
    out: dict[str, Any] = {
        "seq_len": seq_len,
        "local_batch": batch,
        "tokens_per_s": tp,
        "tokens_per_s_rounds": per_round,
        "stock_tokens_per_s": tp["stock_workers0"],
        "torchdata_tokens_per_s": tp["torchdata_workers0"],
        "zephon_tokens_per_s": tp["zephon_workers0"],
        "speedup": ratio(tp["zephon_workers0"], tp["stock_workers0"]),
        "speedup_vs_torchdata": ratio(tp["zephon_workers0"], tp["torchdata_workers0"]),
        "tokens_per_cpu_s": tp_cpu,
        "speedup_vs_torchdata_cpu": ratio(tp_cpu["zephon_workers0"], tp_cpu["torchdata_workers0"]),
        # the same ratio round by round (each round's two figures measured moments apart)
        "speedup_vs_torchdata_paired": statistics.median(
            ratio(z, t)
            for z, t in zip(
                per_round["zephon_workers0"], per_round["torchdata_workers0"], strict=True
            )
        ),
    }
    if workers:
        w = f"workers{workers}"
        out["speedup_workers"] = ratio(tp[f"zephon_{w}"], tp[f"stock_{w}"])
        out["speedup_vs_torchdata_workers"] = ratio(tp[f"zephon_{w}"], tp[f"torchdata_{w}"])
    out["_stock_state"] = stock_state
    return out
