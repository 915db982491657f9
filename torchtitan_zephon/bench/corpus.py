"""``zephon bench corpus``: what one rank pays to read a corpus of 10^10 documents and
10^13 tokens from a bucket, against a real store of 10^6 documents, side by side.

Role: the virtual corpus (``bench.virtual_corpus``: every byte computed, nothing
stored; 10,000,007,168 documents, about 10^13 uint32 tokens in 1 GiB shards, block
checksums, the packing index kept with it) and a real store of the same documents'
first 16 periods (1,048,576 documents, about 10^9 tokens), written to local disk, are
served by one loopback S3 API (``bench.object_server``). For each, with and without
packing (``best_fit`` at the run's seq_len), one rank is simulated at DP 8, 2,048 and
16,384 (the last rank of the DP group, reading its own slice; ``bench.corpus_rank``,
a process of its own): the time from opening the store to its first micro-batch, its
resident memory above what its imports hold (at the first batch and at the end: a peak
would be the bench's own, which a child inherits across exec), the local disk it
writes (its cache folder), then, from the second step on (each step then reads as far
ahead as the one before), the bytes fetched per byte of the samples delivered and the
requests (GETs) per step, by where they go (S3 serves about 5,500 GETs per second per
key prefix: the rate 2,048 ranks at one step a second send to each prefix is printed against it).

Honest limits: the server runs on this machine, so a request costs loopback time, not a
network's (``zephon bench remote`` measures added latency); the virtual corpus's
whole-file hashes are not computed (``virtual_corpus.NOT_COMPUTED``: only ``inspect
--check`` reads them); one rank is measured per degree, its peers simulated by the plan
(their requests are the same kind and count by construction: the order is a uniform
shuffle).

Registering existing token files: the real store's documents written as an OLMo numpy
token file (uint16, the builtin tokenizer's ids), registered (``zephon prepare FILE
--input-format numpy``: read in place) and its packing index built beside it: seconds
(and per TB of tokens read) and the bytes written as a fraction of the token bytes.

Invariant: both corpora are measured in the same run, by the same code, through the
same server; every ratio is computed from that run's figures.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_zephon.bench.bucket import bucket_env
from torchtitan_zephon.bench.object_server import Folder, ObjectServer
from torchtitan_zephon.bench.virtual_corpus import EOS_ID, LARGE, VirtualCorpus

DEFAULTS = {"seq_len": 4096, "batch": 1, "steps": 16, "real_chunks": 16, "mean_tokens": 1000}
QUICK = {"seq_len": 512, "batch": 1, "steps": 3, "real_chunks": 4, "mean_tokens": 40}
DEGREES = (8, 2048, 16384)
PREFIX_GETS_PER_S = 5500
"""S3's request rate per key prefix (GET/HEAD), as AWS documents it."""
GOALS = {"first_batch_ratio": 1.5, "rss_mb": 256, "disk_bytes": 1 << 30, "fetch_ratio": 1.1}


def materialize(corpus: VirtualCorpus, folder: Path) -> Path:
    """Write every file of ``corpus`` into ``folder``: a store on local disk."""
    for name in corpus.names():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        size = corpus.size(name) or 0
        with open(path, "wb") as f:
            for a in range(0, size, 1 << 26):
                f.write(corpus.read(name, a, min(size, a + (1 << 26))))
    return folder


def token_file(corpus: VirtualCorpus, path: Path, eos_id: int, vocab_size: int) -> int:
    """``corpus``'s documents as an OLMo numpy token file (raw uint16, each document
    ended by ``eos_id``) for a tokenizer of ``vocab_size`` ids; its bytes."""
    with open(path, "wb") as f:
        for a in range(0, corpus.num_tokens, 1 << 24):
            t = corpus.tokens(a, a + (1 << 24)).astype(np.int64)
            ids = t % (vocab_size - 2) + 2  # never eos_id (1 in the builtin tokenizer)
            ids[t == EOS_ID] = eos_id
            f.write(ids.astype("<u2").tobytes())
    return path.stat().st_size


