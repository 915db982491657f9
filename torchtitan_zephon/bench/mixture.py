"""``zephon bench mixture``: the cost of drawing from many stores instead of one.

Sources are slices of the builtin store (``store.writer.slice_store``: its whole
documents within ``source_tokens`` tokens, no tokenizing), spread over it and
overlapping when they do not fit side by side; the mixtures of 1 and 10 take
the first of the 100; every mixture draws with equal weights. It measures, side by side in one
run: (1) Zephon loader tokens/s on the single builtin store and on mixtures of
1, 10 and 100 sources (same seq_len, batch and prefetch), in steady state (after
every chunk was read once and checked), and on one store of the 100 sources'
tokens joined (``joined_store``: the 100 sources are ~25x the builtin store's
tokens, and reads spread over more memory miss the caches more; against it, the
100-source ratio is what the mixture itself costs); (2) the time to plan
one global batch of a 100-source mixture with 10 schedule entries at step 10
and at step 10^9 (and restore -> first batch at both); (3) the checkpointed data
state of that mixture in bytes.

Invariant: all loaders yield ``batch x seq_len`` input tokens per call and are
timed in interleaved rounds (the median round; tokens per CPU second beside
tokens/s: the work per token, which a busy machine changes less), the two
plan steps call by call (the fastest call: on a shared machine the others
measure the neighbours), so load from other processes hits them alike; ratios
come from figures of the same run. The loaders run in one process, so the
target is judged on tokens per CPU second. Beside the ratio of the medians, the
median of the per-round ratios (``tokens_ratio_cpu_paired``: each mixture
against the single store of the same round, a second or two apart) shows how
much of a difference is drift in the machine's load. Plan and restore calls find no
permutation cached for their step (the other step's calls evict them), as after
a restore.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_zephon.bench.builtin_corpus import builtin_store
from torchtitan_zephon.bench.measure import (
    first_batch_after_restore,
    paired_latency,
    ratio,
    round_rate,
)
from torchtitan_zephon.job.data import JobData
from torchtitan_zephon.job.loader import ZephonLoader
from torchtitan_zephon.job.plans import mixture_progress
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.mixture.config import parse_schedule
from torchtitan_zephon.order.mixture.spec import MixtureSpec, ResolvedSource
from torchtitan_zephon.order.state import DataState
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.writer import slice_store, write_derived_store

SOURCE_COUNTS = (1, 10, 100)
PLAN_STEPS = (10, 10**9)
SCHEDULE_ENTRIES = 10
TARGETS = {"tokens_ratio_100": 0.8, "plan_ratio": 1.5, "state_bytes": 64 * 1024}

DEFAULTS = {
    "seconds": 3.0,
    "seq_len": 2048,
    "batch": 8,
    "rounds": 15,
    "repeats": 60,
    "source_tokens": 1 << 19,
    "warmup_batches": 20_000,
}
QUICK = {
    "seconds": 0.3,
    "seq_len": 256,
    "batch": 2,
    "rounds": 1,
    "repeats": 3,
    "source_tokens": 1 << 14,
    "warmup_batches": 20,
}


def slices(store: TokenStore, k: int, tokens: int, root: Path) -> dict[str, TokenStore]:
    """``k`` stores of at least ``tokens`` tokens each (whole documents), slices of
    ``store`` starting at documents spread over it."""
    offsets = np.asarray(store.doc_offsets, dtype=np.int64)
    ends = np.append(offsets[1:], store.num_tokens)
    tokens = min(tokens, store.num_tokens)
    last = int(np.searchsorted(offsets, store.num_tokens - tokens, side="right")) - 1
    out = {}
    for i, d in enumerate(np.linspace(0, max(last, 0), k).astype(np.int64).tolist()):
        start = int(offsets[d])
        stop = int(ends[min(np.searchsorted(ends, start + tokens), len(ends) - 1)])
        out[f"src{i:03d}"] = slice_store(store, start, stop, root / f"src{i:03d}")
    return out


def joined_store(stores: list[TokenStore], output: Path) -> TokenStore:
    """One store holding the tokens of ``stores`` one after another (their documents
    unchanged): a single store with the 100 sources' data volume, so the comparison
    with it shows what drawing from many stores costs beyond reading more memory."""
    output.mkdir()
    blob = b"".join(np.asarray(st.tokens).tobytes() for st in stores)
    starts = np.cumsum([0] + [st.num_tokens for st in stores[:-1]])
    offsets = np.concatenate(
        [np.asarray(st.doc_offsets) + a for st, a in zip(stores, starts, strict=True)]
    )
    write_derived_store(
        output, stores[0], blob, offsets, {"name": f"{len(stores)} stores joined", "kind": "joined"}
    )
    return TokenStore.open(output)


def mixture_source(stores: dict[str, TokenStore], seq_len: int, entries: int = 1) -> JobData:
    """Equal weights in the first entry; later entries (every 10 steps) favour one
    source after another (weights 1..k rotated), so each entry has its own pattern."""
    names = sorted(stores)
    k = len(names)
    raw = [
        {
            "from_step": 1 + 10 * e,
            "weights": {n: (1 if e == 0 else 1 + (i + e) % k) for i, n in enumerate(names)},
        }
        for e in range(entries)
    ]
    schedule = parse_schedule(raw, names, "bench mixture")
    spec = MixtureSpec(
        tuple(
            ResolvedSource(n, stores[n].fingerprint, stores[n].num_samples(seq_len)) for n in names
        ),
        schedule,
        stores[names[0]].tokenizer_hash,
    )
    return JobData.of_mixture(spec, stores, seq_len, path=f"bench mixture of {k}")


def _loader(source: Any, seq_len: int, batch: int, gbs: int | None = None) -> ZephonLoader:
    return ZephonLoader(
        source,
        seq_len=seq_len,
        seed=0,
        schedule=BatchSchedule([(1, gbs or batch)]),
        dp_rank=0,
        dp_degree=1,
        local_batch_size=batch,
    )


def loader_rates(
    loaders: dict[str, ZephonLoader], tokens_per_batch: int, seconds: float, rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(tokens/s, tokens per CPU second) of each loader in each of ``rounds`` interleaved
    rounds (``measure.round_rate``: what a loader prefetched during the others' turns is
    drawn untimed first)."""
    wall: dict[str, list[float]] = {k: [] for k in loaders}
    cpu: dict[str, list[float]] = {k: [] for k in loaders}
    for _ in range(rounds):
        for name, ld in loaders.items():
            w, c = round_rate(ld.__next__, tokens_per_batch, seconds / rounds)
            wall[name].append(w)
            cpu[name].append(c)
    return wall, cpu


