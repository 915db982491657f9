"""``zephon bench loader``: the data path alone, stock TorchTitan vs Zephon.

On the same corpus (the builtin store's documents), single process, it measures
tokens/s of (1) stock TorchTitan 0.3's ``HuggingFaceTextDataLoader`` (its
``HuggingFaceTextDataset`` in a ``ParallelAwareDataloader``, tokenizing on the
fly, as TorchTitan trains),
(2) torchdata's ``StatefulDataLoader`` over a map-style dataset of the same
pre-tokenized windows (loader overhead alone), (3) the Zephon loader; each also
with loader workers, at two shapes (seq 2048 x batch 8 and seq 512 x batch 64,
or the one given). The three loaders take turns in interleaved rounds (each
round drains what a loader prefetched during the others' turns before timing
it) and each figure is the median of its rounds. Then the time to the first
batch after restoring a state
at step 10 and at step 1,000,000, and the checkpointed data state in bytes at
DP 1, 8 and 1024 against stock TorchTitan's one-pickle-per-DP-rank state.
Last, the cost of the store's content checks alone: Zephon loader tokens/s
with checks on vs off, over a first epoch (a freshly opened store: every chunk
hashed once) and in steady state (every chunk already checked).

The loaders are built in ``bench.contenders``, timed side by side in
``bench.throughput`` and ``bench.content_checks``; this module runs the suite
(``run``) and prints its table (``rows``).

Invariant: all loaders yield the same shape, ``local_batch x seq_len`` tokens
per batch; tokens/s counts input tokens delivered to the caller.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

from torchtitan_zephon.bench.builtin_corpus import builtin_store, write_jsonl
from torchtitan_zephon.bench.contenders import state_at, trainer_record_bytes, zephon_loader
from torchtitan_zephon.bench.content_checks import content_check_cost
from torchtitan_zephon.bench.measure import first_batch_after_restore, paired_latency, ratio
from torchtitan_zephon.bench.throughput import LOADERS, loader_throughput, zephon_breakdown

RESTORE_STEPS = (10, 1_000_000)
DP_DEGREES = (1, 8, 1024)
TARGETS = {
    "speedup": 100.0,
    "torchdata_ratio": 0.95,
    "restore_ratio": 1.5,
    "state_bytes": 4096,
    "check_ratio": 0.95,
}

# (seq_len, local batch) measured when neither --seq-len nor --batch is given; the
# first one is also the shape of the restore, state and content-check measures.
SHAPES = ((2048, 8), (512, 64))
QUICK_SHAPES = ((256, 2), (64, 8))
DEFAULTS = {
    "seconds": 6.0,
    "seq_len": None,
    "batch": None,
    "workers": 2,
    "repeats": 20,
    "rounds": 15,
    "epochs": 41,
}
QUICK = {
    "seconds": 0.3,
    "seq_len": None,
    "batch": None,
    "workers": 2,
    "repeats": 3,
    "rounds": 3,
    "epochs": 3,
    "max_docs": 20,
}


# ---------------------------------------------------------------- the suite


def run(opts: dict) -> dict:
    base = QUICK if opts.get("quick") else DEFAULTS
    o = {**base, **{k: v for k, v in opts.items() if v is not None and k in base}}
    if o["seq_len"] is None and o["batch"] is None:
        shapes = QUICK_SHAPES if opts.get("quick") else SHAPES
    else:
        first = (QUICK_SHAPES if opts.get("quick") else SHAPES)[0]
        shapes = ((o["seq_len"] or first[0], o["batch"] or first[1]),)
    (seq_len, batch), workers, seconds = shapes[0], o["workers"], o["seconds"]
    warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 on torch 2.13
    store = builtin_store()
    res: dict[str, Any] = {
        "suite": "loader",
        "seq_len": seq_len,
        "local_batch": batch,
        "workers": workers,
        "seconds_per_measure": seconds,
        "rounds": o["rounds"],
        "store_tokens": store.num_tokens,
        "load_average_at_start": os.getloadavg()[0],
        "targets": TARGETS,
    }
    shape_results = []
    with tempfile.TemporaryDirectory(prefix="zephon-bench-") as tmp:
        jsonl = write_jsonl(Path(tmp), max_docs=o.get("max_docs"))
        cache = Path(tmp) / "hf-cache"
        for s, b in shapes:
            shape_results.append(
                loader_throughput(store, jsonl, cache, s, b, workers, seconds, o["rounds"])
            )
    stock_rank_bytes, stock_buffer_tokens = shape_results[0]["_stock_state"]
    for r in shape_results:
        del r["_stock_state"]
    res["shapes"] = shape_results
    # The first shape's figures, at the top level (the keys the suite always had).
    for key in (
        "tokens_per_s",
        "stock_tokens_per_s",
        "torchdata_tokens_per_s",
        "zephon_tokens_per_s",
        "speedup",
        "speedup_vs_torchdata",
        "speedup_workers",
    ):
        if key in shape_results[0]:
            res[key] = shape_results[0][key]
    res["zephon_breakdown"] = zephon_breakdown(store, seq_len, batch, seconds)

    # Time to first batch after restoring (store already open: the loader's own cost).
    probe = zephon_loader(store, seq_len, batch, 0)
    states = {step: state_at(probe, step) for step in RESTORE_STEPS}
    t = paired_latency(
        {
            s: (
                lambda st=st: first_batch_after_restore(zephon_loader(store, seq_len, batch, 0), st)
            )
            for s, st in states.items()
        },
        o["repeats"],
    )
    for step in RESTORE_STEPS:
        res[f"restore_s_step_{step}"] = t[step]["median_s"]
    res["restore_ratio"] = ratio(res["restore_s_step_1000000"], res["restore_s_step_10"])

    # Checkpointed data state: Zephon's one record vs stock's pickle per DP rank.
    global_batch = batch * max(DP_DEGREES)  # one run's global batch; every DP degree divides it
    res["global_batch_for_state"] = global_batch
    state_bytes, record_bytes, stock_bytes = {}, {}, {}
    for d in DP_DEGREES:
        zl = zephon_loader(store, seq_len, batch, 0, dp_degree=d, global_batch=global_batch)
        state_bytes[str(d)], record_bytes[str(d)] = trainer_record_bytes(zl, RESTORE_STEPS[-1])
        stock_bytes[str(d)] = stock_rank_bytes * d
    res["state_bytes"] = state_bytes
    res["trainer_record_bytes"] = record_bytes
    res["stock_state_bytes"] = stock_bytes
    res["stock_rank_state_bytes"] = stock_rank_bytes
    res["stock_token_buffer_tokens"] = stock_buffer_tokens
    res["state_constant"] = len(set(record_bytes.values())) == 1 == len(set(state_bytes.values()))
    checks = content_check_cost(store.path, seq_len, batch, seconds, o["epochs"])
    res["content_checks"] = checks
    res["meets"] = {
        "speedup": res["speedup"] >= TARGETS["speedup"],
        "torchdata_ratio": min(r["speedup_vs_torchdata"] for r in shape_results)
        >= TARGETS["torchdata_ratio"],
        "restore_ratio": res["restore_ratio"] <= TARGETS["restore_ratio"],
        "state_bytes": res["state_constant"]
        and max(record_bytes.values()) < TARGETS["state_bytes"],
        "check_ratio": min(checks["first_epoch"]["ratio"], checks["steady"]["ratio"])
        >= TARGETS["check_ratio"],
    }
    return res


def rows(r: dict) -> list[tuple[str, str, str]]:
    """(measure, value, note) lines of the printed table."""
    out = []
    for shape in r["shapes"]:
        tp = shape["tokens_per_s"]
        workers = sorted({int(k.rsplit("workers", 1)[1]) for k in tp})
        for w in workers:
            z, t, s = (tp[f"{name}_workers{w}"] for name in LOADERS)
            out.append(
                (
                    f"seq {shape['seq_len']} x batch {shape['local_batch']}, {w} workers, "
                    "tokens/s: zephon | torchdata | stock",
                    f"{z / 1e6:,.1f} M | {t / 1e6:,.1f} M | {s / 1e6:,.2f} M",
                    f"zephon/torchdata {ratio(z, t):.2f}x"
                    + (f" (target >= {TARGETS['torchdata_ratio']})" if w == 0 else "")
                    + f", zephon/stock {ratio(z, s):,.1f}x"
                    + (f" (target >= {TARGETS['speedup']:.0f}x)" if w == 0 else ""),
                )
            )
        c = shape["tokens_per_cpu_s"]
        z, t, s = (c[f"{name}_workers0"] for name in LOADERS)
        out.append(
            (
                f"seq {shape['seq_len']} x batch {shape['local_batch']}, 0 workers, "
                "tokens per CPU s: zephon | torchdata | stock",
                f"{z / 1e6:,.1f} M | {t / 1e6:,.1f} M | {s / 1e6:,.2f} M",
                f"zephon/torchdata {ratio(z, t):.2f}x (all threads of this process)",
            )
        )
    out.append(
        (
            "tokens/s: median of interleaved rounds",
            f"{r['rounds']} rounds",
            f"{r['seconds_per_measure']:g} s per loader and setting in all",
        )
    )
    b = r["zephon_breakdown"]
    out.append(
        (
            "zephon us/micro-batch: plan | gather | tensors",
            f"{b['plan_us']:.1f} | {b['gather_us']:.1f} | {b['to_tensors_us']:.1f}",
            f"plan = {b['plan_share']:.0%}; planned {b['plan']} and made "
            f"{b['bundle']} micro-batches at a time",
        )
    )
    out += [
        ("restore->first batch, step 10", f"{r['restore_s_step_10'] * 1e3:.3f} ms", ""),
        ("restore->first batch, step 1e6", f"{r['restore_s_step_1000000'] * 1e3:.3f} ms", ""),
        (
            "restore ratio 1e6/10",
            f"{r['restore_ratio']:.2f}",
            f"target <= {TARGETS['restore_ratio']}",
        ),
    ]
    c = r["content_checks"]
    for phase, label in (("first_epoch", "first epoch"), ("steady", "steady state")):
        f = c[phase]
        out.append(
            (
                f"content checks on | off, {label}",
                f"{f['on_tokens_per_s']:,.0f} | {f['off_tokens_per_s']:,.0f} tokens/s",
                f"ratio {f['ratio']:.3f}, target >= {TARGETS['check_ratio']}",
            )
        )
    for d in r["state_bytes"]:
        out.append(
            (
                f"data state bytes, DP {d}",
                f"{r['trainer_record_bytes'][d]:,} (loader {r['state_bytes'][d]:,})",
                f"stock {r['stock_state_bytes'][d]:,}",
            )
        )
    return out
