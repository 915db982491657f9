"""The GPU check behind ``scripts/gpu_check.sh``: the full TorchTitan 0.3 check where
this machine's torch is new enough for it, else the engine-level check without
TorchTitan.

Modes (``--mode auto`` picks one and says why):

* ``full`` (torch >= 2.14.1 and TorchTitan 0.3 importable, CUDA present): stock
  TorchTitan 0.3's ``llama3_debugmodel`` on Zephon's data (its dataloader and
  validator replaced by Zephon's) on 1 GPU, nccl, bf16 compute, the default
  FlexAttention with Zephon's document positions (block-causal masks), 30 steps
  at global batch 16 = local batch 8 x 2 gradient-accumulation micro-batches,
  checkpoints every 10 steps; then a resume from step 10 at local batch 16 (no
  accumulation: another split of the same global batch), ``zephon verify``
  (MATCH expected) and ``zephon compare`` (rtol 2e-2: bf16, non-deterministic
  kernels). Step time and data wait from TorchTitan's own metrics. Then
  ``zephon.reproducible`` (issue 46) on NCCL: the same job in fp32 with
  deterministic kernels without and with the setting, the latter resumed from step
  10 too, ``zephon compare`` of the two (the same bits expected), and the setting's
  step time against the fp32 run's.
* ``engine`` (anything older, e.g. torch 2.11 on a machine without network, or
  TorchTitan 0.3 missing): the engine alone, TorchTitan never imported: the Zephon
  loader into pinned memory and onto the GPU (``non_blocking`` copies), a plain
  PyTorch decoder (embedding, causal SDPA blocks, AdamW) stepped under bf16
  autocast, fed by the loader and then by one preallocated batch (synthetic: the
  upper bound). Step time and data wait of both.

``--dry-run`` prints the mode, the reason and what would run; in full mode it also
parses both runs' configs as the trainer will (0.3's tyro spellings), without
training. ``ZEPHON_DEVICE=cpu`` runs the engine check on the CPU (no pinned
memory): the testable part of this script on a machine without a GPU.

Invariant: the engine check imports no ``torchtitan`` module (it stops with an
error if one was imported); every figure printed is measured in this run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MIN_TORCH = (2, 14, 1)
"""The lowest torch TorchTitan 0.3.0 runs on (2.13 fails; requirements-lock.txt pins it)."""
WARMUP = 3
"""Steps left out of every figure (CUDA context, kernel selection, allocator growth)."""


def _version_tuple(version: str) -> tuple[int, ...]:
    """``"2.14.1+cu130"`` -> ``(2, 14, 1)``; ``"2.11.0a0"`` -> ``(2, 11, 0)``."""
    out = []
    for part in version.split("+")[0].split(".")[:3]:
        n = 0
        while n < len(part) and part[n].isdigit():
            n += 1
        out.append(int(part[:n] or 0))
    return tuple(out)


def choose_mode(torch_version: str, titan_version: str | None, cuda: bool) -> tuple[str, str]:
    """(``"full"`` or ``"engine"``, why): the full check needs torch >= 2.14.1, TorchTitan
    0.3 and a CUDA device."""
    need = ".".join(map(str, MIN_TORCH))
    if _version_tuple(torch_version) < MIN_TORCH:
        return "engine", (
            f"torch {torch_version} is older than {need}, the lowest torch TorchTitan 0.3 runs "
            f"on: the full check cannot run here (install torch>={need} and torchtitan==0.3.0, "
            "e.g. scripts/setup_env.sh, for it)"
        )
    if titan_version is None or _version_tuple(titan_version)[:2] != (0, 3):
        found = "not installed" if titan_version is None else f"version {titan_version}"
        return "engine", (
            f"TorchTitan 0.3 is needed for the full check, found {found} "
            "(pip install -c requirements-lock.txt -e . installs it)"
        )
    if not cuda:
        return "engine", "no CUDA device: the full check trains on a GPU"
    return "full", f"torch {torch_version} and TorchTitan {titan_version} on CUDA"


def _titan_version() -> str | None:
    if importlib.util.find_spec("torchtitan") is None:
        return None
    try:
        return importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------- the engine check


def engine_check(opts: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The Zephon loader feeding a plain PyTorch bf16 model step, then one fixed batch."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from torchtitan_zephon.bench.builtin_corpus import builtin_store
    from torchtitan_zephon.job.loader import ZephonLoader
    from torchtitan_zephon.order.layout import BatchSchedule

    device = torch.device("cpu" if os.environ.get("ZEPHON_DEVICE") == "cpu" else "cuda")
    cuda = device.type == "cuda"
    store = builtin_store()
    seq, batch, steps = opts.seq_len, opts.batch, opts.steps
    loader = ZephonLoader(
        store,
        seq_len=seq,
        seed=0,
        schedule=BatchSchedule([(1, batch)]),
        dp_rank=0,
        dp_degree=1,
        local_batch_size=batch,
        num_workers=1,
        pin_memory=cuda,
    )

    class Block(nn.Module):
        def __init__(self, dim: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, n, d = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, -1).unbind(2)
            a = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
            return x + self.mlp(self.norm2(x))

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(store.vocab_size, opts.dim),
        *[Block(opts.dim, opts.heads) for _ in range(opts.layers)],
        nn.LayerNorm(opts.dim),
        nn.Linear(opts.dim, store.vocab_size),
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def train(next_batch: Any) -> dict[str, Any]:
        step_s, wait_s, losses, pinned = [], [], [], []
        for _ in range(WARMUP + steps):
            sync()
            t0 = time.perf_counter()
            inputs, labels = next_batch()  # data wait: as TorchTitan times next(data_iterator)
            t1 = time.perf_counter()
            pinned.append(bool(inputs["input"].is_pinned()) if cuda else False)
            x = inputs["input"].to(device, non_blocking=True)
            y = labels.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync()
            t2 = time.perf_counter()
            step_s.append(t2 - t0)
            wait_s.append(t1 - t0)
            losses.append(float(loss.detach()))
        kept_step, kept_wait = step_s[WARMUP:], wait_s[WARMUP:]
        return {
            "step_s_median": statistics.median(kept_step),
            "steps_per_s": 1.0 / statistics.median(kept_step),
            "data_wait_s_mean": statistics.mean(kept_wait),
            "data_wait_pct": 100.0 * sum(kept_wait) / sum(kept_step),
            "pinned": all(pinned) if cuda else None,
            "first_loss": losses[0],
            "last_loss": losses[-1],
            "measured_steps": len(kept_step),
        }

    it = iter(loader)
    fed = train(lambda: next(it))
    fixed = loader.step_microbatches(1)[0]
    synthetic = train(lambda: fixed)
    loader.close()
    if any(m == "torchtitan" or m.startswith("torchtitan.") for m in sys.modules):
        raise RuntimeError("the engine-level check imported torchtitan; it must run without it")
    return {
        "mode": "engine",
        "device": str(device) if not cuda else torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "dtype": "bfloat16 autocast",
        "seq_len": seq,
        "batch": batch,
        "model": {"dim": opts.dim, "layers": opts.layers, "heads": opts.heads},
        "warmup_steps_excluded": WARMUP,
        "zephon": fed,
        "synthetic": synthetic,
        "zephon_vs_synthetic": fed["steps_per_s"] / synthetic["steps_per_s"],
    }


def print_engine(r: dict[str, Any]) -> None:
    print(
        f"engine check (no TorchTitan) on {r['device']}, torch {r['torch']}, {r['dtype']}, "
        f"seq {r['seq_len']} x batch {r['batch']}, model dim {r['model']['dim']} x "
        f"{r['model']['layers']} layers"
    )
    for name in ("zephon", "synthetic"):
        x = r[name]
        pinned = "" if x["pinned"] is None else f", pinned memory: {'yes' if x['pinned'] else 'NO'}"
        print(
            f"  {name:<9} step time {x['step_s_median'] * 1e3:.2f} ms (median of "
            f"{x['measured_steps']}), data wait {x['data_wait_s_mean'] * 1e3:.3f} ms "
            f"({x['data_wait_pct']:.3f}% of step time){pinned}, loss "
            f"{x['first_loss']:.3f} -> {x['last_loss']:.3f}"
        )
    print(f"  zephon / synthetic steps/s: {r['zephon_vs_synthetic']:.3f}")


# ---------------------------------------------------------------- the full check

COMMON = [
    "--module", "llama3", "--config", "llama3_debugmodel",
    "--training.seq_len", "2048", "--training.local_batch_size", "8",
    "--training.global_batch_size", "16", "--training.steps", "30",
    "--training.mixed_precision_param", "bfloat16",
    "--checkpoint.enable", "--checkpoint.interval", "10",
    "--validator.enable", "--validator.freq", "10", "--validator.steps", "2",
    "--zephon.heldout_samples", "32", "--debug.no-deterministic",
    "--metrics.log_freq", "1", "--metrics.enable_tensorboard",
]  # fmt: skip
RESUMED = ["--training.local_batch_size", "16"]  # the same global batch, no accumulation
FP32 = ["--training.mixed_precision_param", "float32", "--debug.deterministic"]
EXACT = [*FP32, "--zephon.reproducible"]  # issue 46: the same bits, at its cost
RUNS: list[tuple[str, list[str], str | None]] = [
    ("ref", [], None),
    ("resumed", RESUMED, "ref"),  # a resume at another gradient-accumulation split
    ("fp32", FP32, None),  # zephon.reproducible's baseline: fp32, deterministic kernels
    ("exact", EXACT, None),
    ("exact_resumed", EXACT, "exact"),  # resumed from step 10: the same bits expected
]
"""The full check's runs: (name, options, the run whose step-10 checkpoint it resumes)."""


