"""``zephon bench packing``: whole documents in every sample, against fixed windows and
against first-fit packing, in one run.

1. **Padding and split documents** at ``seq_len``, on the builtin corpus (the builtin
   store's documents) and on a heavy-tailed corpus (document lengths drawn from a
   Pareto law, shape 1.2, scale 200 tokens, seeded): fixed windows (no padding; a
   document is split when it spans two windows or more), first-fit over the same
   look-ahead (each piece into the *oldest* open sample that holds it: ``first_fit``
   here, the rule TorchTitan main and Grain call first-fit) and Zephon's best fit
   (``order.packing``). Both packings cut a document longer than ``seq_len`` into
   ``seq_len`` pieces, which count as split.
2. **Loader throughput**: labelled tokens per second of the Zephon loader over packed
   samples against input tokens per second over windows, the same store, seq_len and
   batch, one process, interleaved rounds (target: at least 80 %). Only ``next(loader)``
   is timed; the labelled share of a packed slot is the epoch's, from the index.
3. **The packing index**: time and bytes to pack 10^6 heavy-tailed documents (one
   process), and the time from a fresh loader to its first batch after loading the state
   of step 10^6, packed against windows (median of repeats).

Invariant: every figure is measured in this run; the first-fit baseline differs from
Zephon's rule only in which open sample a piece goes to.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from torchtitan_zephon.bench.measure import ratio, round_rate
from torchtitan_zephon.order.packing import OPEN_SAMPLES, pack, pieces_of

TARGET_RATIO = 0.8
DEFAULTS = {"seq_len": 2048, "batch": 8, "seconds": 3.0, "documents": 1_000_000, "repeats": 3}
QUICK = {"seq_len": 256, "batch": 4, "seconds": 0.3, "documents": 20_000, "repeats": 1}
RESUME_STEP = 1_000_000


def heavy_tailed(documents: int, seed: int = 0) -> np.ndarray:
    """Document lengths (with EOS) of the heavy-tailed corpus."""
    rng = np.random.default_rng(seed)
    return (rng.pareto(1.2, documents) * 200 + 2).astype(np.int64)


def first_fit(lengths: np.ndarray, seq_len: int, open_samples: int = OPEN_SAMPLES) -> int:
    """Samples first-fit packing makes of the pieces of documents ``lengths``: each piece
    into the oldest open sample with room (else a new one; at the bound the oldest
    closes)."""
    _, _, pieces = pieces_of(lengths, seq_len)
    rooms: list[int] = []  # open samples, oldest first
    samples = 0
    for n in pieces.tolist():
        for k, room in enumerate(rooms):
            if room >= n:
                rooms[k] = room - n
                if rooms[k] == 0:
                    del rooms[k]
                    samples += 1
                break
        else:
            if len(rooms) == open_samples:
                rooms.pop(0)
                samples += 1
            if n == seq_len:
                samples += 1
            else:
                rooms.append(seq_len - n)
    return samples + len(rooms)


def windows_split(lengths: np.ndarray, seq_len: int) -> int:
    """Documents that span two windows or more when the corpus is cut into windows."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    return int(np.count_nonzero(starts // seq_len != (ends - 1) // seq_len))


def compare(lengths: np.ndarray, seq_len: int) -> dict[str, Any]:
    tokens = int(lengths.sum())
    packed = pack(lengths, seq_len)
    ff = first_fit(lengths, seq_len)
    longer = int(np.count_nonzero(lengths > seq_len))
    return {
        "documents": int(lengths.size),
        "tokens": tokens,
        "windows": {"padding": 0.0, "split_documents": windows_split(lengths, seq_len)},
        "first_fit": {
            "padding": 1 - tokens / (ff * seq_len),
            "split_documents": longer,
            "samples": ff,
        },  # fmt: skip
        "best_fit": {
            "padding": packed.padding_fraction(),
            "split_documents": longer,
            "samples": packed.num_samples,
        },  # fmt: skip
    }


def _loaders(store: Any, packed_data: Any, seq_len: int, batch: int) -> tuple[Any, Any]:
    from torchtitan_zephon.job.loader import ZephonLoader
    from torchtitan_zephon.order.layout import BatchSchedule

    def make(data: Any) -> ZephonLoader:
        return ZephonLoader(data, seq_len=seq_len, seed=0, schedule=BatchSchedule([(1, batch)]),
                            dp_rank=0, dp_degree=1, local_batch_size=batch)  # fmt: skip

    return make(store), make(packed_data)