def registration(corpus: VirtualCorpus, seq_len: int, tmp: Path) -> dict[str, Any]:
    """``zephon prepare FILE --input-format numpy`` (``ingest.token_files``) of
    ``corpus``'s documents, then the packing index at ``seq_len`` kept beside the store,
    as ``--pack-seq-len`` builds it: seconds and bytes written for each."""
    from torchtitan_zephon.ingest.builtin import TOKENIZER_DIR
    from torchtitan_zephon.ingest.token_files import register_store
    from torchtitan_zephon.ingest.tokenizer import load_tokenizer_info
    from torchtitan_zephon.job.packing import build_beside

    info = load_tokenizer_info(str(TOKENIZER_DIR))
    source = tmp / "tokens.u16"
    token_bytes = token_file(corpus, source, info.eos_id, info.vocab_size)
    out = tmp / "registered"
    t0 = time.perf_counter()
    store = register_store([str(source)], "numpy", str(TOKENIZER_DIR), str(out))
    register_s = time.perf_counter() - t0
    written = folder_bytes(out)
    t0 = time.perf_counter()
    build_beside(store, seq_len)
    pack_s = time.perf_counter() - t0
    return {
        "token_bytes": token_bytes,
        "documents": store.num_documents,
        "register_s": register_s,
        "register_written": written,
        "pack_s": pack_s,
        "pack_written": folder_bytes(out) - written,
        "tokens_in_place": not any(p.stat().st_size >= token_bytes for p in out.rglob("*")),
    }


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def measure_rank(
    server: ObjectServer, prefix: str, o: dict[str, Any], dp: int, packing: bool, tmp: Path
) -> dict[str, Any]:
    """One simulated rank (``bench.corpus_rank``) of the store under ``prefix``."""
    cache = Path(tempfile.mkdtemp(dir=tmp, prefix="cache-"))
    env = {**os.environ, **bucket_env(server.endpoint), "ZEPHON_CACHE": str(cache),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    argv = [sys.executable, "-m", "torchtitan_zephon.bench.corpus_rank", server.url(prefix),
            str(o["seq_len"]), str(o["batch"]), str(dp), str(int(packing)), str(o["steps"])]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    lines = []
    try:
        for k in range(3):  # "first", "steady", "steps"
            if k:
                server.reset()  # after "steady": the requests of the steps measured
                proc.stdin.write("\n")
                proc.stdin.flush()
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"bench corpus: the rank failed: {proc.stderr.read()[-3000:]}")
            lines.append(json.loads(line))
        gets = {where: n for (method, where), n in server.counts.items() if method == "GET"}
    finally:
        proc.stdin.close()
        proc.wait(timeout=120)
    first, _, steps = lines
    n = o["steps"]
    return {
        "store": prefix,
        "dp": dp,
        "packing": packing,
        "first_batch_s": first["first_batch_s"],
        "rss_above_imports_mb": max(first["rss_mb"], steps["rss_mb"]) - first["base_rss_mb"],
        "disk_bytes": folder_bytes(cache),
        "opened_bytes": first["opened_bytes"],
        "opened_requests": first["opened_requests"],
        "fetch_ratio": steps["fetched_bytes"] / (n * steps["step_bytes"]),
        "gets_per_step": steps["requests"] / n,
        "gets_per_step_by_prefix": {
            where.partition("/")[2]: k / n for where, k in sorted(gets.items())
        },
        "steps_read_ahead": steps["steps_read"],
    }


