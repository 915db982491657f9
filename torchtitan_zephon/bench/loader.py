"""``zephon bench loader``: the data path alone, stock TorchTitan vs Zephon.

On the same corpus (the builtin store's documents), single process, it measures
tokens/s of (1) stock TorchTitan's ``HuggingFaceTextDataset`` in a
``ParallelAwareDataloader`` (tokenizing on the fly, as TorchTitan trains),
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

Invariant: all loaders yield the same shape, ``local_batch x seq_len`` tokens
per batch; tokens/s counts input tokens delivered to the caller.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import pickle
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchtitan_zephon.bench.corpus import TOKENIZER_DIR, builtin_store, write_jsonl
from torchtitan_zephon.bench.measure import paired_latency, rate, ratio, round_rate
from torchtitan_zephon.loader import ZephonLoader
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.state import DataState
from torchtitan_zephon.order.stream import DataPlan
from torchtitan_zephon.store.reader import TokenStore

DATASET_NAME = "zephon_bench_corpus"
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


# ---------------------------------------------------------------- stock TorchTitan


def _register_stock_dataset(jsonl: Path, cache_dir: Path) -> None:
    """Make ``HuggingFaceTextDataset(DATASET_NAME, path)`` read a local JSONL file."""
    import torchtitan_zephon.titan  # noqa: F401  (lets torchtitan import without triton)

    # isort: split
    from datasets import load_dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    DATASETS[DATASET_NAME] = DatasetConfig(
        path=str(jsonl),
        loader=lambda p: load_dataset(
            "json", data_files=p, split="train", cache_dir=str(cache_dir)
        ),
        sample_processor=lambda sample: sample["text"],
    )


def stock_loader(
    jsonl: Path, cache_dir: Path, seq_len: int, batch: int, workers: int, dp_rank: int = 0,
    dp_degree: int = 1,
) -> Any:  # fmt: skip
    """Stock TorchTitan's text loader, built as ``build_text_dataloader`` builds it."""
    _register_stock_dataset(jsonl, cache_dir)
    import datasets
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 on torch 2.13
    logging.getLogger().setLevel(logging.ERROR)  # TorchTitan's "re-looped" warning per epoch
    dataset = HuggingFaceTextDataset(
        dataset_name=DATASET_NAME,
        dataset_path=str(jsonl),
        tokenizer=HuggingFaceTokenizer(str(TOKENIZER_DIR)),
        seq_len=seq_len,
        dp_rank=dp_rank,
        dp_world_size=dp_degree,
        infinite=True,
    )
    kwargs: dict[str, Any] = {"batch_size": batch, "num_workers": workers}
    if workers:
        kwargs.update(persistent_workers=True, prefetch_factor=2)
    return ParallelAwareDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_degree, **kwargs)


# ---------------------------------------------------------------- torchdata, map-style


class StoreWindows(torch.utils.data.Dataset):
    """Map-style dataset: item k is the k-th window of one epoch of the Zephon plan."""

    def __init__(self, store: TokenStore, seq_len: int, ids: np.ndarray) -> None:
        self.store, self.seq_len, self.ids = store, seq_len, ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, k: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        w = torch.from_numpy(self.store.window(int(self.ids[k]), self.seq_len).astype(np.int64))
        return {"input": w[:-1]}, w[1:]


def torchdata_loader(store: TokenStore, seq_len: int, batch: int, workers: int) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    n = store.num_samples(seq_len)
    ids = DataPlan(n, 0, BatchSchedule([(1, batch)])).ids_for_positions(0, n)
    kwargs: dict[str, Any] = {"batch_size": batch, "num_workers": workers, "drop_last": True}
    if workers:
        kwargs.update(persistent_workers=True, prefetch_factor=2)
    return StatefulDataLoader(StoreWindows(store, seq_len, ids), **kwargs)


def _forever(loader: Any) -> Any:
    """Iterate a finite loader forever (re-entering it at each epoch end)."""
    while True:
        yield from loader


# ---------------------------------------------------------------- Zephon


