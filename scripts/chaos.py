"""Chaos test: kill a training job again and again, resume it at random topologies,
and prove it saw exactly the data of an uninterrupted reference.

    python scripts/chaos.py --cycles N [--seed S] [--out DIR] [--steps STEPS] [--rtol R]

1. A reference job trains STEPS steps without interruption.
2. A chaos job in another folder is started, SIGKILLed (the whole process tree:
   torchrun starts its workers in sessions of their own) and started again, N
   times. Each kill is either at a random moment or deliberately while a
   checkpoint is being written (a ``step-N`` folder without DCP's ``.metadata``).
   Every start draws a random DP degree among those that divide the global batch
   (up to --max-ranks) and a random local batch size that splits the rank's share,
   and resumes from the last complete checkpoint.
3. A last start runs the chaos job to the end; then ``zephon verify`` against the
   reference (every step's ids and token digests) and ``zephon compare`` of the
   loss curves at ``--rtol``.

Prints one verdict line and exits 0 only when no step diverged and the losses
are within the tolerance. The job is the tiny Llama of the test suite on the
builtin store (CPU, fp32); with --fresh-topology reference every start that trains
from step 1 (no complete checkpoint yet) uses the reference's topology (needed only
where initial weights depend on the topology).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from torchtitan_zephon.run import process

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "train_configs" / "debug_model.toml"
GBS = 8
JOB = [
    "--model.flavor", "tiny",
    "--training.seq_len", "64",
    "--training.global_batch_size", str(GBS),
    "--checkpoint.interval", "2",
    "--checkpoint.keep_latest_k", "0",
    "--validation.no-enable",
    "--metrics.log_freq", "1",
    "--lr_scheduler.warmup_steps", "2",
    "--zephon.heldout_samples", "0",
    "--comm.init_timeout_seconds", "120",
]  # fmt: skip


def layouts(max_ranks: int) -> list[tuple[int, int]]:
    """(DP degree, local batch size) pairs that split the global batch."""
    out = []
    for d in range(1, max_ranks + 1):
        if GBS % d == 0:
            out += [(d, b) for b in range(1, GBS // d + 1) if (GBS // d) % b == 0]
    return out


def command(run: Path, ranks: int, local_batch: int, steps: int, port: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=1", f"--nproc_per_node={ranks}", "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}", "--max-restarts=0",
        "-m", "torchtitan_zephon.train",
        "--job.config_file", str(CONFIG),
        "--job.dump_folder", str(run),
        "--training.steps", str(steps),
        "--training.local_batch_size", str(local_batch),
        *JOB,
    ]  # fmt: skip


def kill_tree(proc: subprocess.Popen) -> None:
    """Lose the node: the launcher and every process under it (ownership.process.kill_tree)."""
    process.kill_tree(proc.pid)
    proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", ZEPHON_DEVICE="cpu", PYTHONUNBUFFERED="1")
    e.setdefault("ZEPHON_LOCK_LEASE_S", "5")
    return e


def incomplete_checkpoints(run: Path) -> dict[str, tuple[int, int]]:
    """Checkpoint folders without DCP's .metadata: name -> (files, bytes) in them."""
    root = run / "checkpoint"
    out = {}
    if root.is_dir():
        for child in root.iterdir():
            if child.name.startswith("step-") and not (child / ".metadata").exists():
                try:
                    files = [f.stat().st_size for f in child.iterdir()]
                except OSError:
                    continue  # being created or removed right now
                out[child.name] = (len(files), sum(files))
    return out


def writing_checkpoint(run: Path, before: dict[str, tuple[int, int]]) -> str | None:
    """A checkpoint folder DCP is writing right now: incomplete, and new or changed
    since ``before`` (folders an earlier kill left half-written do not count)."""
    for name, sizes in incomplete_checkpoints(run).items():
        if before.get(name) != sizes:
            return name
    return None