def full_args(dump: Path, extra: list[str]) -> list[str]:
    from torchtitan_zephon.job.settings import builtin_tokenizer

    return [
        *COMMON,
        "--hf_assets_path",
        str(builtin_tokenizer()[0]),
        "--dump_folder",
        str(dump),
        *extra,
    ]


def describe_config(args: list[str]) -> str:
    """What the trainer will run for ``args``, parsed as ``torchtitan_zephon.train`` does."""
    from torchtitan_zephon.train import parse_config

    c = parse_config(args)
    t = c.training
    accumulation = t.global_batch_size // t.local_batch_size
    first = getattr(c.model_spec.model, "first_attention", None)
    inner = getattr(first, "inner_attention", None)
    attention = type(inner).__qualname__ if inner is not None else "?"
    return (
        f"seq_len {t.seq_len}, local batch {t.local_batch_size} x {accumulation} micro-batches "
        f"= global batch {t.global_batch_size}, mixed precision {t.mixed_precision_param}, "
        f"dataloader {type(c.dataloader).__qualname__}, validator "
        f"{type(c.validator).__qualname__}, checkpoint every {c.checkpoint.interval}, "
        f"attention {attention}"
    )


def full_check(out: Path, run: Path) -> int:
    import shutil

    from torchtitan_zephon.run import recorded as runs

    env = dict(os.environ, PYTHONUNBUFFERED="1")

    def train(dump: Path, log: Path, extra: list[str]) -> int:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=1", "-m", "torchtitan_zephon.train", *full_args(dump, extra)]  # fmt: skip
        with open(log, "w") as f:
            rc = subprocess.run(
                cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT
            ).returncode
        print(f"  exit {rc} ({log})")
        return rc

    shutil.rmtree(run, ignore_errors=True)
    for name, extra, source in RUNS:
        t0 = time.perf_counter()
        if source is not None:
            shutil.copytree(run / source, run / name)
            for step in (20, 30):
                shutil.rmtree(run / name / "checkpoint" / f"step-{step}", ignore_errors=True)
        if train(run / name, out / f"{name}.log", extra) != 0:
            return 1
        print(f"  {name}: {time.perf_counter() - t0:.0f} s")
    rc = 0
    checks = (
        ("verify", "ref", "resumed", []),
        ("compare", "ref", "resumed", ["--rtol", "2e-2"]),
        ("compare", "exact", "exact_resumed", []),  # reproducible: tolerance 0
    )
    for cmd, a, b, extra in checks:
        p = subprocess.run(
            [sys.executable, "-m", "torchtitan_zephon", cmd, str(run / a), str(run / b), *extra],
            cwd=REPO, capture_output=True, text=True,
        )  # fmt: skip
        (out / f"{cmd}_{b}.txt").write_text(p.stdout + p.stderr)
        print(f"  zephon {cmd} {a} {b}: exit {p.returncode}: {p.stdout.strip().splitlines()[-1:]}")
        rc |= p.returncode
    figures: dict[str, dict[str, float]] = {}
    for name in ("ref", "fp32", "exact"):
        figures[name] = {}
        for tag in ("time_metrics/end_to_end(s)", "time_metrics/data_loading(%)", "tps",
                    "memory/max_reserved(GiB)"):  # fmt: skip
            v = runs.read_scalars(run / name, tag)
            later = [v[s] for s in sorted(v) if s > WARMUP]
            if later:
                figures[name][tag] = statistics.median(later)
                print(
                    f"  {name} {tag}: median over steps {WARMUP + 1}..30 = {figures[name][tag]:.6g}"
                )
    step = "time_metrics/end_to_end(s)"
    if step in figures["fp32"] and step in figures["exact"]:
        cost = figures["exact"][step] / figures["fp32"][step]
        print(f"  zephon.reproducible: step time x{cost:.2f} of fp32 without it")
    (out / "full_check.json").write_text(json.dumps({"mode": "full", "figures": figures}, indent=1))
    return rc


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["auto", "full", "engine"], default="auto")
    p.add_argument("--dry-run", action="store_true", help="say what would run; train nothing")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_check"))
    p.add_argument("--run", default=os.environ.get("RUN", "/tmp/gpu_run"))
    p.add_argument("--steps", type=int, default=30, help="engine check: measured steps")
    p.add_argument("--seq-len", dest="seq_len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    opts = p.parse_args(argv)
    import torch

    cpu = os.environ.get("ZEPHON_DEVICE") == "cpu"
    cuda = torch.cuda.is_available() and not cpu
    mode, why = choose_mode(torch.__version__, _titan_version(), cuda)
    if opts.mode != "auto":
        if opts.mode == "full" and mode != "full" and not opts.dry_run:
            print(f"gpu_check: --mode full cannot run here: {why}", file=sys.stderr)
            return 2
        mode, why = opts.mode, f"--mode {opts.mode}"
    print(f"gpu_check: mode {mode}: {why}")
    if mode == "engine" and not cuda and not cpu:
        print(
            "gpu_check: no CUDA device; set ZEPHON_DEVICE=cpu to run the engine-level check "
            "on the CPU",
            file=sys.stderr,
        )
        return 2
    out = Path(opts.out)
    if opts.dry_run:
        if mode == "full":
            for name, extra, _ in RUNS:
                args = full_args(Path(opts.run) / name, extra)
                print(
                    f"  {name}: torchrun --nproc_per_node=1 -m torchtitan_zephon.train {' '.join(args)}"
                )
                print(f"    parses as: {describe_config(args)}")
        else:
            print(
                f"  would run: Zephon loader (pinned: {cuda}) -> {'cuda' if cuda else 'cpu'}, "
                f"plain PyTorch bf16 decoder dim {opts.dim} x {opts.layers} layers, seq "
                f"{opts.seq_len} x batch {opts.batch}, {WARMUP} + {opts.steps} steps, then "
                "the same on one preallocated batch"
            )
        return 0
    out.mkdir(parents=True, exist_ok=True)
    if mode == "full":
        return full_check(out, Path(opts.run))
    result = engine_check(opts, out)
    (out / "engine_check.json").write_text(json.dumps(result, indent=1))
    print_engine(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
