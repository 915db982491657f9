"""``zephon bench scale``: what one rank computes per step, as the world grows.

For simulated DP degrees 8, 2,048 and 100,000 it times one rank's plan for a
step (``DataPlan.microbatch_ids``) and the gather of its windows
(``TokenStore.windows``) with a fixed per-rank batch (global batch = DP x 4),
and the plan alone at a fixed global batch. It also times what the trainer's
tracker does per step on every rank at audit level ``ids`` (the global ids of
the step and their digest: O(global batch), not O(world size)), and measures
how fast the sequence log grows, in bytes per step, at levels ids and tokens.
With left-out samples (``order.exclusions``): a step's plan at step 10 and 10^9 with
1 M left-out ids and 1,000 skip entries, beside the plain store's, and the cold build
of one epoch's table of those ids.

Invariant: per-rank work depends on the rank's own sample count, never on the
DP degree; the simulated ranks are the middle rank of each degree. A step's plan
with left-out samples and skips costs about the same at step 10^9 as at step 10.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_zephon.bench import tracker as tracker_bench
from torchtitan_zephon.bench.builtin_corpus import builtin_store
from torchtitan_zephon.bench.measure import latency, paired_latency, ratio
from torchtitan_zephon.order.data_config import DataConfig
from torchtitan_zephon.order.exclusions import ExcludeEntry
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.skips import SkipSteps
from torchtitan_zephon.order.stream import DataPlan
from torchtitan_zephon.tracker import SequenceTracker, ids_digest, sample_digests

DP_DEGREES = (8, 2048, 100_000)
PER_RANK = 4
FIXED_GLOBAL = 6_400_000  # the smallest global batch all three degrees divide
STEP = 1000
LEFT_OUT = {"samples": 10**9, "ids": 10**6, "skips": 1000, "gbs": 1024, "from_step": 5}
"""The left-out case: a store of 10^9 samples, 1 M left-out ids, 1,000 skip entries."""
LEFT_OUT_TARGETS = {"ratio": 1.5, "build_s": 2.0}
DEFAULTS = {"seq_len": 2048, "repeats": 200, "log_steps": 200, "left_out_ids": 10**6}
QUICK = {"seq_len": 256, "repeats": 3, "log_steps": 20, "left_out_ids": 10**4}


def _rank_work(store: Any, plan: DataPlan, d: int, seq_len: int, windows: bool) -> None:
    steps = iter(range(STEP, STEP + 10**9))

    def work() -> None:
        ids = plan.microbatch_ids(next(steps), d // 2, d, PER_RANK)
        if windows:
            for mb in ids:
                store.windows(mb, seq_len)

    return work


def log_growth(store: Any, seq_len: int, steps: int, gbs: int) -> dict[str, Any]:
    """Bytes per step the sequence log grows by, at audit levels ids and tokens."""
    schedule = BatchSchedule([(1, gbs)])
    plan = DataPlan(store.num_samples(seq_len), 0, schedule)
    config = DataConfig.make(
        seq_len=seq_len, seed=0, schedule=schedule, sample_offset=0,
        num_samples=plan.num_samples, store_fingerprint=store.fingerprint,
        tokenizer_hash=store.tokenizer_hash,
    )  # fmt: skip
    out: dict[str, Any] = {"global_batch": gbs}
    with tempfile.TemporaryDirectory(prefix="zephon-bench-") as tmp:
        for level in ("ids", "tokens"):
            path = Path(tmp) / level / "sequence_log.jsonl"
            tracker = SequenceTracker(path, config=config, writer=True)
            tracker.start({"world_size": 1, "dp_degree": 1})
            before = path.stat().st_size
            for step in range(1, steps + 1):
                ids = plan.global_ids(step)
                tokens = None
                if level == "tokens":
                    tokens = sample_digests(store.windows(ids, seq_len).astype(np.int64))
                tracker.record(step, plan.step_positions(step)[0], ids, tokens)
            out[f"{level}_bytes_per_step"] = (path.stat().st_size - before) / steps
    out["bytes_per_million_steps"] = {
        k[: -len("_bytes_per_step")]: v * 1e6 for k, v in out.items() if k.endswith("_per_step")
    }
    return out


def left_out(repeats: int, num_ids: int = LEFT_OUT["ids"]) -> dict[str, Any]:
    """One step's global ids at step 10 and 10^9 (``DataPlan.global_ids``), without and
    with ``LEFT_OUT``'s left-out ids and skip entries (each plan warm: the epoch's table
    built), and the cold build of one epoch's table of the left-out ids
    (``order.exclusions.ExclusionMap.table``: the inverse permutation of 1 M ids, sorted)."""
    c = {**LEFT_OUT, "ids": int(num_ids)}
    ids = np.sort(np.random.default_rng(0).choice(c["samples"], c["ids"], replace=False))
    skips = SkipSteps([(100 + 10**6 * k, 50) for k in range(c["skips"])])
    schedule = BatchSchedule([(1, c["gbs"])])
    base = DataPlan(c["samples"], 0, schedule)
    plan = DataPlan(
        c["samples"], 0, schedule, skips=skips,
        exclusions=[ExcludeEntry(None, c["from_step"], ids)],
    )  # fmt: skip
    fns = {}
    for step in (10, 10**9):
        for name, p in (("baseline", base), ("left_out", plan)):
            steps = iter(range(step, step + 10**9))
            fns[(name, step)] = lambda p=p, steps=steps: p.global_ids(next(steps))
    times = paired_latency(fns, repeats)
    out: dict[str, Any] = {**c, "plan_s": {}}
    for (name, step), t in times.items():
        out["plan_s"].setdefault(name, {})[str(step)] = t["median_s"]
    for name in ("baseline", "left_out"):
        out[f"{name}_ratio"] = ratio(out["plan_s"][name]["1000000000"], out["plan_s"][name]["10"])
    emap = plan.exclusion_map
    assert emap is not None
    epochs = iter(range(10**6, 10**7))
    out["build_s"] = latency(lambda: emap.table(1, next(epochs)), 3)["median_s"]
    return out


def run(opts: dict) -> dict:
    base = QUICK if opts.get("quick") else DEFAULTS
    o = {**base, **{k: v for k, v in opts.items() if v is not None and k in base}}
    seq_len, repeats = o["seq_len"], o["repeats"]
    store = builtin_store()
    n = store.num_samples(seq_len)
    per_rank: dict[str, dict[str, float]] = {}
    fixed: dict[str, dict[str, float]] = {}
    tracker_ids: dict[str, float] = {}
    plans = {d: DataPlan(n, 0, BatchSchedule([(1, d * PER_RANK)])) for d in DP_DEGREES}
    # Degrees interleaved call by call, so machine drift does not favour one of them.
    plan_t = paired_latency(
        {d: _rank_work(store, plans[d], d, seq_len, False) for d in DP_DEGREES}, repeats
    )
    both_t = paired_latency(
        {d: _rank_work(store, plans[d], d, seq_len, True) for d in DP_DEGREES}, repeats
    )
    for d in DP_DEGREES:
        plan = plans[d]
        per_rank[str(d)] = {
            "global_batch": d * PER_RANK,
            "plan_s": plan_t[d]["median_s"],
            "plan_and_windows_s": both_t[d]["median_s"],
        }
        steps = iter(range(STEP, STEP + 10**9))
        tracker_ids[str(d)] = latency(
            lambda plan=plan, steps=steps: ids_digest(plan.global_ids(next(steps)), "x", 0),
            max(3, repeats // 40),
        )["median_s"]
        fplan = DataPlan(n, 0, BatchSchedule([(1, FIXED_GLOBAL)]))
        steps = iter(range(STEP, STEP + 10**9))
        fixed[str(d)] = {
            "rank_samples": FIXED_GLOBAL // d,
            "plan_s": latency(
                lambda fplan=fplan, d=d, steps=steps: fplan.rank_ids(next(steps), d // 2, d),
                max(3, repeats // 40),
            )["median_s"],
        }
    first, last = str(DP_DEGREES[0]), str(DP_DEGREES[-1])
    return {
        "suite": "scale",
        "seq_len": seq_len,
        "per_rank_batch": PER_RANK,
        "step": STEP,
        "fixed_per_rank": per_rank,
        "per_rank_growth_100000_vs_8": ratio(
            per_rank[last]["plan_and_windows_s"], per_rank[first]["plan_and_windows_s"]
        ),
        "fixed_global_batch": FIXED_GLOBAL,
        "fixed_global": fixed,
        "tracker_ids_per_step_s": tracker_ids,
        "sequence_log": log_growth(store, seq_len, o["log_steps"], 64),
        "left_out": left_out(max(5, repeats // 10), o["left_out_ids"]),
        **tracker_bench.run(bool(opts.get("quick")), bool(opts.get("slow"))),
    }


def rows(r: dict) -> list[tuple[str, str, str]]:
    out = []
    for d, x in r["fixed_per_rank"].items():
        out.append(
            (
                f"DP {int(d):,}, {r['per_rank_batch']}/rank: rank plan | +windows",
                f"{x['plan_s'] * 1e6:.0f} us | {x['plan_and_windows_s'] * 1e6:.0f} us",
                f"global batch {x['global_batch']:,}",
            )
        )
    out.append(
        ("per-rank time, DP 100,000 / DP 8", f"{r['per_rank_growth_100000_vs_8']:.2f}x", "flat = 1")
    )
    for d, x in r["fixed_global"].items():
        out.append(
            (
                f"DP {int(d):,}, global {r['fixed_global_batch']:,}: rank plan",
                f"{x['plan_s'] * 1e3:.2f} ms",
                f"{x['rank_samples']:,} samples/rank",
            )
        )
    for d, s in r["tracker_ids_per_step_s"].items():
        gbs = r["fixed_per_rank"][d]["global_batch"]
        out.append(
            (
                f"tracker (audit ids) per step, global batch {gbs:,}",
                f"{s * 1e3:.2f} ms",
                "every rank, O(global batch)",
            )
        )
    for n, sec in r["log_resume_s"].items():
        out.append(
            (
                f"resume: find the checkpoint's record, log of {int(n):,} steps",
                f"{sec * 1e3:.2f} ms",
                "end and far behind, the slower",
            )
        )
    out.append(
        ("resume time, longest log / 1,000 steps", f"{r['log_resume_ratio']:.2f}x", "target <= 2")
    )
    out.append(
        (
            f"zephon verify, two logs of {r['verify_steps']:,} steps",
            f"{r['verify_s']:.2f} s, {r['verify_peak_rss_mb']:.0f} MB peak RSS",
            f"{r['verify_steps_per_s']:,.0f} steps/s",
        )
    )
    for n, ms in r["tracker_step_path_ms"].items():
        out.append(
            (
                f"tracker on the training thread, {int(n):,} samples/step",
                f"{ms:.3f} ms",
                "ids digest computed ahead; target < 1 ms",
            )
        )
    x = r.get("left_out")
    if x:
        plan = x["plan_s"]
        what = f"{x['ids']:,} left-out ids + {x['skips']:,} skips, global {x['gbs']:,}"
        for name, label in (("baseline", "plain store"), ("left_out", what)):
            out.append(
                (
                    f"plan a step of 10^9 samples, {label}: step 10 | 10^9",
                    f"{plan[name]['10'] * 1e6:.0f} us | {plan[name]['1000000000'] * 1e6:.0f} us",
                    f"ratio {x[f'{name}_ratio']:.2f}"
                    + (f", target <= {LEFT_OUT_TARGETS['ratio']}" if name == "left_out" else ""),
                )
            )
        out.append(
            (
                f"left-out ids: cold build of one epoch's table, {x['ids']:,} ids",
                f"{x['build_s']:.2f} s",
                f"target <= {LEFT_OUT_TARGETS['build_s']:.0f} s",
            )
        )
    log = r["sequence_log"]
    for level in ("ids", "tokens"):
        out.append(
            (
                f"sequence log growth, audit {level}",
                f"{log[f'{level}_bytes_per_step']:.0f} B/step",
                f"{log['bytes_per_million_steps'][level] / 1e6:.0f} MB per 1M steps",
            )
        )
    return out
