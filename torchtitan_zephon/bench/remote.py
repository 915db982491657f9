"""``zephon bench remote``: a store in a bucket against the same store on local disk.

One run, side by side, on loopback: the bench starts moto's S3 server (a process of its
own), uploads a store to it, and puts a ``latency_proxy`` process in front of it per
added latency (0, 20 and 50 ms per request; 0 ms still pays moto's and the proxy's own
time, measured: ``request_ms``). The store is the builtin store's tokens repeated to
``tokens`` tokens (8 MiB: over 100x the bytes of any run measured here; moto reads a
whole object per range GET, so a larger one would measure moto), with block checksums
of 512 tokens (prepare's default) and, for the default job, a copy with blocks of its
seq_len (``zephon inspect --upgrade --block-tokens``: same fingerprint); no node
cache. Measured:

- loader tokens/s, one rank (seq 2048 x 2, a run of ``steps`` steps, the trainer's
  prefetch and read_ahead_steps, last_step = the run's end), local vs the bucket at each
  latency, then at 20 ms: range reads without read-ahead (on demand) and the naive way
  (download every file whole, then read it locally; its download counted in its time);
  interleaved rounds, medians;
- bytes fetched per byte trained (opening and block checksums included), the same runs;
- the default job (``configs.llama3_debug``: seq 128, local batch 4, DP 2, 40 steps)
  on rank 0 at 20 ms, from the store with blocks of its seq_len and from the 512-token
  one (bytes fetched per byte trained for both): data wait as % of step time, each step a real CPU training step of
  its model (forward, backward, clip, AdamW; one rank's micro-batch, no all-reduce, so
  shorter than the 2-rank job's step: the % is an upper bound of the job's), first step
  left out (its wait is the first batch, below);
- packed samples (``zephon.packing = best_fit``), the same stream from local disk and
  from the bucket at 20 ms: tokens/s and bytes fetched per byte trained (each sample's
  pieces read ahead by range, rounded to whole blocks);
- process start to first batch (fresh processes, as ``bench resume``): local vs the
  bucket at 20 ms vs the naive download, resuming the default job at step 10 and at
  step 1,000,000: the first ``next()`` after a late resume waits for its own windows only.

Invariant: every compared figure is measured in this invocation on this machine (the
remote ones through the same server and proxies); the store is the same bytes locally
and in the bucket, and each remote run's batches equal the local run's.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from torchtitan_zephon.bench.bucket import (
    MOTO,
    background_process,
    bucket_env,
    download_store,
    environment,
    free_port,
    make_store,
    rank_loader,
    request_ms,
    upload,
    wait_in_flight,
    with_block_tokens,
)
from torchtitan_zephon.bench.measure import ratio
from torchtitan_zephon.bench.remote_job import (
    LATE_STEP,
    first_batches,
    job_config,
    job_shape,
    model_step,
    train,
)

LATENCIES_MS = (0, 20, 50)
JOB_LATENCY_MS = 20
TARGETS = {"data_wait_pct": 1.0, "fetched_per_trained": 1.1, "first_batch_extra_s": 1.0}
DEFAULTS = {
    "tokens": 1 << 22,
    "seq_len": 2048,
    "batch": 2,
    "steps": 10,
    "rounds": 3,
    "job": "llama3_debug",
    "job_steps": None,  # the job's training.steps
    "repeats": 2,
    "gets": 20,
}
QUICK = {
    "tokens": 1 << 20,
    "seq_len": 512,
    "batch": 2,
    "steps": 5,
    "rounds": 1,
    "job": "llama3_tiny",
    "job_steps": 6,
    "repeats": 1,
    "gets": 3,
}


def stream(
    where: str, o: dict, seed: int, mode: str, tmp: Path, *, packed: bool = False
) -> dict[str, Any]:
    """One rank's run of ``o['steps']`` steps of seq_len x batch from ``where`` (a path or
    a URL): tokens/s from the loader's start to the last batch, bytes fetched (opening
    included). ``mode``: ``read_ahead`` (the trainer's settings, last_step the run's end),
    ``on_demand`` (no read-ahead, no prefetch) or ``download`` (every file downloaded
    whole first, then read locally; the download is in the time). ``packed``: packed
    samples (``zephon.packing = best_fit``; the index built before the clock starts, in
    ``tmp``, and the document offsets it fetches counted)."""
    from torchtitan_zephon.job.data import JobData
    from torchtitan_zephon.job.packing import open_packing
    from torchtitan_zephon.store.reader import TokenStore

    seq_len, batch, steps = o["seq_len"], o["batch"], o["steps"]
    t0 = time.perf_counter()
    fetched = 0
    if mode == "download":
        folder = tmp / f"download-{seed}-{time.monotonic_ns()}"
        fetched = download_store(where, folder)
        where = str(folder)
    store = TokenStore.open(where)
    kw = {"last_step": steps} if mode == "read_ahead" else {"read_ahead_steps": 0, "prefetch": 0}
    if mode == "download":
        kw = {"last_step": steps}
    data: Any = store
    if packed:
        index, _ = open_packing(store, seq_len, cache_dir=str(tmp / "packing"))
        data = JobData.of_store(store, seq_len, packed=index)
    t_open = time.perf_counter()
    loader = rank_loader(data, seq_len, batch, seed=seed, **kw)
    first = [next(loader)[0]["input"][0, :8].clone()]
    for _ in range(steps - 1):
        next(loader)
    t_end = time.perf_counter()
    source = data.sources[0] if packed else None
    in_flight = list(getattr(getattr(source, "_remote", None), "_steps", ()))
    loader.close()
    if not store.mapped:
        wait_in_flight(store)
        for step in in_flight:  # packed pieces read ahead: they count as fetched
            step.future.exception()
        fetched = store.fetched_bytes
        store.close()
    start = t0 if mode == "download" else t_open
    trained = steps * batch * (seq_len + 1) * store.dtype.itemsize
    return {
        "tokens_per_s": steps * batch * seq_len / (t_end - start),
        "fetched": fetched,
        "trained": trained,
        "fetched_per_trained": fetched / trained if fetched else 0.0,
        "first": first[0].tolist(),
    }


# ---------------------------------------------------------------- the suite


def _missing() -> str | None:
    for module in ("moto.server", "obstore", "boto3"):
        try:
            __import__(module)
        except ImportError:
            return module
    return None


def run(opts: dict) -> dict:
    missing = _missing()
    if missing:
        return {
            "suite": "remote",
            "skipped": f"needs moto[server] and obstore ({missing} is not installed): "
            "pip install -e '.[test]'",
        }
    base = QUICK if opts.get("quick") else DEFAULTS
    o = {**base, **{k: v for k, v in opts.items() if v is not None and k in base}}
    config = job_config(o["job"])
    job = job_shape(config)
    job_steps = o["job_steps"] or job["steps"]
    res: dict[str, Any] = {
        "suite": "remote",
        "store_tokens": o["tokens"],
        "seq_len": o["seq_len"],
        "local_batch": o["batch"],
        "steps": o["steps"],
        "rounds": o["rounds"],
        "latencies_ms": list(LATENCIES_MS),
        "job": {**job, "name": o["job"], "measured_steps": job_steps},
        "targets": TARGETS,
        "load_average_at_start": os.getloadavg()[0],
    }
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="zephon-bench-")))
        local = make_store(tmp / "store", o["tokens"])
        store_bytes = sum(p.stat().st_size for p in local.iterdir())
        port = free_port()
        stack.enter_context(background_process([sys.executable, "-c", MOTO, str(port)]))
        moto = f"http://127.0.0.1:{port}"
        url = upload(moto, local, "store")
        # the default job reads a store whose blocks are its seq_len (prepare --block-tokens)
        local_job = with_block_tokens(local, tmp / "store-job", job["seq_len"])
        url_job = upload(moto, local_job, "store-job")
        proxies = {
            ms: stack.enter_context(
                background_process(
                    [sys.executable, "-m", "torchtitan_zephon.bench.latency_proxy", moto, str(ms)]
                )
            )
            for ms in LATENCIES_MS
        }
        envs = {ms: bucket_env(endpoint) for ms, endpoint in proxies.items()}
        res["store_bytes"] = store_bytes
        res["request_ms"] = {}
        for ms in LATENCIES_MS:
            with environment(envs[ms]):
                res["request_ms"][str(ms)] = request_ms(url, o["gets"])

        # 1. one rank's stream: local, the bucket at each latency, then the other ways
        cases = {"local": (str(local), "read_ahead", None)}
        for ms in LATENCIES_MS:
            cases[f"remote_{ms}ms"] = (url, "read_ahead", ms)
        cases[f"on_demand_{JOB_LATENCY_MS}ms"] = (url, "on_demand", JOB_LATENCY_MS)
        cases[f"download_{JOB_LATENCY_MS}ms"] = (url, "download", JOB_LATENCY_MS)
        rounds: dict[str, list[dict[str, Any]]] = {k: [] for k in cases}
        for r in range(o["rounds"]):
            for name, (where, mode, ms) in cases.items():
                with environment(envs[ms] if ms is not None else {}):
                    rounds[name].append(stream(where, o, r + 1, mode, tmp))
        for r in range(o["rounds"]):  # every way read the same batches
            firsts = {name: v[r]["first"] for name, v in rounds.items()}
            if len({json.dumps(f) for f in firsts.values()}) != 1:
                raise RuntimeError(f"remote bench: the ways read different batches: {firsts}")
        res["streams"] = {
            name: {
                "tokens_per_s": statistics.median(x["tokens_per_s"] for x in v),
                "fetched_per_trained": statistics.median(x["fetched_per_trained"] for x in v),
                "trained_bytes": v[0]["trained"],
            }
            for name, v in rounds.items()
        }
        trained = res["streams"]["local"]["trained_bytes"]
        res["store_over_trained"] = store_bytes / trained
        # packed samples (zephon.packing = best_fit): local disk, then the bucket at 20 ms
        packed_cases = {"local": (str(local), None), f"remote_{JOB_LATENCY_MS}ms": (url, 20)}
        packed_rounds: dict[str, list[dict[str, Any]]] = {k: [] for k in packed_cases}
        for r in range(o["rounds"]):
            for name, (where, ms) in packed_cases.items():
                with environment(envs[ms] if ms is not None else {}):
                    packed_rounds[name].append(
                        stream(where, o, r + 1, "read_ahead", tmp, packed=True)
                    )
            if len({json.dumps(v[r]["first"]) for v in packed_rounds.values()}) != 1:
                raise RuntimeError("remote bench: packed samples differ between local and bucket")
        res["packed_streams"] = {
            name: {
                "tokens_per_s": statistics.median(x["tokens_per_s"] for x in v),
                "fetched_per_trained": statistics.median(x["fetched_per_trained"] for x in v),
            }
            for name, v in packed_rounds.items()
        }

        # 2. the default job at 20 ms, local as the reference
        step_fn = model_step(config)
        with environment(envs[JOB_LATENCY_MS]):
            res["job_remote"] = train(url_job, job, job_steps, step_fn)
            res["job_remote_512"] = train(url, job, job_steps, step_fn)
        res["job_local"] = train(str(local), job, job_steps, step_fn)
        res["job_block_tokens"] = job["seq_len"]

        # 3. process start to first batch
        res["first_batch"] = first_batches(str(local), url, envs[JOB_LATENCY_MS], job, o, tmp)
    s, fb = res["streams"], res["first_batch"]
    res["tokens_per_s_vs_local"] = {
        name: ratio(v["tokens_per_s"], s["local"]["tokens_per_s"]) for name, v in s.items()
    }
    res["first_batch_extra_s"] = fb.pop("extra_s")
    res["first_batch_extra_after_imports_s"] = fb.pop("extra_after_imports_s")
    res["late_next_ratio"] = ratio(fb["remote_late"]["next_s"], fb["remote_10"]["next_s"])
    fpt = s[f"remote_{JOB_LATENCY_MS}ms"]["fetched_per_trained"]
    res["meets"] = {
        "data_wait_pct": res["job_remote"]["data_wait_pct"] < TARGETS["data_wait_pct"],
        "fetched_per_trained": fpt <= TARGETS["fetched_per_trained"],
        "first_batch_extra_s": res["first_batch_extra_s"] <= TARGETS["first_batch_extra_s"],
    }
    res["meets_default_job"] = {
        "fetched_per_trained": res["job_remote"]["fetched_per_trained"]
        <= TARGETS["fetched_per_trained"]
    }
    return res


def _ok(met: bool) -> str:
    return "met" if met else "NOT met"


def rows(r: dict) -> list[tuple[str, str, str]]:
    """(measure, value, note) lines of the printed table."""
    if "skipped" in r:
        return [("not run", "-", r["skipped"])]
    s, job, fb, meets = r["streams"], r["job"], r["first_batch"], r["meets"]
    shape = f"seq {r['seq_len']} x {r['local_batch']}, {r['steps']} steps"
    local = s["local"]["tokens_per_s"]
    out = [
        (
            "store (builtin tokens repeated, block checksums)",
            f"{r['store_bytes'] / 2**20:,.1f} MiB",
            f"{r['store_over_trained']:,.0f}x the bytes a stream run trains; no node cache",
        ),
        (f"loader tokens/s, local disk ({shape})", f"{local / 1e6:,.2f} M", "reference"),
    ]
    for ms in r["latencies_ms"]:
        v = s[f"remote_{ms}ms"]
        out.append(
            (
                f"loader tokens/s, bucket +{ms} ms/request (read-ahead)",
                f"{v['tokens_per_s'] / 1e6:,.3f} M",
                f"{ratio(v['tokens_per_s'], local):.4f} of local; one GET takes "
                f"{r['request_ms'][str(ms)]:.1f} ms (moto + proxy + {ms} ms); fetched/trained "
                f"{v['fetched_per_trained']:.3f}",
            )
        )
    ms = JOB_LATENCY_MS
    for name, label in (
        (f"on_demand_{ms}ms", f"bucket +{ms} ms, range reads, no read-ahead"),
        (f"download_{ms}ms", f"naive: bucket +{ms} ms, whole files, no read-ahead"),
    ):
        v = s[name]
        out.append(
            (
                f"loader tokens/s, {label}",
                f"{v['tokens_per_s'] / 1e6:,.3f} M",
                f"{ratio(v['tokens_per_s'], local):.4f} of local; fetched/trained "
                f"{v['fetched_per_trained']:,.1f}",
            )
        )
    ps = r["packed_streams"]
    pr = ps[f"remote_{ms}ms"]
    out.append(
        (
            f"packed samples (best_fit), loader tokens/s: local disk / bucket +{ms} ms "
            "(read-ahead)",
            f"{ps['local']['tokens_per_s'] / 1e6:,.3f} M / {pr['tokens_per_s'] / 1e6:,.3f} M",
            f"{ratio(pr['tokens_per_s'], s[f'remote_{ms}ms']['tokens_per_s']):.2f} of windows "
            f"from the bucket; fetched/trained {pr['fetched_per_trained']:.3f} (windows "
            f"{s[f'remote_{ms}ms']['fetched_per_trained']:.3f}: a piece rounds out to whole "
            "blocks at both ends)",
        )
    )
    fpt = s[f"remote_{ms}ms"]["fetched_per_trained"]
    out.append(
        (
            f"bytes fetched per byte trained, bucket +{ms} ms ({shape})",
            f"{fpt:.3f}",
            f"target <= {TARGETS['fetched_per_trained']}: {_ok(meets['fetched_per_trained'])} "
            f"(naive {s[f'download_{ms}ms']['fetched_per_trained']:,.1f})",
        )
    )
    jr, jl, j512 = r["job_remote"], r["job_local"], r["job_remote_512"]
    bt = r["job_block_tokens"]
    out += [
        (
            f"default job ({job['name']}: seq {job['seq_len']} x {job['batch']}, DP {job['dp']}, "
            f"rank 0, {job['measured_steps']} steps), data wait % of step, +{ms} ms, store "
            f"with {bt}-token blocks (= its seq_len)",
            f"{jr['data_wait_pct']:.3f} %",
            f"target < {TARGETS['data_wait_pct']} %: {_ok(meets['data_wait_pct'])}; local disk "
            f"{jl['data_wait_pct']:.3f} %; step {jr['step_s_median'] * 1e3:.0f} ms (measured CPU "
            "step of its model, one rank, no all-reduce), first step left out",
        ),
        (
            f"default job, bytes fetched per byte trained, store with {bt}-token blocks "
            f"(prepare --block-tokens {bt} = its seq_len), +{ms} ms",
            f"{jr['fetched_per_trained']:.3f}",
            f"target <= {TARGETS['fetched_per_trained']}: "
            f"{_ok(r['meets_default_job']['fetched_per_trained'])}; each {job['seq_len'] + 1}-"
            f"token window is its own blocks; first step's wait "
            f"{jr['first_step_wait_s'] * 1e3:.0f} ms",
        ),
        (
            f"default job, bytes fetched per byte trained, store with 512-token blocks "
            f"(prepare's default), +{ms} ms",
            f"{j512['fetched_per_trained']:.3f}",
            f"what the default block size costs this job: each {job['seq_len'] + 1}-token window "
            f"fetches a whole 512-token block; data wait {j512['data_wait_pct']:.3f} %",
        ),
    ]
    for name, label in (
        ("local_10", "local disk, resume at step 10"),
        ("remote_10", f"bucket +{ms} ms, resume at step 10"),
        ("local_late", f"local disk, resume at step {LATE_STEP:,}"),
        ("remote_late", f"bucket +{ms} ms, resume at step {LATE_STEP:,}"),
        ("download_10", f"naive download, bucket +{ms} ms, step 10"),
    ):
        p = fb[name]
        out.append(
            (
                f"process start -> first batch, {label}",
                f"{p['to_first_batch_s'] * 1e3:,.0f} ms",
                f"imports {p['imports_s'] * 1e3:.0f} ms, open {p['open_s'] * 1e3:.0f} ms, "
                f"build+load {p['build_and_load_s'] * 1e3:.0f} ms, next {p['next_s'] * 1e3:.0f} "
                f"ms ({p['requests_by_first']:.0f} requests by then)",
            )
        )
    out += [
        (
            f"first batch, bucket +{ms} ms minus local (median of back-to-back pairs)",
            f"{r['first_batch_extra_s'] * 1e3:,.0f} ms",
            f"target <= {TARGETS['first_batch_extra_s']:g} s: "
            f"{_ok(meets['first_batch_extra_s'])}; after the imports (open, load, first "
            f"next): {r['first_batch_extra_after_imports_s'] * 1e3:,.0f} ms",
        ),
        (
            f"first next() after resume, step {LATE_STEP:,} / step 10, bucket",
            f"{r['late_next_ratio']:.2f}",
            "the first step waits for its own windows only (O(1) in the step)",
        ),
    ]
    return out
