"""``zephon bench step``: training steps/s and data wait, Zephon vs an in-memory tensor;
and the cost of ``zephon.reproducible``.

Runs the debug job (``--module torchtitan_zephon.configs --config llama3_debug``:
the small Llama 3 on the builtin store, ``train_configs/debug_model.toml``'s twin)
on TorchTitan 0.3's trainer (``ZephonTrainer``) under ``torchrun`` on CPU ranks,
checkpointing and validation off, once per Zephon audit level (off / ids /
tokens) and once fed by the synthetic loader of ``bench.train_synthetic`` (the
same job, one preallocated batch: the upper bound). Step time and data wait come
from TorchTitan's own metrics (``time_metrics/end_to_end(s)`` and
``time_metrics/data_loading(%)`` in the run's TensorBoard events).

The reproducible column: the same job at audit ``ids`` with and without
``--zephon.reproducible``, at each rank count of ``reproducible`` (1 and 2 by
default), side by side: steps/s, rank 0's peak resident memory (TorchTitan's
``memory/max_reserved(GiB)``, which is the rank's ``ru_maxrss`` on CPU:
``titan.platform``) and the gradient bytes each rank puts into reductions per step,
computed from the model's parameter count as TorchTitan logs it: FSDP reduce-scatters
every micro-batch's float32 gradient (4 bytes a parameter); the setting sends three
int64 limbs instead (24 bytes), plus the exact loss and norm (7 int64). One rank
reduces nothing either way.

Invariant: the runs differ only in the dataloader (and the audit level, or the
setting); the first ``WARMUP`` steps, which include compilation of kernels and
allocator growth, are left out of every figure.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from torchtitan_zephon.bench.measure import ratio

REPO = Path(__file__).resolve().parents[2]
REGISTRY = "torchtitan_zephon.configs"
SYNTHETIC = "torchtitan_zephon.bench.train_synthetic"  # the same config functions, fixed batch
LEVELS = ("off", "ids", "tokens")
WARMUP = 2
TARGET_DATA_WAIT_PCT = 1.0
DATA_PCT = "time_metrics/data_loading(%)"
DATA_S = "time_metrics/data_loading(s)"
STEP_S = "time_metrics/end_to_end(s)"
PEAK_GIB = "memory/max_reserved(GiB)"  # rank 0's peak resident set on CPU (titan.platform)
PARAMETERS = re.compile(r"size:\s*([\d,]+) total parameters")
FLOAT32_BYTES, LIMB_BYTES, SCALARS_BYTES = 4, 24, 7 * 8  # a gradient value; its limbs; loss+norm
_KILLED = "death signal"  # torchrun's message when it is sent SIGTERM / SIGINT

DEFAULTS = {
    "steps": 20,
    "nproc": 2,
    "levels": ",".join(LEVELS),
    "rounds": 2,
    "config": "llama3_debug",
    "reproducible": "1,2",
}
QUICK = {
    "steps": 4,
    "nproc": 1,
    "levels": "ids",
    "config": "llama3_tiny",
    "concurrent": True,
    "rounds": 1,
    "reproducible": "1",
}


def train_command(
    run: Path, registry: str, config: str, nproc: int, steps: int, extra: list[str]
) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}",
        "-m", "torchtitan_zephon.train",
        "--module", registry,
        "--config", config,
        "--dump_folder", str(run),
        "--training.steps", str(steps),
        "--checkpoint.no-enable",
        "--validator.no-enable",
        "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard",
        *extra,
    ]  # fmt: skip


class TrainJob:
    """One benchmark training job in a subprocess; ``result()`` waits and reads its metrics."""

    def __init__(
        self, run: Path, registry: str, config: str, nproc: int, steps: int, extra: list[str]
    ) -> None:
        self.run = run
        self.command = train_command(run, registry, config, nproc, steps, extra)
        self.retried = False
        self._start()

    def _start(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", ZEPHON_DEVICE="cpu", PYTHONUNBUFFERED="1")
        if self.run.exists():
            shutil.rmtree(self.run)
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.command,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def result(self) -> dict:
        from torchtitan_zephon.run.recorded import read_scalars

        output, _ = self.proc.communicate()
        wall = time.perf_counter() - self.t0
        if self.proc.returncode != 0 and _KILLED in output and not self.retried:
            # Another process on a shared machine signalled our launcher: run it again once.
            self.retried = True
            self._start()
            return self.result()
        if self.proc.returncode != 0:
            raise RuntimeError(
                f"benchmark training run in {self.run} failed ({self.proc.returncode}):\n"
                f"{output[-4000:]}"
            )
        step_s = read_scalars(self.run, STEP_S)
        data_pct = read_scalars(self.run, DATA_PCT)
        data_s = read_scalars(self.run, DATA_S)
        peak = read_scalars(self.run, PEAK_GIB)
        size = PARAMETERS.search(re.sub(r"\x1b\[[0-9;]*m", "", output))
        kept = [s for s in sorted(step_s) if s > WARMUP] or sorted(step_s)
        step_time = statistics.median(step_s[s] for s in kept)
        return {
            "peak_rss_gib": max(peak.values()) if peak else None,
            "parameters": int(size.group(1).replace(",", "")) if size else None,
            "steps_per_s": 1.0 / step_time,
            "step_s_median": step_time,
            "data_wait_pct": statistics.mean(data_pct[s] for s in kept),
            "data_wait_pct_max": max(data_pct[s] for s in kept),
            "data_wait_s_mean": statistics.mean(data_s[s] for s in kept),
            "measured_steps": len(kept),
            "wall_s": wall,
        }


def run(opts: dict) -> dict:
    base = QUICK if opts.get("quick") else DEFAULTS
    o = {**base, **{k: v for k, v in opts.items() if v is not None and k in base}}
    levels = [x.strip() for x in str(o["levels"]).split(",") if x.strip()]
    bad = [x for x in levels if x not in LEVELS]
    if bad:
        raise ValueError(f"unknown audit levels {bad}; expected some of {list(LEVELS)}.")
    steps, nproc, extra = int(o["steps"]), int(o["nproc"]), list(o.get("overrides", []))
    if steps <= WARMUP:
        raise ValueError(f"--steps must exceed the {WARMUP} warm-up steps, got {steps}.")
    res: dict[str, Any] = {
        "suite": "step",
        "config": f"--module {REGISTRY} --config {o['config']}",
        "nproc": nproc,
        "steps": steps,
        "warmup_steps_excluded": WARMUP,
        "overrides": extra,
        "target_data_wait_pct": TARGET_DATA_WAIT_PCT,
    }
    ranks = _rank_counts(str(o.get("reproducible") or "none"))
    jobs = {"synthetic": (SYNTHETIC, ["--zephon.audit", "off"], nproc)}
    for level in levels:
        jobs[level] = (REGISTRY, ["--zephon.audit", level], nproc)
    for n in ranks:  # the same job with and without the setting (audit ids)
        if not (n == nproc and "ids" in levels):
            jobs[f"plain@{n}"] = (REGISTRY, ["--zephon.audit", "ids"], n)
        jobs[f"reproducible@{n}"] = (
            REGISTRY,
            ["--zephon.audit", "ids", "--zephon.reproducible"],
            n,
        )
    # One job at a time, so that they do not slow each other down, in `rounds` interleaved
    # rounds; each variant keeps its best round (the one least disturbed by other processes
    # on a shared machine). --quick (a smoke test, not a measurement) starts all at once.
    concurrent = bool(o.get("concurrent"))
    rounds = int(o["rounds"])
    res["concurrent"], res["rounds"] = concurrent, rounds
    runs: dict[str, dict] = {}
    all_rounds: dict[str, list[dict]] = {name: [] for name in jobs}
    with tempfile.TemporaryDirectory(prefix="zephon-bench-step-") as tmp:
        for k in range(rounds):
            started: dict[str, TrainJob] = {}
            for name, (registry, args, n) in jobs.items():
                run_dir = Path(tmp) / f"{name.replace('@', '-')}-{k}"
                job = TrainJob(run_dir, registry, o["config"], n, steps, [*extra, *args])
                started[name] = job
                if not concurrent:
                    all_rounds[name].append(job.result())
            if concurrent:
                for name, job in started.items():
                    all_rounds[name].append(job.result())
    for name, results in all_rounds.items():
        runs[name] = dict(max(results, key=lambda x: x["steps_per_s"]))
        runs[name]["rounds_steps_per_s"] = [x["steps_per_s"] for x in results]
    upper = runs["synthetic"]["steps_per_s"]
    for r in runs.values():
        r["vs_synthetic"] = ratio(r["steps_per_s"], upper)
    res["reproducible"] = {
        n: _reproducible_cost(
            runs[f"reproducible@{n}"], runs.get(f"plain@{n}", runs.get("ids")), n, steps
        )
        for n in ranks
    }
    res["runs"] = runs
    res["steps_per_s"] = {k: v["steps_per_s"] for k, v in runs.items()}
    res["data_wait_pct"] = {k: v["data_wait_pct"] for k, v in runs.items()}
    if "ids" in runs:
        res["meets"] = {"data_wait_ids": runs["ids"]["data_wait_pct"] < TARGET_DATA_WAIT_PCT}
    return res


def _rank_counts(text: str) -> list[int]:
    """``--reproducible``: "1,2" -> [1, 2]; "none" -> []."""
    if text.strip().lower() == "none":
        return []
    try:
        ranks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ranks = [0]
    if not ranks or any(n < 1 for n in ranks):
        raise ValueError(
            f"--reproducible takes comma-separated rank counts >= 1 (e.g. 1,2) or none, got "
            f"{text!r}."
        )
    return ranks


def _reproducible_cost(on: dict, off: dict, ranks: int, steps: int) -> dict:
    """The setting's cost at ``ranks`` ranks: steps/s and peak memory side by side, and
    the gradient bytes a rank reduces per step (module docstring)."""
    params = on["parameters"] or off["parameters"]
    out = {
        "ranks": ranks,
        "steps_per_s": {"off": off["steps_per_s"], "on": on["steps_per_s"]},
        "speed_ratio": ratio(on["steps_per_s"], off["steps_per_s"]),
        "peak_rss_gib": {"off": off["peak_rss_gib"], "on": on["peak_rss_gib"]},
        "parameters": params,
    }
    if on["peak_rss_gib"] and off["peak_rss_gib"]:
        out["memory_ratio"] = ratio(on["peak_rss_gib"], off["peak_rss_gib"])
    if params is not None:
        per_micro = params if ranks > 1 else 0  # one rank reduces nothing
        out["reduced_bytes_per_micro_batch"] = {
            "off": per_micro * FLOAT32_BYTES,
            "on": per_micro * LIMB_BYTES + (SCALARS_BYTES if ranks > 1 else 0),
        }
    return out


def rows(r: dict) -> list[tuple[str, str, str]]:
    out = []
    for n, c in r.get("reproducible", {}).items():
        rss = c["peak_rss_gib"]
        mem = (
            f", peak RSS {rss['off']:.3f} / {rss['on']:.3f} GiB"
            if rss["off"] is not None and rss["on"] is not None
            else ""
        )
        sent = c.get("reduced_bytes_per_micro_batch")
        note = f"{c['speed_ratio']:.2f}x steps/s" + (
            f", {c['memory_ratio']:.2f}x memory" if "memory_ratio" in c else ""
        )
        if sent is not None:
            note += f"; gradient bytes reduced per micro-batch {sent['off']:,} / {sent['on']:,}"
        out.append(
            (
                f"zephon.reproducible off / on, {n} rank(s)",
                f"{c['steps_per_s']['off']:.2f} / {c['steps_per_s']['on']:.2f} steps/s{mem}",
                note,
            )
        )
    for name, x in r["runs"].items():
        if "@" in name:
            continue  # in the reproducible rows above
        label = "synthetic tensor (upper bound)" if name == "synthetic" else f"zephon audit={name}"
        each = ", ".join(f"{v:.2f}" for v in x["rounds_steps_per_s"])
        note = f"{x['vs_synthetic']:.2f}x of synthetic (rounds: {each})"
        if name == "ids":
            note += f"; data wait target < {TARGET_DATA_WAIT_PCT}%"
        out.append(
            (
                label,
                f"{x['steps_per_s']:.2f} steps/s, data wait {x['data_wait_pct']:.3f}%",
                note,
            )
        )
    return out
