"""``zephon bench resume``: cold start to first batch when resuming early or late.

Each measurement is a fresh Python process that imports the engine, opens the
store, builds one DP rank's loader, loads the trainer's data record (JSON text,
as DCP returns it) for step 10 or step 10,000,000 and takes ``next()``. The
parent times it from just before spawning the process to the moment the child
holds its first batch (both read the same wall clock). Also: the bytes the data
side adds to a checkpoint at DP 1, 8 and 1024, against stock TorchTitan's one
pickled dataloader state per DP rank.

Invariant: the early and late runs alternate, so drift on a shared machine
affects both alike; nothing in a child depends on the step but the state.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from torchtitan_zephon.bench.measure import child_times, ratio

STEPS = (10, 10_000_000)
DP_DEGREES = (1, 8, 1024)
TARGET_RATIO = 1.5

DEFAULTS = {"repeats": 3, "seq_len": 2048, "batch": 8}
QUICK = {"repeats": 1, "seq_len": 256, "batch": 2, "max_docs": 20}

CHILD = r"""
import json, sys, time
from torchtitan_zephon.job.loader import ZephonLoader
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.store.reader import TokenStore
t_import = time.time()
store_path, seq_len, batch, record = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
store = TokenStore.open(store_path)
t_open = time.time()
loader = ZephonLoader(store, seq_len=seq_len, seed=0, schedule=BatchSchedule([(1, batch)]),
                      dp_rank=0, dp_degree=1, local_batch_size=batch)
from torchtitan_zephon.order.state import DataState
loader.load_state_dict(DataState.from_json(record))
t_load = time.time()
inputs, labels = next(loader)
t_first = time.time()
loader.close()
print(json.dumps({"import": t_import, "open": t_open, "load": t_load, "first": t_first,
                  "next_step": loader.next_step, "shape": list(labels.shape)}))
"""


def _child(store: str, seq_len: int, batch: int, record: str) -> dict[str, float]:
    argv = [sys.executable, "-c", CHILD, store, str(seq_len), str(batch), record]
    t0, t = child_times(argv, "resume benchmark")
    return {
        "to_first_batch_s": t["first"] - t0,
        "python_and_imports_s": t["import"] - t0,
        "open_store_s": t["open"] - t["import"],
        "build_and_load_state_s": t["load"] - t["open"],
        "first_batch_s": t["first"] - t["load"],
    }


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def run(opts: dict) -> dict:
    from torchtitan_zephon.bench.builtin_corpus import builtin_store, write_jsonl
    from torchtitan_zephon.bench.contenders import (
        state_at,
        stock_loader,
        stock_rank_state,
        trainer_record_bytes,
        zephon_loader,
    )

    base = QUICK if opts.get("quick") else DEFAULTS
    o = {**base, **{k: v for k, v in opts.items() if v is not None and k in base}}
    seq_len, batch = o["seq_len"], o["batch"]
    store = builtin_store()
    probe = zephon_loader(store, seq_len, batch, 0)
    records = {}
    for step in STEPS:
        state = state_at(probe, step).with_tracker({"step": step - 1, "chain": "0" * 64})
        records[step] = state.to_json()
    probe.close()

    runs: dict[int, list[dict[str, float]]] = {s: [] for s in STEPS}
    for _ in range(o["repeats"]):
        for step in STEPS:
            runs[step].append(_child(str(store.path), seq_len, batch, records[step]))
    res: dict[str, Any] = {
        "suite": "resume",
        "seq_len": seq_len,
        "local_batch": batch,
        "repeats": o["repeats"],
        "target_ratio": TARGET_RATIO,
    }
    for step in STEPS:
        m = _median(runs[step])
        res[f"resume_s_step_{step}"] = m["to_first_batch_s"]
        res[f"phases_step_{step}"] = m
    res["resume_ratio"] = ratio(res[f"resume_s_step_{STEPS[1]}"], res[f"resume_s_step_{STEPS[0]}"])

    # Data-side checkpoint bytes: one Zephon record vs one stock pickle per DP rank.
    global_batch = batch * max(DP_DEGREES)
    zephon_bytes, stock_bytes = {}, {}
    with tempfile.TemporaryDirectory(prefix="zephon-bench-") as tmp:
        jsonl = write_jsonl(Path(tmp), max_docs=o.get("max_docs"))
        stock = stock_loader(jsonl, Path(tmp) / "hf-cache", seq_len, batch, 0)
        it = iter(stock)
        for _ in range(10):  # the stock state after step 10
            next(it)
        rank_bytes, buffer_tokens = stock_rank_state(stock)
    for d in DP_DEGREES:
        zl = zephon_loader(store, seq_len, batch, 0, dp_degree=d, global_batch=global_batch)
        zephon_bytes[str(d)] = trainer_record_bytes(zl, STEPS[1])[1]
        stock_bytes[str(d)] = rank_bytes * d
    res["checkpoint_data_bytes"] = zephon_bytes
    res["stock_checkpoint_data_bytes"] = stock_bytes
    res["stock_rank_state_bytes"] = rank_bytes
    res["stock_token_buffer_tokens"] = buffer_tokens
    res["meets"] = {"resume_ratio": res["resume_ratio"] <= TARGET_RATIO}
    return res


def rows(r: dict) -> list[tuple[str, str, str]]:
    a, b = (r[f"phases_step_{s}"] for s in STEPS)
    out = [
        (
            f"process start -> first batch, step {s:,}",
            f"{r[f'resume_s_step_{s}'] * 1e3:.0f} ms",
            f"imports {p['python_and_imports_s'] * 1e3:.0f} ms, open {p['open_store_s'] * 1e3:.1f} "
            f"ms, build+load {p['build_and_load_state_s'] * 1e3:.1f} ms, "
            f"next {p['first_batch_s'] * 1e3:.1f} ms",
        )
        for s, p in zip(STEPS, (a, b), strict=True)
    ]
    out.append(("ratio 1e7/10", f"{r['resume_ratio']:.2f}", f"target <= {TARGET_RATIO}"))
    for d, v in r["checkpoint_data_bytes"].items():
        out.append(
            (
                f"checkpoint data bytes, DP {d}",
                f"{v:,}",
                f"stock {r['stock_checkpoint_data_bytes'][d]:,}",
            )
        )
    return out
