"""The default job's side of ``zephon bench remote``: real CPU training steps of the
job's model fed from the bucket or local disk (data wait as % of step time), and the
time from process start to the first batch of a resumed job (fresh processes).

Invariant: each figure is measured in this invocation, local and remote runs on the
same bytes; the child process of a first-batch run imports only what a job would.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from torchtitan_zephon.bench.bucket import rank_loader, wait_in_flight
from torchtitan_zephon.bench.measure import child_times

LATE_STEP = 1_000_000
"""The late resume step the first-batch runs resume at (besides step 10)."""


# ---------------------------------------------------------------- the default job


def job_config(name: str) -> Any:
    """The registry job ``name``'s config (TorchTitan's warnings about its checkpoint
    options, irrelevant here, silenced)."""
    import logging

    from torchtitan_zephon.configs import config_registry as configs

    logging.disable(logging.WARNING)
    try:
        return getattr(configs, name)()
    finally:
        logging.disable(logging.NOTSET)


def job_shape(config: Any) -> dict[str, int]:
    from torchtitan_zephon.titan.settings.zephon_section import Zephon

    t = config.training
    return {
        "seq_len": t.seq_len,
        "batch": t.local_batch_size,
        "gbs": t.global_batch_size,
        "dp": t.global_batch_size // t.local_batch_size,
        "steps": t.steps,
        "prefetch": Zephon().prefetch,
    }


def model_step(config: Any) -> Any:
    """A CPU training step of the job's model on one micro-batch (the job's optimizer
    kind and clipping; attention as the trainer runs it on CPU: DocumentSDPA)."""
    import torch

    from torchtitan_zephon.titan.components.attention import document_mask, document_positions
    from torchtitan_zephon.titan.platform import cpu_config_defaults

    cpu_config_defaults(config)
    torch.manual_seed(0)
    model = config.model_spec.model.build()
    with torch.no_grad():
        model.init_states()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-8)

    def step(inputs: torch.Tensor, labels: torch.Tensor) -> None:
        positions = document_positions(inputs, 0)
        out = model(inputs, positions=positions, attention_masks=document_mask(positions))
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    return step


def train(where: str, job: dict[str, int], steps: int, step_fn: Any) -> dict[str, Any]:
    """Rank 0 of the default job for ``steps`` steps from ``where``: per step, the wait
    for its micro-batches, then a training step on each."""
    from torchtitan_zephon.store.reader import TokenStore

    store = TokenStore.open(where)
    loader = rank_loader(
        store,
        job["seq_len"],
        job["batch"],
        dp_degree=job["dp"],
        gbs=job["gbs"],
        prefetch=job["prefetch"],
        last_step=steps,
    )
    per_step = job["gbs"] // (job["dp"] * job["batch"])
    waits, totals = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        wait = 0.0
        for _ in range(per_step):
            a = time.perf_counter()
            inputs, labels = next(loader)
            wait += time.perf_counter() - a
            step_fn(inputs["input"], labels)
        waits.append(wait)
        totals.append(time.perf_counter() - t0)
    loader.close()
    fetched = 0
    if not store.mapped:
        wait_in_flight(store)
        fetched = store.fetched_bytes
        store.close()
    trained = steps * per_step * job["batch"] * (job["seq_len"] + 1) * store.dtype.itemsize
    return {
        "data_wait_pct": 100 * sum(waits[1:]) / sum(totals[1:]),
        "first_step_wait_s": waits[0],
        "step_s_median": statistics.median(totals[1:]),
        "max_wait_s": max(waits[1:]),
        "fetched_per_trained": fetched / trained if fetched else 0.0,
        "steps": steps,
    }


# ---------------------------------------------------------------- first batch


CHILD = r"""
import json, sys, time
from pathlib import Path
from torchtitan_zephon.bench.bucket import download_store, rank_loader
from torchtitan_zephon.job.loader import ZephonLoader
from torchtitan_zephon.order.state import DataState
from torchtitan_zephon.store.reader import TokenStore
import obstore
a = json.loads(sys.argv[1])
t_import = time.time()
where, fetched = a["where"], 0
if a["mode"] == "download":
    fetched = download_store(where, Path(a["folder"]))
    where = a["folder"]
store = TokenStore.open(where)
t_open = time.time()
loader = rank_loader(store, a["seq_len"], a["batch"], dp_degree=a["dp"], gbs=a["gbs"],
                 prefetch=a["prefetch"])
loader.load_state_dict(DataState.from_json(a["record"]))
t_load = time.time()
inputs, labels = next(loader)
t_first = time.time()
requests = getattr(store, "requests", 0)
loader.close()
print(json.dumps({"import": t_import, "open": t_open, "load": t_load, "first": t_first,
                  "requests_by_first": requests, "next_step": loader.next_step}))
"""


def _child(args: dict[str, Any], env: dict[str, str]) -> dict[str, float]:
    t0, t = child_times([sys.executable, "-c", CHILD, json.dumps(args)], "remote bench", env)
    return {
        "to_first_batch_s": t["first"] - t0,
        "imports_s": t["import"] - t0,
        "open_s": t["open"] - t["import"],
        "build_and_load_s": t["load"] - t["open"],
        "next_s": t["first"] - t["load"],
        "requests_by_first": t["requests_by_first"],
    }


def first_batches(
    local: str, url: str, env20: dict[str, str], job: dict[str, int], o: dict, tmp: Path
) -> dict[str, Any]:
    """Process start to first batch, resuming the default job (rank 0) at step 10 and
    at LATE_STEP: local, the bucket at 20 ms, the naive download (step 10)."""
    from torchtitan_zephon.bench.contenders import state_at
    from torchtitan_zephon.store.reader import TokenStore

    store = TokenStore.open(local)
    probe = rank_loader(store, job["seq_len"], job["batch"], dp_degree=job["dp"], gbs=job["gbs"])
    records = {
        s: state_at(probe, s).with_tracker({"step": s - 1, "chain": "0" * 64}).to_json()
        for s in (10, LATE_STEP)
    }
    probe.close()
    cases = {
        "local_10": (local, 10, "range", {}),
        "remote_10": (url, 10, "range", env20),
        "local_late": (local, LATE_STEP, "range", {}),
        "remote_late": (url, LATE_STEP, "range", env20),
        "download_10": (url, 10, "download", env20),
    }
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in cases}
    for r in range(o["repeats"]):
        for name, (where, step, mode, env) in cases.items():
            args = {
                "where": where,
                "mode": mode,
                "folder": str(tmp / f"child-{name}-{r}"),
                "record": records[step],
                "seq_len": job["seq_len"],
                "batch": job["batch"],
                "dp": job["dp"],
                "gbs": job["gbs"],
                "prefetch": job["prefetch"],
            }
            runs[name].append(_child(args, env))
    out: dict[str, Any] = {
        name: {k: statistics.median(x[k] for x in v) for k in v[0]} for name, v in runs.items()
    }
    # remote minus local, pair by pair (each pair ran back to back), whole and after imports
    pairs = list(zip(runs["remote_10"], runs["local_10"], strict=True))
    out["extra_s"] = statistics.median(
        a["to_first_batch_s"] - b["to_first_batch_s"] for a, b in pairs
    )
    out["extra_after_imports_s"] = statistics.median(
        (a["to_first_batch_s"] - a["imports_s"]) - (b["to_first_batch_s"] - b["imports_s"])
        for a, b in pairs
    )
    return out
