"""Chaos under torchft: replica groups killed and returning again and again, now and then
the whole job killed and restarted, and every group still trained exactly the data of an
uninterrupted one-group run.

    python scripts/chaos_ft.py --cycles N [--groups G] [--seed S] [--out DIR] [--steps STEPS]
                               [--rtol R]

1. A reference job (the tiny Llama of the test suite, one rank, no torchft) trains
   STEPS steps without interruption.
2. A real ``torchft_lighthouse`` on loopback, and G replica groups (one rank each, each
   its own ``torchrun`` job and run folder). Each of N cycles draws one event:
   - ``kill``: once the groups have trained a random 1-4 more steps, plus a random
     fraction of a step (so sometimes in the middle of a step, before its commit), one
     live group's whole process tree is SIGKILLed; the others step on;
   - ``return``: a dead group is started again into its own folder; it heals from its
     peers;
   - ``whole job`` (about one cycle in six): every live group is killed, then a random
     non-empty set of groups is started again; they resume from the newest complete
     checkpoint those groups hold (a group behind heals from the one ahead).
3. Then every dead group returns and all train to STEPS. Each group's folder is checked
   against the reference (``zephon verify``: every step's ids and token digests) and
   group 0's (MATCH), and its losses against the reference's (``zephon compare`` at
   ``--rtol``: the reduction order differs, so not bitwise).

Prints one verdict line and exits 0 only when no step diverged in any group and the
losses agree. With ``--figures``, also the time from each kill to the next step the
survivors committed.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from torchtitan_zephon.run.process import kill_tree
from torchtitan_zephon.titan.ft.launch import (
    group_command,
    group_env,
    job_command,
    last_step,
    local_lighthouse,
)

REPO = Path(__file__).resolve().parents[1]
JOB = (
    "--validator.no-enable",
    "--checkpoint.interval", "8",
    "--checkpoint.keep_latest_k", "3",
    "--metrics.log_freq", "1",
    "--comm.init_timeout_seconds", "30",
)  # fmt: skip
HEARTBEAT_MS = 1000
STEP_TIMEOUT_S = 240  # no group stepping for this long: the run failed


class Chaos:
    """The groups of one chaos run: which are alive, their logs, the history."""

    def __init__(self, out: Path, groups: int, steps: int, lighthouse: str) -> None:
        self.runs = [out / f"group{r}" for r in range(groups)]
        self.procs: list[subprocess.Popen | None] = [None] * groups
        self.steps, self.lighthouse = steps, lighthouse
        self.logs = [open(out / f"group{r}.log", "a") for r in range(groups)]  # noqa: SIM115
        self.history: list[dict] = []
        self.recoveries_s: list[float] = []

    def alive(self) -> list[int]:
        return [r for r, p in enumerate(self.procs) if p is not None and p.poll() is None]

    def dead(self) -> list[int]:
        return [r for r in range(len(self.runs)) if r not in self.alive()]

    def failed(self) -> str | None:
        for r, p in enumerate(self.procs):
            if p is not None and p.poll() not in (None, 0):
                return f"group {r} exited with {p.returncode}; see {self.logs[r].name}"
        return None

    def start(self, r: int) -> None:
        self.runs[r].mkdir(parents=True, exist_ok=True)
        self.logs[r].write(f"\n===== start of group {r} =====\n")
        self.logs[r].flush()
        cmd = group_command(
            self.runs[r], r, len(self.runs), "--training.steps", str(self.steps), *JOB
        )
        self.procs[r] = subprocess.Popen(
            cmd, cwd=REPO, env=group_env(self.lighthouse), stdout=self.logs[r],
            stderr=subprocess.STDOUT,
        )  # fmt: skip

    def kill(self, r: int) -> None:
        proc = self.procs[r]
        assert proc is not None
        kill_tree(proc.pid)
        proc.wait()
        self.procs[r] = None  # killed by us, not failed

    def lead(self) -> int:
        """The furthest step any group has recorded."""
        return max(last_step(run) for run in self.runs)

    def wait_until(self, done, what: str) -> None:
        """Poll until ``done()``; a group that fails or no progress for STEP_TIMEOUT_S stops
        the run."""
        t0 = time.monotonic()
        while not done():
            problem = self.failed()
            if problem is not None:
                raise RuntimeError(problem)
            if time.monotonic() - t0 > STEP_TIMEOUT_S:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.01)

    def wait_steps(self, n: int) -> None:
        """Until a live group records ``n`` more steps (or the job is done)."""
        goal = min(self.lead() + n, self.steps)
        self.wait_until(
            lambda: any(last_step(self.runs[r]) >= goal for r in self.alive()) or not self.alive(),
            f"step {goal}",
        )

    def close(self) -> None:
        for r in self.alive():
            self.kill(r)
        for log in self.logs:
            log.close()


def zephon(*args: str) -> tuple[int, dict]:
    out = subprocess.run(
        [sys.executable, "-m", "torchtitan_zephon", *args, "--json"],
        capture_output=True, text=True, env=group_env(), cwd=REPO,
    )  # fmt: skip
    try:
        return out.returncode, json.loads(out.stdout)
    except ValueError:
        return out.returncode, {"error": out.stderr.strip()[-2000:]}


def cycle(chaos: Chaos, rng: random.Random) -> dict:
    """One drawn event (module docstring); returns what happened."""
    alive, dead = chaos.alive(), chaos.dead()
    events = []
    if len(alive) >= 2:
        events.append("kill")
    if dead:
        events.append("return")
    if not events or rng.random() < 1 / 6:
        events = ["whole job"]
    event = rng.choice(events)
    at = chaos.lead()
    if event == "kill":
        chaos.wait_steps(rng.randint(1, 4))
        time.sleep(rng.uniform(0.0, 0.5))
        victim = rng.choice(chaos.alive())
        t_kill = time.monotonic()
        chaos.kill(victim)
        before = {r: last_step(chaos.runs[r]) for r in chaos.alive()}
        chaos.wait_until(
            lambda: any(last_step(chaos.runs[r]) > s for r, s in before.items()),
            "a survivor's next step",
        )
        chaos.recoveries_s.append(time.monotonic() - t_kill)
        return {"event": event, "group": victim, "killed_after_step": at}
    if event == "return":
        back = rng.choice(dead)
        chaos.start(back)
        chaos.wait_until(lambda: last_step(chaos.runs[back]) > at, f"group {back} to heal and step")
        return {"event": event, "group": back, "returned_at_step": at}
    if alive:
        chaos.wait_steps(rng.randint(1, 4))
        time.sleep(rng.uniform(0.0, 0.5))
    for r in chaos.alive():
        chaos.kill(r)
    killed_at = chaos.lead()
    restart = sorted(rng.sample(range(len(chaos.runs)), rng.randint(1, len(chaos.runs))))
    for r in restart:
        chaos.start(r)
    chaos.wait_until(
        lambda: any(last_step(chaos.runs[r]) > killed_at for r in chaos.alive()),
        "the restarted job to step past the kill",
    )
    return {"event": event, "killed_after_step": killed_at, "restarted": restart}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cycles", type=int, required=True, help="number of drawn events")
    p.add_argument("--groups", type=int, default=2, help="replica groups (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random choices (default 0)")
    p.add_argument("--out", default="./outputs/chaos_ft", help="default ./outputs/chaos_ft")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="default 40 + 40 x cycles (a start takes as long as ~100 steps)",
    )
    p.add_argument(
        "--rtol", type=float, default=1e-4, help="loss tolerance, relative (default 1e-4)"
    )
    args = p.parse_args(argv)
    if args.cycles < 0:
        p.error(f"--cycles must be >= 0, got {args.cycles}")
    if args.groups < 2:
        p.error(f"--groups must be >= 2 (one group has no peer to step on), got {args.groups}")
    steps = args.steps or 40 + 40 * args.cycles
    if steps < 16:
        p.error(f"--steps must be >= 16 (two checkpoints), got {steps}")
    rng = random.Random(args.seed)
    out = Path(args.out).resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    t_start = time.time()

    def say(msg: str) -> None:
        print(f"[chaos_ft {time.time() - t_start:6.0f}s] {msg}", flush=True)

    ref = out / "reference"
    say(f"reference: {steps} steps, one group without torchft, one rank")
    with open(out / "reference.log", "w") as log:
        cmd = job_command(ref, "--training.steps", str(steps), *JOB)
        if subprocess.run(cmd, cwd=REPO, env=group_env(), stdout=log, stderr=log).returncode:
            say(f"the reference failed; see {out / 'reference.log'}")
            return 2
    with local_lighthouse(1, heartbeat_timeout_ms=HEARTBEAT_MS) as url:
        chaos = Chaos(out, args.groups, steps, url)
        try:
            for r in range(args.groups):
                chaos.start(r)
            chaos.wait_until(lambda: chaos.lead() >= 1, "step 1")
            for c in range(1, args.cycles + 1):
                if chaos.lead() >= steps - 8:
                    say(f"cycle {c}: the job is near its end (step {chaos.lead()}); no more events")
                    break
                what = cycle(chaos, rng)
                chaos.history.append({"cycle": c, **what})
                say(f"cycle {c}/{args.cycles}: {what}; live groups {chaos.alive()}")
            for r in chaos.dead():
                if last_step(chaos.runs[r]) < steps:
                    chaos.start(r)
            chaos.wait_until(lambda: not chaos.alive(), f"every group to reach step {steps}")
        except RuntimeError as e:
            say(f"FAIL: {e}")
            chaos.close()
            return 2
        chaos.close()
    verdicts, divergent, max_rel, ok = {}, 0, None, True
    for run in chaos.runs:
        rc_v, verify = zephon("verify", str(ref), str(run))
        rc_p, peer = zephon("verify", str(chaos.runs[0]), str(run))
        rc_c, compare = zephon("compare", str(ref), str(run), "--rtol", str(args.rtol))
        compared = verify.get("steps_compared", 0)
        divergent += compared - verify.get("matches", 0) if "steps_compared" in verify else steps
        for pair in compare.get("comparisons", []) if isinstance(compare, dict) else []:
            rel = pair.get("overall", {}).get("max_rel")
            if rel is not None:
                max_rel = rel if max_rel is None else max(max_rel, rel)
        verdicts[run.name] = {
            "verify": verify.get("verdict", verify.get("error")),
            "verify_group0": peer.get("verdict", peer.get("error")),
            "steps_verified": compared,
        }
        ok &= rc_v == 0 and rc_p == 0 and rc_c == 0 and compared == steps
    ok &= divergent == 0
    summary = {
        "cycles": args.cycles,
        "groups": args.groups,
        "steps": steps,
        "divergent_steps": divergent,
        "groups_verified": verdicts,
        "max_loss_rel_diff": max_rel,
        "rtol": args.rtol,
        "seed": args.seed,
        "kill_to_next_commit_s": [round(t, 2) for t in chaos.recoveries_s],
        "wall_s": round(time.time() - t_start),
        "history": chaos.history,
    }
    (out / "chaos_ft.json").write_text(json.dumps(summary, indent=2))
    kills = sum(h["event"] == "kill" for h in chaos.history)
    wholes = sum(h["event"] == "whole job" for h in chaos.history)
    print(
        f"chaos_ft: {'PASS' if ok else 'FAIL'}: cycles {len(chaos.history)}, {args.groups} "
        f"groups, group kills {kills}, whole-job kills {wholes}, steps {steps}, divergent "
        f"steps {divergent}, max loss difference {max_rel} (rtol {args.rtol}), seed "
        f"{args.seed}, {summary['wall_s']} s"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
