"""``zephon bench prepare``: tokenization throughput of ``zephon prepare`` vs workers.

Prepares the builtin corpus (as one JSONL file) into a fresh store with 1 and
with 2 worker processes, reports tokens/s of each and their ratio, and checks
that the two stores are byte-identical (manifest, tokens, document offsets).

Invariant: both stores are built from the same file in the same process
environment; only ``workers`` differs.
"""

from __future__ import annotations

import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

from torchtitan_zephon.bench.corpus import TOKENIZER_DIR, write_jsonl
from torchtitan_zephon.bench.measure import ratio
from torchtitan_zephon.data.prepare import prepare_store
from torchtitan_zephon.data.store import DOC_OFFSETS, MANIFEST, TOKENS

WORKERS = (1, 2)
DEFAULTS: dict[str, Any] = {"max_docs": None, "repeat": 2}
QUICK: dict[str, Any] = {"max_docs": 20, "repeat": 1}


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (the prepare workers)."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _prepare_pair(tmp: Path, jsonl: Path) -> dict[str, Any]:
    """Prepare ``jsonl`` with each worker count; tokens/s, CPU time, identity of the outputs."""
    res: dict[str, Any] = {"input_bytes": jsonl.stat().st_size}
    stores = {}
    for w in WORKERS:
        out = tmp / f"{jsonl.stem}-w{w}"
        cpu0, t0 = _cpu_seconds(), time.perf_counter()
        store = prepare_store([str(jsonl)], str(TOKENIZER_DIR), str(out), workers=w, progress=False)
        elapsed = time.perf_counter() - t0
        res[f"cpu_s_workers{w}"] = _cpu_seconds() - cpu0
        res[f"tokens_per_s_workers{w}"] = store.num_tokens / elapsed
        res[f"seconds_workers{w}"] = elapsed
        res["tokens"] = store.num_tokens
        res["documents"] = store.num_documents
        stores[w] = out
    a, b = (stores[w] for w in WORKERS)
    names = (MANIFEST, TOKENS, DOC_OFFSETS)
    res["identical"] = all((a / n).read_bytes() == (b / n).read_bytes() for n in names)
    res["speedup"] = ratio(res["tokens_per_s_workers2"], res["tokens_per_s_workers1"])
    return res


def run(opts: dict) -> dict:
    o = QUICK if opts.get("quick") else DEFAULTS
    res: dict[str, Any] = {
        "suite": "prepare",
        "workers": list(WORKERS),
        "load_average_at_start": os.getloadavg()[0],
    }
    with tempfile.TemporaryDirectory(prefix="zephon-bench-") as tmp:
        once = _prepare_pair(Path(tmp), write_jsonl(Path(tmp), max_docs=o["max_docs"]))
        res.update(once)
        if o["repeat"] > 1:
            # The corpus is only ~5 MB (5 chunks): worker start-up weighs on the ratio.
            # Repeated, it shows the steady-state scaling of the same text.
            jsonl = write_jsonl(Path(tmp), max_docs=o["max_docs"], repeat=o["repeat"])
            res["repeated"] = {"repeat": o["repeat"], **_prepare_pair(Path(tmp), jsonl)}
    return res


def _rows(label: str, r: dict) -> list[tuple[str, str, str]]:
    out = [
        (
            f"prepare {label}, {w} worker{'s' if w > 1 else ''}",
            f"{r[f'tokens_per_s_workers{w}']:,.0f} tokens/s",
            f"{r[f'seconds_workers{w}']:.2f} s wall, {r[f'cpu_s_workers{w}']:.2f} s CPU",
        )
        for w in WORKERS
    ]
    out.append(
        (
            f"speedup 2 / 1 workers, {label}",
            f"{r['speedup']:.2f}x",
            f"{r['tokens']:,} tokens, {r['documents']} documents",
        )
    )
    out.append(
        (
            "stores byte-identical",
            "yes" if r["identical"] else "NO",
            "manifest, tokens, doc offsets",
        )
    )
    return out


def rows(r: dict) -> list[tuple[str, str, str]]:
    out = _rows("corpus", r)
    if "repeated" in r:
        out += _rows(f"corpus x{r['repeated']['repeat']}", r["repeated"])
    return out
