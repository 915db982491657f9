"""``zephon bench ft``: replica groups under torchft, side by side with a whole-job
restart and with TorchTitan 0.3's own torchft data path, in one run.

1. **Recovery.** The debug job (``llama3_debug``; ``--quick``: ``llama3_tiny``) as two
   replica groups of one rank under a real ``torchft_lighthouse`` (torchft's default
   heartbeat timeout, 5 s): group 1's process tree is SIGKILLed after step K, and the
   time from the kill to the next step group 0 commits is measured. Group 1 is started
   again once group 0 has trained ``away`` more steps: the time from its restart to its
   heal (its log holds its peer's steps). Both are stopped a few steps later (at step
   E). Against it, the same job without torchft on one rank, trained to E, killed after
   step K and restarted from its last checkpoint (interval 4) as our users restart
   today: the time from the kill to the first step past K (start-up, checkpoint load,
   the steps since the checkpoint trained again).
2. **Quorum cost.** Two replica groups train the debug job's model on one fixed batch
   (``bench.ft_loop``) with torchft's synchronous quorum (Zephon's: the quorum before
   the data) and with its asynchronous one (TorchTitan's ``TorchFTManager``: the quorum
   overlapped with the forward), the modes alternating: median step time of each, and
   the difference in % of the asynchronous step.
3. **Samples trained twice and never** in steps 1..E of run 1's groups (a kill and a
   return), against the samples the run without torchft trains in those steps. Ours:
   counted from the groups' effective sequence logs (each committed step's slots).
   TorchTitan 0.3 applied to the same timeline (``tt_counts``): group g of G reads DP
   shard g of G x inner (``get_dp_info``), keeps its data position per replica, drops
   the batch of a step that is not committed, and a returning group heals weights but
   not data.

Invariant: every figure comes from this invocation: both jobs run the same config and
steps on this machine; the two quorum modes run the same model, batch and step.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from torchtitan_zephon.bench.measure import ratio

REPO = Path(__file__).resolve().parents[2]
HEARTBEAT_MS = 5000  # torchft_lighthouse's default
DEFAULTS = {
    "config": "llama3_debug",
    "kill_after": 10,
    "away": 6,
    "tail": 4,
    "loop_steps": 12,
    "rounds": 2,
}
QUICK = {
    "config": "llama3_tiny",
    "kill_after": 6,
    "away": 3,
    "tail": 2,
    "loop_steps": 4,
    "rounds": 1,
}
UNBOUNDED_STEPS = 1_000_000  # the groups are stopped by the benchmark
JOB = ("--validator.no-enable", "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "2",
       "--metrics.log_freq", "1")  # fmt: skip
WAIT_S = 600
LOOP_WARMUP = 2


# ---------------------------------------------------------------- the counts


def slot_counts(steps: Iterable[tuple[int, int]]) -> Counter:
    """How often each slot was trained: ``steps`` are (first slot, samples) per step."""
    out: Counter = Counter()
    for first, count in steps:
        out.update(range(first, first + count))
    return out


def twice_and_never(trained: Counter, intended: Counter) -> dict[str, int]:
    """Samples trained more than once (each extra time counted) and intended samples
    never trained."""
    return {
        "twice": sum(c - 1 for c in trained.values() if c > 1),
        "never": sum(1 for slot in intended if trained[slot] == 0),
    }


def tt_counts(
    attempts: dict[int, list[tuple[int, bool]]], groups: int, inner: int, gbs: int
) -> Counter:
    """The slots TorchTitan 0.3's torchft path trains given each group's attempts in
    order (``attempts[g]``: (step, committed) for every step group g drew data for):
    rank r of group g is DP rank g x inner + r of groups x inner (``get_dp_info``) and
    reads every (groups x inner)-th sample from its own offset, ``gbs / (groups x inner)``
    per step, its position kept per replica (saved every step: an attempt its own death
    cut is read again); an attempt not committed is dropped with its batch; a group
    that heals takes the weights, not the data position. With every group committing
    every step this is the slots [(s - 1) gbs, s gbs) of each step s."""
    degree = groups * inner
    local = gbs // degree
    trained: Counter = Counter()
    for g, tries in attempts.items():
        position = 0
        for _step, committed in tries:
            if committed:
                for r in range(inner):
                    k = g * inner + r
                    trained.update((position + i) * degree + k for i in range(local))
            position += local
    return trained


# ---------------------------------------------------------------- the runs


def _env(lighthouse: str | None = None) -> dict[str, str]:
    from torchtitan_zephon.titan.ft.launch import group_env

    return group_env(lighthouse)


def _wait_until(done: Callable[[], bool], procs: list[subprocess.Popen], what: str) -> float:
    """Poll ``done`` until true; the time it became true. A process that exits non-zero
    first, or WAIT_S without it, is an error naming ``what``."""
    deadline = time.monotonic() + WAIT_S
    while not done():
        for p in procs:
            if p.poll() not in (None, 0):
                raise RuntimeError(f"a benchmark job failed ({p.returncode}) waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {WAIT_S} s waiting for {what}")
        time.sleep(0.005)
    return time.monotonic()


def _start(cmd: list[str], run: Path, env: dict[str, str]) -> subprocess.Popen:
    run.mkdir(parents=True, exist_ok=True)
    log = open(run / "train.log", "a")  # noqa: SIM115 - the child holds it
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _finish(procs: list[subprocess.Popen], what: str) -> None:
    for p in procs:
        try:
            rc = p.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            raise RuntimeError(f"{what} did not finish in {WAIT_S} s") from None
        if rc != 0:
            raise RuntimeError(f"{what} failed ({rc})")


def _kill(proc: subprocess.Popen) -> float:
    from torchtitan_zephon.run.process import kill_tree

    t = time.monotonic()
    kill_tree(proc.pid)
    proc.wait()
    return t


def whole_job_restart(root: Path, o: dict[str, Any], steps: int) -> dict[str, Any]:
    """The job without torchft, killed after step K and restarted from its checkpoint,
    trained to ``steps``: also the reference of what the groups should train."""
    from torchtitan_zephon.titan.ft.launch import job_command, last_step

    run = root / "restart"
    cmd = job_command(run, "--training.steps", str(steps), *JOB, config=o["config"])
    proc = _start(cmd, run, _env())
    k = o["kill_after"]
    _wait_until(lambda: last_step(run) >= k, [proc], f"step {k} of the job without torchft")
    t_kill = _kill(proc)
    killed_at = last_step(run)
    proc = _start(cmd, run, _env())
    t_next = _wait_until(lambda: last_step(run) > killed_at, [proc], "the restarted job")
    _finish([proc], "the restarted job")
    from torchtitan_zephon.run.recorded import resumes, sequence_log

    (event,) = resumes(sequence_log(run))
    return {
        "run": run,
        "killed_after_step": killed_at,
        "resumed_from_checkpoint": event.get("from_step"),
        "steps_trained_again": killed_at - int(event.get("from_step") or 0),
        "kill_to_next_step_s": t_next - t_kill,
    }


def groups_with_a_kill(root: Path, o: dict[str, Any]) -> dict[str, Any]:
    """Two replica groups; group 1 killed after step K, started again once group 0 has
    trained ``away`` more steps; once it has trained ``tail`` steps after healing, both
    are stopped (their run has no end of its own: group 0 must still be stepping when
    group 1 is back, however long its start-up takes). ``steps``: the last step both
    logs hold."""
    from torchtitan_zephon.titan.ft.launch import group_command, last_step, local_lighthouse

    runs = [root / f"group{g}" for g in range(2)]
    k = o["kill_after"]
    long = ("--training.steps", str(UNBOUNDED_STEPS), *JOB)
    with local_lighthouse(1, heartbeat_timeout_ms=HEARTBEAT_MS) as url:
        cmds = [group_command(run, g, 2, *long, config=o["config"]) for g, run in enumerate(runs)]
        procs = [_start(cmd, run, _env(url)) for cmd, run in zip(cmds, runs, strict=True)]
        try:
            _wait_until(lambda: last_step(runs[1]) >= k, procs, f"step {k} of group 1")
            t_kill = _kill(procs[1])
            survivor_at = last_step(runs[0])
            t_next = _wait_until(
                lambda: last_step(runs[0]) > survivor_at, procs[:1], "group 0's next step"
            )
            back_at = survivor_at + o["away"]
            _wait_until(lambda: last_step(runs[0]) >= back_at, procs[:1], f"step {back_at}")
            t_back, lead = time.monotonic(), last_step(runs[0])
            procs[1] = _start(cmds[1], runs[1], _env(url))
            t_trains = _wait_until(
                lambda: last_step(runs[1]) > lead, procs, "group 1 to heal and train"
            )
            healed_at = last_step(runs[1])
            _wait_until(
                lambda: last_step(runs[1]) >= healed_at + o["tail"], procs, "group 1's steps"
            )
        finally:
            for proc in procs:
                if proc.poll() is None:
                    _kill(proc)
    return {
        "runs": runs,
        "steps": min(last_step(run) for run in runs),
        "killed_after_step": survivor_at,
        "returned_at_step": lead,
        "kill_to_next_commit_s": t_next - t_kill,
        "return_to_training_s": t_trains - t_back,
    }


def _attempts(run: Path, steps: int) -> list[tuple[int, bool]]:
    """The steps up to ``steps`` a group drew data for, in order: its retries (not
    committed) and the steps it trained (its logged losses)."""
    from torchtitan_zephon.run.recorded import losses

    trained, _ = losses(run)
    lines = [json.loads(x) for x in (run / "zephon" / "sequence_log.jsonl").open() if x.strip()]
    retried = [(int(e["step"]), False) for e in lines if e.get("event") == "retry"]
    tries = [(s, True) for s in trained] + retried
    return sorted([a for a in tries if a[0] <= steps], key=lambda a: (a[0], a[1]))


def _record_slots(run: Path, steps: int) -> list[tuple[int, int]]:
    from torchtitan_zephon.run.recorded import sequence_log

    records = sequence_log(run).records
    return [
        (int(r["first_position"]), int(r["num_samples"]))
        for s, r in sorted(records.items())
        if s <= steps
    ]


def counts(groups: list[Path], reference: Path, gbs: int, steps: int) -> dict[str, Any]:
    """Samples trained twice and never in steps 1..``steps``: ours from each group's
    log, TorchTitan's sharding applied to the groups' attempts (``tt_counts``), against
    the reference's records."""
    intended = slot_counts(_record_slots(reference, steps))
    ours = {g.name: twice_and_never(slot_counts(_record_slots(g, steps)), intended) for g in groups}
    attempts = {i: _attempts(g, steps) for i, g in enumerate(groups)}
    tt = twice_and_never(tt_counts(attempts, len(groups), 1, gbs), intended)
    return {"intended_samples": len(intended), "zephon": ours, "torchtitan": tt}