def paired_ratio(rounds: dict[str, list[float]], name: str, reference: str) -> float:
    """Median over rounds of ``name``'s rate over ``reference``'s rate in the same round."""
    return statistics.median(
        ratio(a, b) for a, b in zip(rounds[name], rounds[reference], strict=True)
    )


def state_at(loader: ZephonLoader, step: int) -> DataState:
    """The loader's state as saved after ``step - 1`` completed steps."""
    now = loader.data_state()
    return DataState(now.config, step, loader.plan.step_positions(step)[0], now.position_anchor)


def run(opts: dict) -> dict:
    base = QUICK if opts.get("quick") else DEFAULTS
    o = {**base, **{k: v for k, v in opts.items() if v is not None and k in base}}
    seq_len, batch = o["seq_len"], o["batch"]
    store = builtin_store()
    res: dict[str, Any] = {
        "suite": "mixture",
        "seq_len": seq_len,
        "local_batch": batch,
        "source_tokens": min(o["source_tokens"], store.num_tokens),
        "seconds_per_measure": o["seconds"],
        "rounds": o["rounds"],
        "load_average_at_start": os.getloadavg()[0],
        "targets": TARGETS,
    }
    with tempfile.TemporaryDirectory(prefix="zephon-bench-mixture-") as tmp:
        t0 = time.perf_counter()
        every = slices(store, max(SOURCE_COUNTS), o["source_tokens"], Path(tmp))
        stores = {k: dict(list(every.items())[:k]) for k in SOURCE_COUNTS}
        res["build_stores_s"] = time.perf_counter() - t0
        sizes = [st.num_samples(seq_len) for st in every.values()]
        res["source_samples"] = {"min": min(sizes), "max": max(sizes)}

        # (1) loader tokens/s: one store vs mixtures of 1, 10, 100 sources
        joined = joined_store(list(stores[max(SOURCE_COUNTS)].values()), Path(tmp) / "joined")
        loaders = {
            "single": _loader(store, seq_len, batch),
            "single_joined": _loader(joined, seq_len, batch),
        }
        for k in SOURCE_COUNTS:
            loaders[f"sources_{k}"] = _loader(mixture_source(stores[k], seq_len), seq_len, batch)
        # Steady state: the first read of each 64K-token chunk hashes it (the content
        # checks); read until every store's chunks are checked (at most warmup_batches).
        res["warmup_batches"] = {}
        for name, ld in loaders.items():
            group = ld.data.stores
            n = 0
            while n < o["warmup_batches"] and any(st.unchecked_chunks for st in group):
                next(ld)
                n += 1
            res["warmup_batches"][name] = n
        wall, cpu = loader_rates(loaders, batch * seq_len, o["seconds"] * len(loaders), o["rounds"])
        for ld in loaders.values():
            ld.close()
        tp = {k: statistics.median(v) for k, v in wall.items()}
        tp_cpu = {k: statistics.median(v) for k, v in cpu.items()}
        res["tokens_per_s"] = tp
        res["tokens_per_cpu_s"] = tp_cpu
        res["tokens_ratio"] = {
            str(k): ratio(tp[f"sources_{k}"], tp["single"]) for k in SOURCE_COUNTS
        }
        res["tokens_ratio_cpu"] = {
            str(k): ratio(tp_cpu[f"sources_{k}"], tp_cpu["single"]) for k in SOURCE_COUNTS
        }
        res["tokens_ratio_cpu_paired"] = {
            str(k): paired_ratio(cpu, f"sources_{k}", "single") for k in SOURCE_COUNTS
        }
        # The 100 sources against one store of their tokens joined (same data volume).
        big = f"sources_{max(SOURCE_COUNTS)}"
        res["joined_ratio_cpu"] = ratio(tp_cpu[big], tp_cpu["single_joined"])
        res["joined_ratio_cpu_paired"] = paired_ratio(cpu, big, "single_joined")

        # (2) plan and restore cost at step 10 vs 10^9: 100 sources, 10 schedule entries
        k = SOURCE_COUNTS[-1]
        gbs = 8 * batch
        t0 = time.perf_counter()
        source = mixture_source(stores[k], seq_len, SCHEDULE_ENTRIES)
        probe = _loader(source, seq_len, batch, gbs)
        res["plan_build_s"] = time.perf_counter() - t0
        plan = probe.plan
        t = paired_latency({s: (lambda s=s: plan.global_ids(s)) for s in PLAN_STEPS}, o["repeats"])
        res["plan_s"] = {str(s): t[s]["min_s"] for s in PLAN_STEPS}
        res["plan_median_s"] = {str(s): t[s]["median_s"] for s in PLAN_STEPS}
        res["plan_ratio"] = ratio(t[PLAN_STEPS[-1]]["min_s"], t[PLAN_STEPS[0]]["min_s"])
        states = {s: state_at(probe, s) for s in PLAN_STEPS}
        t = paired_latency(
            {
                s: (
                    lambda st=st: first_batch_after_restore(
                        _loader(source, o["seq_len"], o["batch"], gbs), st
                    )
                )
                for s, st in states.items()
            },
            max(3, o["repeats"] // 3),
        )
        res["restore_s"] = {str(s): t[s]["min_s"] for s in PLAN_STEPS}
        res["restore_ratio"] = ratio(t[PLAN_STEPS[-1]]["min_s"], t[PLAN_STEPS[0]]["min_s"])

        # (3) the checkpointed record: data state + tracker head, as the trainer saves it
        far = states[PLAN_STEPS[-1]].with_tracker({"step": PLAN_STEPS[-1] - 1, "chain": "0" * 64})
        res["state_bytes"] = len(far.to_json().encode())
        single = state_at(loaders["single"], PLAN_STEPS[-1]).with_tracker(far.tracker)
        res["single_store_state_bytes"] = len(single.to_json().encode())
        progress = mixture_progress(far)
        worst = max(abs(Fraction(s["target"]) - s["samples"]) for s in progress["sources"])
        res["deviation_at_1e9"] = float(worst)
        res["max_deviation"] = progress["max_deviation"]
        probe.close()
    res["meets"] = {
        "tokens_ratio_100": res["tokens_ratio_cpu"]["100"] >= TARGETS["tokens_ratio_100"],
        "plan_ratio": res["plan_ratio"] <= TARGETS["plan_ratio"],
        "state_bytes": res["state_bytes"] < TARGETS["state_bytes"],
    }
    return res


def rows(r: dict) -> list[tuple[str, str, str]]:
    """(measure, value, note) lines of the printed table."""
    tp, cpu = r["tokens_per_s"], r["tokens_per_cpu_s"]
    out = [
        (
            "single store tokens/s | per CPU s",
            f"{tp['single'] / 1e6:,.0f} M | {cpu['single'] / 1e6:,.0f} M",
            "the builtin store",
        )
    ]
    for k in SOURCE_COUNTS:
        note = (
            f"{r['source_samples']['min']:,}-{r['source_samples']['max']:,} samples a source; "
            f"per CPU s, median of rounds' ratios {r['tokens_ratio_cpu_paired'][str(k)]:.0%}"
        )
        if k == SOURCE_COUNTS[-1]:
            note += f"; target per CPU s >= {TARGETS['tokens_ratio_100']:.0%}"
        out.append(
            (
                f"mixture of {k} tokens/s | per CPU s",
                f"{tp[f'sources_{k}'] / 1e6:,.0f} M ({r['tokens_ratio'][str(k)]:.0%}) | "
                f"{cpu[f'sources_{k}'] / 1e6:,.0f} M ({r['tokens_ratio_cpu'][str(k)]:.0%})",
                note,
            )
        )
    out.append(
        (
            "one store of the 100 sources joined | per CPU s",
            f"{tp['single_joined'] / 1e6:,.0f} M | {cpu['single_joined'] / 1e6:,.0f} M",
            f"100 sources per CPU s: {r['joined_ratio_cpu']:.0%} of it (median of rounds' "
            f"ratios {r['joined_ratio_cpu_paired']:.0%}); same tokens, one store",
        )
    )
    p = r["plan_s"]
    out += [
        (
            "plan a global batch, step 10 | 1e9",
            f"{p['10'] * 1e6:,.0f} | {p['1000000000'] * 1e6:,.0f} us",
            f"{SOURCE_COUNTS[-1]} sources, {SCHEDULE_ENTRIES} entries",
        ),
        ("plan ratio 1e9/10", f"{r['plan_ratio']:.2f}", f"target <= {TARGETS['plan_ratio']}"),
        (
            "restore->first batch, step 10 | 1e9",
            f"{r['restore_s']['10'] * 1e3:.1f} | {r['restore_s']['1000000000'] * 1e3:.1f} ms",
            f"ratio {r['restore_ratio']:.2f}",
        ),
        ("plan build (once per job)", f"{r['plan_build_s'] * 1e3:.0f} ms", ""),
        (
            "data state bytes",
            f"{r['state_bytes']:,}",
            f"target < {TARGETS['state_bytes']:,}; one store: {r['single_store_state_bytes']:,}",
        ),
        (
            "deviation from target at step 1e9",
            f"{r['deviation_at_1e9']:.3f} samples",
            f"plan's worst over all steps: {r['max_deviation']:.3f}",
        ),
    ]
    return out