def complete_steps(run: Path) -> list[int]:
    root = run / "checkpoint"
    if not root.is_dir():
        return []
    return sorted(
        int(c.name[5:])
        for c in root.iterdir()
        if c.name.startswith("step-") and (c / ".metadata").exists()
    )


def start(run: Path, layout: tuple[int, int], steps: int, log) -> subprocess.Popen:
    ranks, local = layout
    log.write(f"\n===== start: {ranks} ranks, local batch {local} =====\n")
    log.flush()
    cmd = command(run, ranks, local, steps, free_port())
    if not complete_steps(run):  # killed before its first checkpoint: train again from step 1
        cmd.append("--zephon.start_over")
    return subprocess.Popen(
        cmd, cwd=REPO, env=env(), stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip


def log_size(run: Path) -> int:
    try:
        return (run / "zephon" / "sequence_log.jsonl").stat().st_size
    except OSError:
        return 0


def steps_logged_since(run: Path, offset: int) -> int:
    """Complete step records appended to the sequence log after byte ``offset``."""
    try:
        with open(run / "zephon" / "sequence_log.jsonl", "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return 0
    return sum(1 for line in data.split(b"\n")[:-1] if b'"event"' not in line)


def cycle(run: Path, layout, steps: int, mode: str, rng: random.Random, log) -> str:
    """Start the chaos job and kill it; return what happened.

    ``checkpoint``: killed as soon as DCP starts writing a checkpoint. ``random``: killed
    at a random moment: during start-up (a fifth of the time), or once the job has
    trained a random 1-6 steps, plus a random fraction of a step.
    """
    leftovers = incomplete_checkpoints(run)
    offset = log_size(run)
    proc = start(run, layout, steps, log)
    t0 = time.time()
    during_startup = rng.random() < 0.2
    startup_kill = rng.uniform(0.5, 8.0)
    extra_steps, jitter = rng.randint(1, 6), rng.uniform(0.0, 0.3)
    reached = None
    while True:
        if proc.poll() is not None:
            return "finished" if proc.returncode == 0 else f"failed ({proc.returncode})"
        now = time.time()
        if mode == "checkpoint" and writing_checkpoint(run, leftovers) is not None:
            kill_tree(proc)
            return "killed during checkpoint"
        if mode == "random":
            if during_startup and now - t0 >= startup_kill:
                kill_tree(proc)
                return "killed"
            if not during_startup:
                if reached is None and steps_logged_since(run, offset) >= extra_steps:
                    reached = now
                if reached is not None and now - reached >= jitter:
                    kill_tree(proc)
                    return "killed"
        if now - t0 > 900:
            kill_tree(proc)
            return "timed out"
        time.sleep(0.002)


def zephon(*args: str) -> tuple[int, dict]:
    out = subprocess.run(
        [sys.executable, "-m", "torchtitan_zephon", *args, "--json"],
        capture_output=True, text=True, env=env(), cwd=REPO,
    )  # fmt: skip
    try:
        return out.returncode, json.loads(out.stdout)
    except ValueError:
        return out.returncode, {"error": out.stderr.strip()[-2000:]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cycles", type=int, required=True, help="number of kill / resume cycles")
    p.add_argument("--seed", type=int, default=0, help="seed of the random choices (default 0)")
    p.add_argument(
        "--out", default="./outputs/chaos", help="output folder (default ./outputs/chaos)"
    )
    p.add_argument(
        "--steps", type=int, default=None, help="training steps (default max(16, 2 x cycles))"
    )
    p.add_argument(
        "--rtol", type=float, default=1e-4, help="loss tolerance, relative (default 1e-4)"
    )
    p.add_argument("--max-ranks", type=int, default=4, help="largest DP degree drawn (default 4)")
    p.add_argument(
        "--fresh-topology", choices=("any", "reference"), default="any",
        help="topology of starts from step 1 (no checkpoint yet): random (default) or the reference's",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.cycles < 0:
        p.error(f"--cycles must be >= 0, got {args.cycles}")
    rng = random.Random(args.seed)
    steps = args.steps or 8 + 4 * args.cycles
    out = Path(args.out).resolve()
    ref, run = out / "reference", out / "chaos"
    for d in (ref, run):
        if d.exists():
            import shutil

            shutil.rmtree(d)
    out.mkdir(parents=True, exist_ok=True)
    choices = layouts(args.max_ranks)
    t_start = time.time()

    def say(msg: str) -> None:
        print(f"[chaos {time.time() - t_start:6.0f}s] {msg}", flush=True)

    ref_layout = (2, 2) if (2, 2) in choices else choices[0]
    with open(out / "reference.log", "w") as log:
        say(f"reference: {steps} steps on {ref_layout[0]} ranks, local batch {ref_layout[1]}")
        proc = start(ref, ref_layout, steps, log)
        if proc.wait() != 0:
            say(f"reference failed; see {out / 'reference.log'}")
            return 2
    kills = ckpt_kills = 0
    history = []
    with open(out / "chaos.log", "w") as log:
        for c in range(1, args.cycles + 1):
            fresh = not complete_steps(run)  # this start trains from step 1
            layout = rng.choice(choices)
            if fresh and args.fresh_topology == "reference":
                layout = ref_layout
            mode = "checkpoint" if rng.random() < 0.5 else "random"
            before = complete_steps(run)
            what = cycle(run, layout, steps, mode, rng, log)
            if what.startswith("killed"):
                kills += 1
                ckpt_kills += what == "killed during checkpoint"
            history.append({"cycle": c, "layout": layout, "mode": mode, "outcome": what})
            say(
                f"cycle {c}/{args.cycles}: {layout[0]} ranks, local batch {layout[1]}, {mode} "
                f"kill -> {what}; complete checkpoints {before[-1:] or '-'} -> "
                f"{complete_steps(run)[-1:] or '-'}"
            )
            if what.startswith(("failed", "timed out")):
                say(f"the job failed; see {out / 'chaos.log'}")
                return 2
            if what == "finished":
                break
        layout = rng.choice(choices)
        if not complete_steps(run) and args.fresh_topology == "reference":
            layout = ref_layout
        say(f"final: {layout[0]} ranks, local batch {layout[1]}, to step {steps}")
        proc = start(run, layout, steps, log)
        if proc.wait() != 0:
            say(f"the final job failed; see {out / 'chaos.log'}")
            return 2
    rc_v, verify = zephon("verify", str(ref), str(run))
    rc_c, compare = zephon("compare", str(ref), str(run), "--rtol", str(args.rtol))
    compared = verify.get("steps_compared", 0)
    divergent = compared - verify.get("matches", 0) if "steps_compared" in verify else None
    max_rel = None
    for pair in compare.get("comparisons", []) if isinstance(compare, dict) else []:
        max_rel = pair.get("overall", {}).get("max_rel", max_rel)
    ok = rc_v == 0 and rc_c == 0 and divergent == 0 and compared == steps
    summary = {
        "cycles": args.cycles,
        "kills": kills,
        "kills_during_checkpoint": ckpt_kills,
        "steps": steps,
        "steps_verified": compared,
        "divergent_steps": divergent,
        "verify": verify.get("verdict", verify.get("error")),
        "max_loss_rel_diff": max_rel,
        "rtol": args.rtol,
        "seed": args.seed,
        "wall_s": round(time.time() - t_start),
        "history": history,
    }
    (out / "chaos.json").write_text(json.dumps(summary, indent=2))
    print(
        f"chaos: {'PASS' if ok else 'FAIL'}: cycles {args.cycles}, kills {kills} "
        f"({ckpt_kills} during checkpoint writes), steps verified {compared}/{steps}, "
        f"divergent steps {divergent}, max loss difference {max_rel} (rtol {args.rtol}), "
        f"seed {args.seed}, {summary['wall_s']} s"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