def _verify(a: Path, b: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "torchtitan_zephon", "verify", str(a), str(b), "--json"],
        capture_output=True, text=True, env=_env(), cwd=REPO,
    )  # fmt: skip
    try:
        return str(json.loads(out.stdout).get("verdict"))
    except ValueError:
        return f"error: {out.stderr.strip()[-300:]}"


def _loop_pair(mode: str, o: dict[str, Any], batch: int) -> list[dict[str, list[float]]]:
    """Two groups' ``ft_loop`` in ``mode`` under one lighthouse; their JSON results."""
    from torchtitan_zephon.titan.ft.launch import local_lighthouse

    with local_lighthouse(2, heartbeat_timeout_ms=HEARTBEAT_MS) as url:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torchtitan_zephon.bench.ft_loop",
                    mode,
                    str(g),
                    url,
                    o["config"],
                    str(batch),
                    str(o["loop_steps"] + LOOP_WARMUP),
                ],
                cwd=REPO,
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for g in range(2)
        ]
        outs = [p.communicate(timeout=WAIT_S) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"the {mode} quorum loop failed: {err.strip()[-2000:]}")
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def quorum_cost(o: dict[str, Any], batch: int) -> dict[str, Any]:
    """Median step of the sync and the async quorum loops, two groups each, the modes
    alternating over ``rounds`` (the first LOOP_WARMUP steps of each left out)."""
    got: dict[str, dict[str, list[float]]] = {
        m: {"step_s": [], "quorum_call_s": []} for m in ("sync", "async")
    }
    for _ in range(o["rounds"]):
        for mode in ("sync", "async"):
            for result in _loop_pair(mode, o, batch):
                for key in ("step_s", "quorum_call_s"):
                    got[mode][key] += result[key][LOOP_WARMUP:]
    res: dict[str, Any] = {
        m: {
            "step_s_median": statistics.median(v["step_s"]),
            "quorum_call_s_median": statistics.median(v["quorum_call_s"]),
            "steps_measured": len(v["step_s"]),
        }
        for m, v in got.items()
    }
    sync, tt = res["sync"]["step_s_median"], res["async"]["step_s_median"]
    res["cost_pct"] = 100.0 * (sync - tt) / tt
    res["sync_quorum_call_pct"] = 100.0 * res["sync"]["quorum_call_s_median"] / tt
    return res