def run(opts: dict) -> dict:
    o = dict(QUICK if opts.get("quick") else DEFAULTS)
    for k in ("seq_len", "batch", "steps"):
        if opts.get(k):
            o[k] = int(opts[k])
    seq_len = o["seq_len"]
    virtual = VirtualCorpus(LARGE, mean_tokens=o["mean_tokens"], pack_seq_lens=(seq_len,))
    small = VirtualCorpus(
        o["real_chunks"], mean_tokens=o["mean_tokens"], pack_seq_lens=(seq_len,), computed=True
    )
    tmp = Path(tempfile.mkdtemp(prefix="zephon-bench-corpus-"))
    try:
        t0 = time.perf_counter()
        real = materialize(small, tmp / "real")
        written_s = time.perf_counter() - t0
        virtual.names()  # the server's own set-up (one period packed), before any timing
        server = ObjectServer({"real": Folder(real), "virtual": virtual})
        try:
            cases = [
                measure_rank(server, prefix, o, dp, packing, tmp)
                for packing in (False, True)
                for dp in DEGREES
                for prefix in ("real", "virtual")
            ]
        finally:
            server.close()
        real_bytes = folder_bytes(real)
        registered = registration(small, seq_len, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    corpora = {
        "real": {
            "documents": small.num_documents,
            "tokens": small.num_tokens,
            "shards": len(small.counts),
            "bytes_on_disk": real_bytes,
            "written_s": written_s,
        },  # fmt: skip
        "virtual": {
            "documents": virtual.num_documents,
            "tokens": virtual.num_tokens,
            "shards": len(virtual.counts),
        },  # fmt: skip
    }
    return {"options": o, "corpora": corpora, "cases": cases, "goals": GOALS,
            "prefix_gets_per_s": PREFIX_GETS_PER_S, "registration": registered}  # fmt: skip


def _pair(r: dict, packing: bool, dp: int) -> tuple[dict, dict]:
    real, virtual = (
        next(c for c in r["cases"] if (c["store"], c["packing"], c["dp"]) == (s, packing, dp))
        for s in ("real", "virtual")
    )
    return real, virtual


def rows(r: dict) -> list[tuple[str, str, str]]:
    o, c, g = r["options"], r["corpora"], r["goals"]
    out = [
        ("corpus (one loopback S3 API)", "documents / tokens / shards", ""),
        ("  real store, on local disk", f"{c['real']['documents']:,} / {c['real']['tokens']:.3g} "
         f"/ {c['real']['shards']}", f"{c['real']['bytes_on_disk'] / 2**30:.2f} GiB, "
         f"written in {c['real']['written_s']:.0f} s"),
        ("  virtual, computed per request", f"{c['virtual']['documents']:,} / "
         f"{c['virtual']['tokens']:.3g} / {c['virtual']['shards']}", "nothing stored"),
        (f"one rank (the last), seq_len {o['seq_len']}, local batch {o['batch']}, "
         f"{o['steps']} steps", "real | virtual", "virtual / real, goal"),
    ]  # fmt: skip
    for packing in (False, True):
        kind = "packed (best_fit, index kept with the store)" if packing else "windows"
        for dp in DEGREES:
            real, virt = _pair(r, packing, dp)
            ratio = virt["first_batch_s"] / real["first_batch_s"]
            extra = virt["rss_above_imports_mb"] - real["rss_above_imports_mb"]
            out += [
                (f"{kind}, DP {dp:,}: first batch", f"{real['first_batch_s']:.2f} s | "
                 f"{virt['first_batch_s']:.2f} s", f"x{ratio:.2f}, goal <= x{g['first_batch_ratio']}"),
                ("  resident memory above imports", f"{real['rss_above_imports_mb']:.0f} MB | "
                 f"{virt['rss_above_imports_mb']:.0f} MB", f"{extra:+.0f} MB, goal <= +{g['rss_mb']} MB"),
                ("  local disk written", f"{real['disk_bytes']:,} B | {virt['disk_bytes']:,} B",
                 "goal <= 1 GiB"),
                ("  opening: bytes / requests", f"{real['opened_bytes']:,} / {real['opened_requests']} | "
                 f"{virt['opened_bytes']:,} / {virt['opened_requests']}", "manifest, shards.json, "
                 "blocks.json, first batch"),
                ("  bytes fetched / bytes delivered", f"{real['fetch_ratio']:.3f} | "
                 f"{virt['fetch_ratio']:.3f}", f"goal <= {g['fetch_ratio']}"),
                ("  GETs per step", f"{real['gets_per_step']:.1f} | {virt['gets_per_step']:.1f}", ""),
            ]  # fmt: skip
        _, virt = _pair(r, packing, 2048)
        rates = ", ".join(
            f"{where or '?'} {n * 2048:,.0f}/s"
            for where, n in virt["gets_per_step_by_prefix"].items()
        )
        worst = max(virt["gets_per_step_by_prefix"].values(), default=0.0) * 2048
        out.append(
            ("  GETs per prefix, 2,048 ranks at 1 step/s", rates,
             f"S3 serves ~{r['prefix_gets_per_s']:,}/s per prefix: "
             + ("within" if worst <= r["prefix_gets_per_s"] else "OVER"))
        )  # fmt: skip
    g = r["registration"]
    tb = g["token_bytes"] / 1e12
    out += [
        (f"registering the real store's documents as a numpy token file ({g['token_bytes'] / 2**30:.2f} GiB, "
         "uint16)", "seconds | bytes written / token bytes", "goal < 1 %"),
        ("  zephon prepare FILE --input-format numpy", f"{g['register_s']:.1f} s ({g['register_s'] / tb:,.0f} s/TB) "
         f"| {g['register_written'] / g['token_bytes']:.3%}", "the tokens read in place: "
         + ("none copied" if g["tokens_in_place"] else "COPIED")),
        (f"  + the packing index at seq_len {o['seq_len']}", f"{g['pack_s']:.1f} s ({g['pack_s'] / tb:,.0f} s/TB) | "
         f"{g['pack_written'] / g['token_bytes']:.3%}", f"together {(g['register_written'] + g['pack_written']) / g['token_bytes']:.3%}"),
    ]  # fmt: skip
    return out
