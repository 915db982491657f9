"""``zephon spikes``: loss spikes of a run, the data of each spiking step and a rollback.

Role: reads the run's training loss (TensorBoard scalar
``loss_metrics/global_avg_loss``, which TorchTitan 0.3 writes under
``<dump_folder>/<metrics.save_tb_folder>/<time>/events.out.tfevents.*``; the value
written last wins, as in ``runs.read_scalars``) and flags step P when

    loss(P) > median(W) + k * 1.4826 * MAD(W)

where W is the trailing window: the losses of the ``--window`` logged steps before P
(fewer at the start of the run: every logged step before P, judged only once
``MIN_WINDOW`` are there; steps before that are never flagged). MAD is the median of
|loss - median(W)|; a window of equal losses (MAD 0) flags any rise above them.
For each spike it prints ``zephon show``'s summary of step P and a rollback: the
newest complete checkpoint C <= P - ``ROLLBACK_MARGIN`` of the run's checkpoint
folder, and ``--checkpoint.load_step C --zephon.skip_steps (C+1):(P-C+10)``
(the run's own skip entries up to C kept; when one of them still covers step C+1, the
new entry starts after it, and an older checkpoint is taken when the spike lies inside
it; ``rollback``). When no checkpoint allows a skip, it suggests leaving the step's
samples out instead (``zephon.exclude``).

Invariant: reading only; no events, no loss scalar, no checkpoint early enough each
get a clear message (exit 2 for the first two; the third is said per spike).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_zephon.cli.args import int_in, positive_float
from torchtitan_zephon.cli.checkpoint_heads import checkpoint_folder
from torchtitan_zephon.cli.open_data import ShowError, open_step_data, say_notes
from torchtitan_zephon.cli.plan import add_exclude_argument
from torchtitan_zephon.cli.show import format_sample, step_samples
from torchtitan_zephon.job.step_data import StepData
from torchtitan_zephon.order.skips import SkipSteps
from torchtitan_zephon.run import recorded as runs

K = 6.0
WINDOW = 50
MIN_WINDOW = 5
"""Logged steps the trailing window needs before a step is judged."""
ROLLBACK_MARGIN = 10
"""The checkpoint rolled back to is at least this many steps before the spike, and the
skip reaches this many steps past it."""
SUMMARY_CHARS = 80


def find_spikes(
    losses: dict[int, float], k: float = K, window: int = WINDOW
) -> list[dict[str, Any]]:
    """The spikes of ``losses`` (step -> loss) under the module's rule, in step order:
    ``{"step", "loss", "median", "sigma", "score"}`` (score: robust sigmas above the median)."""
    steps = sorted(losses)
    values = np.array([losses[s] for s in steps], dtype=np.float64)
    out = []
    for t in range(len(steps)):
        w = values[max(0, t - window) : t]
        w = w[np.isfinite(w)]
        if w.size < MIN_WINDOW:
            continue
        median = float(np.median(w))
        sigma = 1.4826 * float(np.median(np.abs(w - median)))
        loss = float(values[t])
        excess = loss - median  # nan for a nan loss: a nan loss is a spike too
        if not np.isfinite(loss) or excess > k * sigma and excess > 0:
            score = float("inf") if sigma == 0 or not np.isfinite(loss) else excess / sigma
            out.append(
                {"step": steps[t], "loss": loss, "median": median, "sigma": sigma, "score": score}
            )
    return out


def rollback(spike: int, checkpoints: list[int], skips: SkipSteps) -> tuple[int, str] | None:
    """(C, the skip_steps value) for a spike at step ``spike``, or None when no skip can
    leave out that step's data from any checkpoint C <= spike - ROLLBACK_MARGIN.

    The value is what the resume rule accepts as a continuation from C (``order.resume``:
    the run's entries with S <= C unchanged) and what changes step ``spike``'s data: one
    new entry from the first step no kept entry covers, ``skips.reach(C)`` (C + 1 unless
    a trained entry's range runs past C), through spike + ROLLBACK_MARGIN. Entries the
    run had after C are dropped where they overlap it and kept after it. C is the
    newest checkpoint for which that first step is at or before the spike (a spike
    inside a range trained from before C cannot be skipped from C: its data was drawn
    past that range's skip already)."""
    for c in sorted((c for c in checkpoints if c <= spike - ROLLBACK_MARGIN), reverse=True):
        start = skips.reach(c)
        if start > spike:
            continue
        stop = spike + ROLLBACK_MARGIN  # the last step whose data the new entry skips
        kept = [(s, n) for s, n in skips.entries if s <= c or s > stop]
        return c, str(SkipSteps(sorted([*kept, (start, stop - start + 1)])))
    return None


def schedule_cause(
    data: StepData, step: int, samples: list[dict[str, Any]], checkpoints: list[int]
) -> dict[str, Any] | None:
    """When the mixture's weight schedule put the spike there: every sample of ``step``
    comes from one source whose weight the schedule entry in effect at ``step`` (from
    step F) raised. A skip cannot help then (the weights still fill those slots from
    that source); the fix is a weight entry: from the newest complete checkpoint C before
    ``step``, keep the entries at or before C and give the steps after C the weights in
    effect before F. Returns that advice (None otherwise)."""
    mixture = data.config.mixture
    names = {s.get("source") for s in samples}
    if not mixture or len(names) != 1 or not samples:
        return None
    (source,) = names
    entries = sorted(mixture.get("schedule") or [], key=lambda e: int(e["from_step"]))
    now = [e for e in entries if int(e["from_step"]) <= step]
    if len(now) < 2:
        return None
    before, current = now[-2]["weights"], now[-1]["weights"]

    def share(weights: dict[str, Any], name: str) -> Fraction:
        total = sum((Fraction(str(v)) for v in weights.values()), Fraction(0))
        return Fraction(str(weights.get(name, 0))) / total if total else Fraction(0)

    if share(current, source) <= share(before, source):
        return None
    early = [c for c in checkpoints if c < step]
    c = max(early) if early else None
    scale = math.lcm(*(Fraction(str(v)).denominator for v in before.values()))
    weights = {n: int(Fraction(str(v)) * scale) for n, v in sorted(before.items())}
    return {
        "source": source,
        "from_step": int(now[-1]["from_step"]),
        "share": str(share(current, source)),
        "share_before": str(share(before, source)),
        "load_step": c,
        "entry": {"from_step": None if c is None else c + 1, "weights": weights},
    }


def _schedule_advice(cause: dict[str, Any], step: int, count: int) -> str:
    f, source = cause["from_step"], cause["source"]
    said = (
        f"all {count} samples of step {step} come from source {source!r}, whose share the "
        f"mixture's weight schedule raised from {cause['share_before']} to {cause['share']} at "
        f"step {f}: a skip moves each source's stream, but the weights would still fill these "
        f"slots from {source!r}; change the weights instead"
    )
    c = cause["load_step"]
    if c is None:
        return f"{said} (no complete checkpoint before step {step} to roll back to)"
    weights = ", ".join(f"{n} = {w}" for n, w in cause["entry"]["weights"].items())
    return (
        f"{said}: --checkpoint.load_step {c} with, in the mixture file, the [[schedule]] "
        f"entries at or before step {c} kept and then from_step = {c + 1}, weights = "
        f"{{ {weights} }} (the weights before step {f})"
    )


def _left_out_lines(data: StepData, step: int, from_step: int) -> list[str]:
    """The ``zephon.exclude`` lines that leave out step ``step``'s samples from
    ``from_step`` on: one per source (``source`` named only for a mixture)."""
    ids: dict[str, list[int]] = {}
    for s in step_samples(data, step, max_chars=1)["samples"]:
        ids.setdefault(s["source"], []).append(int(s["sample"]))
    mixture = data.config.mixture is not None
    return [
        json.dumps(
            ({"source": name} if mixture else {}) | {"ids": sorted(v), "from_step": from_step}
        )
        for name, v in ids.items()
    ]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "spikes",
        help="loss spikes of a run, their data and a rollback with a skip",
        description="List the steps whose training loss (TensorBoard "
        f"{runs.LOSS_TAG}) exceeds the median of the trailing window by more than k robust "
        "standard deviations (1.4826 x MAD). The first steps, with fewer than --window "
        f"before them, use those they have once there are {MIN_WINDOW}. For each spike P: "
        "zephon show's summary of step P and a rollback to the newest checkpoint C <= "
        f"P - {ROLLBACK_MARGIN}: --checkpoint.load_step C --zephon.skip_steps "
        f"(C+1):(P-C+{ROLLBACK_MARGIN}).",
    )
    p.add_argument("run", metavar="RUN", help="a run folder (TorchTitan dump folder)")
    p.add_argument("--k", type=positive_float, default=K, help=f"robust sigmas (default {K:g})")
    p.add_argument(
        "--window", type=int_in(MIN_WINDOW), default=WINDOW, metavar="W",
        help=f"trailing window in logged steps (default {WINDOW})",
    )  # fmt: skip
    p.add_argument(
        "--store", metavar="STORE", help="where the run's store is (as zephon show --store)"
    )
    p.add_argument(
        "--mixture", metavar="FILE", help="the run's mixture file (as zephon show --mixture)"
    )
    p.add_argument("--tokenizer", metavar="DIR", help="decode with this tokenizer (as zephon show)")
    add_exclude_argument(p, " (as zephon show --exclude)")
    p.add_argument(
        "--max-chars", type=int_in(0), default=SUMMARY_CHARS, metavar="C",
        help=f"characters of text per sample in the summary (default {SUMMARY_CHARS}; 0: all)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON object per spike")
    return p


def _losses(run: Path) -> dict[int, float]:
    files = runs.event_files(run)
    if not files:
        raise ShowError(
            f"no TensorBoard events under {run}/tb/: zephon spikes reads the training loss "
            "from them; train with --metrics.enable_tensorboard (TOML: [metrics] "
            "enable_tensorboard = true)."
        )
    losses = runs.read_scalars(run)
    if not losses:
        raise ShowError(
            f"the TensorBoard events under {run}/tb/ ({len(files)} file"
            f"{'s' * (len(files) != 1)}) hold no {runs.LOSS_TAG!r} scalar: no training step "
            "was logged yet (metrics.log_freq?)."
        )
    return losses


def run(args: argparse.Namespace) -> int:
    run_dir = runs.require_run(args.run)
    losses = _losses(run_dir)
    spikes = find_spikes(losses, args.k, args.window)
    ns = argparse.Namespace(
        target=str(run_dir), store=args.store, mixture=args.mixture, tokenizer=args.tokenizer,
        seq_len=None, global_batch_size=None, seed=None, skip_steps=SkipSteps(), heldout_samples=0,
        exclude=args.exclude,
    )  # fmt: skip
    data: StepData | None = None
    problem = None
    if spikes:
        try:
            data = open_step_data(ns, "spikes")
        except ValueError as e:  # the losses are still worth listing
            problem = str(e)
    folder = checkpoint_folder(run_dir)
    ckpts = [c.step for c in runs.checkpoints(run_dir, folder) if c.complete]
    skips = data.skips if data is not None else SkipSteps()
    if not args.json:
        first, last = min(losses), max(losses)
        print(
            f"{run_dir}: {len(losses)} logged steps ({first}..{last}), {len(spikes)} spike"
            f"{'s' * (len(spikes) != 1)} above median + {args.k:g} x 1.4826 x MAD of the "
            f"trailing {args.window} steps"
        )
    if data is not None:
        say_notes(data, "spikes")
    if problem:
        print(
            f"zephon spikes: note: the data of the spikes is not shown: {problem}", file=sys.stderr
        )
    for spike in spikes:
        p = spike["step"]
        back = rollback(p, ckpts, skips)
        early = [c for c in ckpts if c <= p - ROLLBACK_MARGIN]
        if data is not None:
            spike["data"] = step_samples(data, p, max_chars=args.max_chars)
        cause = (
            schedule_cause(data, p, spike["data"]["samples"], ckpts) if data is not None else None
        )
        if cause is not None:  # a skip would not change the source: the weights would
            spike["rollback"] = None
            spike["schedule"] = cause
            advice = _schedule_advice(cause, p, len(spike["data"]["samples"]))
        elif back is not None:
            c, value = back
            spike["rollback"] = {"load_step": c, "skip_steps": value}
            advice = f"roll back: --checkpoint.load_step {c} --zephon.skip_steps {value}"
        elif early:  # every early checkpoint lies before a trained skip covering step P
            spike["rollback"] = None
            c = max(early)
            lines = _left_out_lines(data, p, c + 1) if data is not None else None
            spike["exclude"] = {"load_step": c, "lines": lines}
            advice = (
                f"no skip from a checkpoint at or before step {p - ROLLBACK_MARGIN} changes "
                f"step {p}'s data: it lies inside the trained skip range up to step "
                f"{skips.reach(c) - 1}; leave its samples out instead: --checkpoint.load_step "
                f"{c} --zephon.exclude FILE, FILE holding "
                + (
                    " and ".join(lines)
                    if lines is not None
                    else f"the ids `zephon show {run_dir} --step {p} --json` lists, with "
                    f'"from_step": {c + 1}'
                )
            )
        else:
            spike["rollback"] = None
            advice = (
                f"no complete checkpoint at or before step {p - ROLLBACK_MARGIN} in "
                f"{run_dir / folder} (checkpoints: {', '.join(map(str, ckpts)) or 'none'}): "
                "no rollback to suggest"
            )
        if args.json:
            print(json.dumps(spike, ensure_ascii=False))
            continue
        print(
            f"step {p}: loss {spike['loss']:.4f}, {spike['score']:.1f} sigmas above the "
            f"trailing median {spike['median']:.4f} (sigma {spike['sigma']:.4f})"
        )
        if "data" in spike:
            for s in spike["data"]["samples"]:
                print("\n".join(format_sample(s, "    ")))
        print(f"  {advice}")
    return 0