def run(opts: dict) -> dict:
    from torchtitan_zephon.configs import config_registry

    base = QUICK if opts.get("quick") else DEFAULTS
    o = {**base, **{k: v for k, v in opts.items() if v is not None and k in base}}
    gbs = int(getattr(config_registry, o["config"])().training.global_batch_size)
    res: dict[str, Any] = {"suite": "ft", "config": o["config"], "global_batch_size": gbs,
                           "heartbeat_timeout_ms": HEARTBEAT_MS}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="zephon-bench-ft-") as tmp:
        root = Path(tmp)
        ft = groups_with_a_kill(root, o)
        res["steps"] = ft["steps"]
        restart = whole_job_restart(root, o, ft["steps"])
        res["restart"] = {k: v for k, v in restart.items() if k != "run"}
        res["ft"] = {k: v for k, v in ft.items() if k != "runs"}
        res["counts"] = counts(ft["runs"], restart["run"], gbs, ft["steps"])
        res["verify"] = {g.name: _verify(restart["run"], g) for g in ft["runs"]}
        res["quorum"] = quorum_cost(o, gbs // 2)
    res["recovery_ratio"] = ratio(
        res["restart"]["kill_to_next_step_s"], res["ft"]["kill_to_next_commit_s"]
    )
    res["meets"] = {
        "zephon_exact": all(c == {"twice": 0, "never": 0} for c in res["counts"]["zephon"].values())
        and all(v == "match" for v in res["verify"].values()),
        "torchtitan_loses_samples": res["counts"]["torchtitan"]["never"] > 0,
    }
    res["cpus"] = os.cpu_count()
    return res


def rows(r: dict) -> list[tuple[str, str, str]]:
    ft, rs, q, c = r["ft"], r["restart"], r["quorum"], r["counts"]
    ours = c["zephon"]
    return [
        ("group killed -> next committed step (torchft)", f"{ft['kill_to_next_commit_s']:.1f} s",
         f"lighthouse heartbeat timeout {r['heartbeat_timeout_ms']} ms"),
        ("whole job killed -> restarted, next new step", f"{rs['kill_to_next_step_s']:.1f} s",
         f"from checkpoint {rs['resumed_from_checkpoint']}, "
         f"{rs['steps_trained_again']} step(s) trained again"),
        ("ratio restart / torchft", f"{r['recovery_ratio']:.1f}x", ""),
        ("killed group restarted -> healed, in the quorum", f"{ft['return_to_training_s']:.1f} s",
         "start-up, quorum, weights and data state from its peer"),
        ("step, sync quorum (Zephon)", f"{q['sync']['step_s_median'] * 1e3:.1f} ms",
         f"quorum call {q['sync']['quorum_call_s_median'] * 1e3:.1f} ms"),
        ("step, async quorum (TorchTitan)", f"{q['async']['step_s_median'] * 1e3:.1f} ms",
         f"quorum call {q['async']['quorum_call_s_median'] * 1e3:.1f} ms"),
        ("cost of the quorum before the data", f"{q['cost_pct']:+.1f} %",
         f"of the async step (median difference); the sync quorum call alone "
         f"{q['sync_quorum_call_pct']:.1f} %"),
        ("samples twice / never, Zephon",
         " ".join(f"{v['twice']}/{v['never']}" for v in ours.values()),
         f"of {c['intended_samples']}, per group; verify "
         + ", ".join(r["verify"].values())),
        ("samples twice / never, TorchTitan get_dp_info",
         f"{c['torchtitan']['twice']}/{c['torchtitan']['never']}",
         "the same kill and return"),
    ]  # fmt: skip