def zephon_loader(
    store: TokenStore, seq_len: int, batch: int, workers: int, *, dp_degree: int = 1,
    global_batch: int | None = None,
) -> ZephonLoader:  # fmt: skip
    gbs = global_batch or batch * dp_degree
    return ZephonLoader(
        store,
        seq_len=seq_len,
        seed=0,
        schedule=BatchSchedule([(1, gbs)]),
        dp_rank=0,
        dp_degree=dp_degree,
        local_batch_size=batch,
        num_workers=workers,
    )


def state_at(loader: ZephonLoader, step: int) -> DataState:
    """The loader's state as it would be saved after ``step - 1`` completed steps."""
    now = loader.data_state()
    return DataState(now.config, step, loader.plan.step_positions(step)[0], now.position_anchor)


def trainer_record_bytes(loader: ZephonLoader, step: int) -> tuple[int, int]:
    """(bytes of the loader state JSON, bytes of the trainer's DCP record) at ``step``.

    The trainer record is ``ZephonDataLoader.state_dict()``: ``{"zephon": JSON}``
    with the tracker head added; we count the JSON text DCP stores.
    """
    from torchtitan_zephon.tracker import genesis

    state = state_at(loader, step)
    record = state.with_tracker({"step": step - 1, "chain": genesis(state.config.fingerprint)})
    return len(json.dumps(state.to_dict()).encode()), len(record.to_json().encode())


def _restore_first_batch(store: TokenStore, seq_len: int, batch: int, state: DataState) -> None:
    loader = zephon_loader(store, seq_len, batch, 0)
    try:
        loader.load_state_dict(state)
        next(loader)
    finally:
        loader.close()


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


# ---------------------------------------------------------------- the suite


def _shutdown(loader: Any) -> None:
    """Stop a StatefulDataLoader's persistent workers now (not at garbage collection)."""
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
    loader._iterator = None


def _stock_rank_state(loader: Any) -> tuple[int, int | None]:
    """(bytes of one DP rank's pickled state, tokens in its carried-over buffer)."""
    blob = loader.state_dict()[loader._rank_id]
    inner = pickle.loads(blob)
    ds = inner.get("dataset_state") if isinstance(inner, dict) else None
    buffer = len(ds["token_buffer"]) if isinstance(ds, dict) and "token_buffer" in ds else None
    return len(blob), buffer


def zephon_breakdown(store: TokenStore, seq_len: int, batch: int, seconds: float) -> dict:
    """Microseconds per micro-batch of the Zephon loader's parts, as its prefetch thread
    does them: plan (the ids of ``plan_window`` micro-batches in one call), gather and
    int64 tensors (``window`` micro-batches at once)."""
    zl = zephon_loader(store, seq_len, batch, 0)
    plan_ids = zl.plan_window * batch
    starts = itertools.count(0, plan_ids)
    plan_rate = rate(
        lambda: zl.plan.rank_stream_ids(1, next(starts), plan_ids, 0, 1), 1, seconds / 3
    )
    ids = zl.plan.rank_stream_ids(1, 0, zl.window * batch, 0, 1)
    gather_rate = rate(lambda: store.windows(ids, seq_len), 1, seconds / 3)
    tensor_rate = rate(lambda: zl.batch(ids), 1, seconds / 3)
    zl.close()
    plan_us = 1e6 / plan_rate["per_s"] / zl.plan_window
    batch_us = 1e6 / tensor_rate["per_s"] / zl.window
    gather_us = 1e6 / gather_rate["per_s"] / zl.window
    return {
        "window": zl.window,
        "plan_window": zl.plan_window,
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
        td_it = _forever(td)
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
            stock_state = _stock_rank_state(stock)
        zl.close()
        td_it.close()
        _shutdown(td)
        _shutdown(stock)
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
            s: (lambda st=st: _restore_first_batch(store, seq_len, batch, st))
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
            f"plan = {b['plan_share']:.0%}; planned {b['plan_window']} and made "
            f"{b['window']} micro-batches at a time",
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