def throughput(store: Any, packed_data: Any, o: dict[str, Any]) -> dict[str, Any]:
    """Window tokens/s of the plain loader against labelled tokens/s of the packed one:
    each times ``next(loader)`` alone; a packed batch's labelled tokens are its slots
    times the labelled share of the epoch (the loader draws whole epochs of packed
    samples, so over many batches the share is the epoch's; counted from the index,
    outside the timing)."""
    seq_len, batch = o["seq_len"], o["batch"]
    windows, packed = _loaders(store, packed_data, seq_len, batch)
    every = np.arange(packed_data.num_samples, dtype=np.int64) + packed_data.sample_offset
    share = packed_data.labelled_tokens(every) / (every.size * seq_len)
    rounds: dict[str, list[float]] = {"windows": [], "packed": []}
    with windows, packed:
        for _ in range(3):
            rounds["windows"].append(
                round_rate(lambda: next(windows), batch * seq_len, o["seconds"])[0]
            )
            per_s, _ = round_rate(lambda: next(packed), batch * seq_len, o["seconds"])
            rounds["packed"].append(per_s * share)
    w, p = statistics.median(rounds["windows"]), statistics.median(rounds["packed"])
    return {"window_tokens_per_s": w, "packed_labelled_tokens_per_s": p, "ratio": ratio(p, w),
            "labelled_share": share, "rounds": rounds}  # fmt: skip


def _first_batch_after_resume(loader_data: Any, seq_len: int, batch: int) -> float:
    from torchtitan_zephon.bench.contenders import state_at
    from torchtitan_zephon.job.loader import ZephonLoader
    from torchtitan_zephon.order.layout import BatchSchedule

    probe = ZephonLoader(loader_data, seq_len=seq_len, seed=0, schedule=BatchSchedule([(1, batch)]),
                         dp_rank=0, dp_degree=1, local_batch_size=batch)  # fmt: skip
    state = state_at(probe, RESUME_STEP)
    probe.close()
    t0 = time.perf_counter()
    loader = ZephonLoader(loader_data, seq_len=seq_len, seed=0, schedule=BatchSchedule([(1, batch)]),
                          dp_rank=0, dp_degree=1, local_batch_size=batch)  # fmt: skip
    loader.load_state_dict(state)
    next(loader)
    elapsed = time.perf_counter() - t0
    loader.close()
    return elapsed


def run(opts: dict) -> dict:
    import tempfile

    from torchtitan_zephon.bench.builtin_corpus import builtin_store
    from torchtitan_zephon.job.data import JobData
    from torchtitan_zephon.job.packing import document_lengths, open_packing

    base = QUICK if opts.get("quick") else DEFAULTS
    o = {**base, **{k: v for k, v in opts.items() if v is not None and k in base}}
    seq_len = o["seq_len"]
    store = builtin_store()
    res: dict[str, Any] = {"suite": "packing", "seq_len": seq_len, "batch": o["batch"],
                           "open_samples": OPEN_SAMPLES, "target_ratio": TARGET_RATIO}  # fmt: skip
    res["builtin"] = compare(document_lengths(store), seq_len)
    res["heavy_tailed"] = compare(heavy_tailed(o["documents"] // 10), seq_len)
    with tempfile.TemporaryDirectory(prefix="zephon-bench-packing-") as cache:
        packed, _ = open_packing(store, seq_len, cache_dir=cache)
        data = JobData.of_store(store, seq_len, packed=packed)
        res["throughput"] = throughput(store, data, o)
        resume = {"windows": [], "packed": []}
        for _ in range(o["repeats"]):
            resume["windows"].append(_first_batch_after_resume(store, seq_len, o["batch"]))
            resume["packed"].append(_first_batch_after_resume(data, seq_len, o["batch"]))
    res["resume_s"] = {k: statistics.median(v) for k, v in resume.items()}
    lengths = heavy_tailed(o["documents"], seed=1)
    t0 = time.perf_counter()
    index = pack(lengths, 2048)
    build = time.perf_counter() - t0
    per_million = 1e6 / lengths.size
    res["index"] = {
        "documents": int(lengths.size),
        "build_s_per_million_documents": build * per_million,
        "bytes_per_million_documents": int(
            (index.starts.nbytes + index.pieces.nbytes) * per_million
        ),
    }
    res["meets"] = {"throughput_ratio": res["throughput"]["ratio"] >= TARGET_RATIO}
    return res


def rows(r: dict) -> list[tuple[str, str, str]]:
    out = []
    for corpus in ("builtin", "heavy_tailed"):
        c = r[corpus]
        for way in ("windows", "first_fit", "best_fit"):
            out.append((
                f"{corpus} ({c['documents']:,} docs), {way.replace('_', '-')}, seq {r['seq_len']}",
                f"padding {c[way]['padding']:.2%}",
                f"{c[way]['split_documents']:,} documents split",
            ))  # fmt: skip
    t = r["throughput"]
    out.append(("loader, packed labelled tokens/s", f"{t['packed_labelled_tokens_per_s'] / 1e6:.1f} M",
                f"windows {t['window_tokens_per_s'] / 1e6:.1f} M tokens/s: "
                f"{t['ratio']:.0%} (target >= {r['target_ratio']:.0%})"))  # fmt: skip
    i = r["index"]
    out.append(("packing index per 10^6 documents", f"{i['build_s_per_million_documents']:.2f} s",
                f"{i['bytes_per_million_documents'] / 1e6:.1f} MB (seq 2048, one process)"))  # fmt: skip
    s = r["resume_s"]
    out.append((f"fresh loader -> first batch at step {RESUME_STEP:,}",
                f"{s['packed'] * 1e3:.1f} ms", f"windows {s['windows'] * 1e3:.1f} ms"))  # fmt: skip
    return out
