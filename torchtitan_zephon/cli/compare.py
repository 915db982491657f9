"""``zephon compare RUN_A RUN_B [RUN_C ...]``: are the loss curves the same?

Reads each run's training loss (TensorBoard events, else its train.log; a
resumed run's rewritten steps supersede the interrupted job's), aligns every
run with RUN_A over their common steps and reports the largest absolute and
relative difference, overall and after each resume point (the ``from_step`` of
the resume events in the runs' sequence logs).

Each pair is told where its curves separate (the first step whose losses are not
the same bits). Two runs that both ran with ``zephon.reproducible`` at one
micro-batch size (``training.local_batch_size``) and one data config, by their
sequence logs, are expected to be equal to the bit, whatever their DP degrees,
torchft groups or resumes: unless a tolerance is given, theirs is 0, and the report
says so. When other curves separate and the sequence logs show the same data
(``zephon verify``'s comparison), the report says the difference is the summation
order of the gradients, not the data, and why the pair is outside the bitwise
guarantee (a run without the setting, another micro-batch size).

Invariant: a step passes when ``|b - a| <= atol + rtol * |a|`` (a = RUN_A's loss;
rtol 1e-5 and atol 0 by default, both 0 for a bitwise pair);
exit 0 exactly when every run shares at least one step with RUN_A and all
common steps pass, 1 otherwise, 2 for a missing or unreadable run.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan_zephon.cli.verify import compare_logs
from torchtitan_zephon.run.recorded import RunError, log_reader, losses, resumes, sequence_log


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "compare",
        help="compare loss curves of 2+ runs (max difference, verdict, picture)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders; the first is the reference")
    p.add_argument(
        "--rtol",
        type=float,
        default=None,
        help="relative tolerance (default 1e-5; 0 for two zephon.reproducible runs)",
    )
    p.add_argument(
        "--atol", type=float, default=None, help="absolute tolerance (default 0)"
    )  # fmt: skip
    p.add_argument("--plot", metavar="FILE.png", help="write the curves and differences as a PNG")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


# ---------------------------------------------------------------- reading


def run_resume_points(run: str | Path) -> list[int]:
    """Steps a run resumed from (empty when it has no sequence log)."""
    try:
        log = sequence_log(run)
    except RunError:
        return []
    return sorted({int(e["from_step"]) for e in resumes(log) if e.get("from_step") is not None})


@dataclass(frozen=True)
class Training:
    """How a run trained, by the start and resume events of its effective history."""

    reproducible: bool
    """Every job of the run ran with ``zephon.reproducible``."""
    micro_batches: tuple[int, ...]
    """The ``training.local_batch_size`` values it ran with."""
    data_config: str | None
    """Its data config's fingerprint (None: not recorded, or it changed)."""

    def describe(self) -> str:
        sizes = ", ".join(map(str, self.micro_batches)) or "not recorded"
        setting = "zephon.reproducible" if self.reproducible else "without zephon.reproducible"
        return f"{setting}, local batch size {sizes}"


def run_training(run: str | Path) -> Training | None:
    """How ``run`` trained (None: it has no readable sequence log)."""
    try:
        events = sequence_log(run).events
    except RunError:
        return None
    starts = [i for i, e in enumerate(events) if e.get("event") == "start"]
    jobs = [
        e for e in events[starts[-1] if starts else 0 :] if e.get("event") in ("start", "resume")
    ]
    if not jobs:
        return None
    prints = {e.get("data_config_fingerprint") for e in jobs}
    return Training(
        reproducible=all(e.get("reproducible") is True for e in jobs),
        micro_batches=tuple(
            sorted({int(e["local_batch_size"]) for e in jobs if "local_batch_size" in e})
        ),
        data_config=prints.pop() if len(prints) == 1 else None,
    )


def bitwise_pair(a: Training | None, b: Training | None) -> bool:
    """Whether two runs are expected to log the same bits: both reproducible, at one
    micro-batch size, of one data config."""
    return (
        a is not None
        and b is not None
        and a.reproducible
        and b.reproducible
        and len(a.micro_batches) == 1
        and a.micro_batches == b.micro_batches
        and a.data_config is not None
        and a.data_config == b.data_config
    )


def _same_data(a: Path, b: Path) -> str | None:
    """``zephon verify``'s verdict on two runs' sequence logs (None: one has none)."""
    try:
        return str(compare_logs(log_reader(a), log_reader(b))["verdict"])
    except ValueError:  # RunError, a record the reader refuses (TrackerError)
        return None


def _why(a: Training | None, b: Training | None, labels: tuple[str, str]) -> str:
    """Why a pair of runs is outside the bitwise guarantee."""
    for t, label in zip((a, b), labels, strict=True):
        if t is None:
            return f"{label} has no sequence log saying how it trained"
        if not t.reproducible:
            return f"{label} ran without zephon.reproducible"
    assert a is not None and b is not None
    if a.micro_batches != b.micro_batches or len(a.micro_batches) != 1:
        return (
            f"the micro-batch size differs ({labels[0]}: {', '.join(map(str, a.micro_batches))}; "
            f"{labels[1]}: {', '.join(map(str, b.micro_batches))}), outside zephon.reproducible's "
            "guarantee"
        )
    return "their data configs differ"


def _label(runs: list[Path]) -> list[str]:
    names = [p.resolve().name or str(p) for p in runs]
    return [str(p) if names.count(n) > 1 else n for p, n in zip(runs, names, strict=True)]


# ---------------------------------------------------------------- comparing


def _passes(a: float, b: float, rtol: float, atol: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(b - a) <= atol + rtol * abs(a)


def _diffs(ref: dict[int, float], other: dict[int, float], steps: list[int]) -> dict[str, Any]:
    """Largest absolute and relative difference over ``steps`` (None when empty)."""
    max_abs = max_rel = 0.0
    at_abs = at_rel = None
    for s in steps:
        a, b = ref[s], other[s]
        d = abs(b - a) if not (math.isnan(a) and math.isnan(b)) else 0.0
        r = d / abs(a) if a != 0 else (0.0 if d == 0 else math.inf)
        if at_abs is None or d > max_abs or math.isnan(d):
            max_abs, at_abs = d, s
        if at_rel is None or r > max_rel or math.isnan(r):
            max_rel, at_rel = r, s
    if not steps:
        return {"steps": 0, "max_abs": None, "max_rel": None}
    return {
        "steps": len(steps),
        "max_abs": max_abs,
        "max_abs_step": at_abs,
        "max_rel": max_rel,
        "max_rel_step": at_rel,
    }


def _same_bits(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def compare_losses(
    series: list[dict[int, float]],
    labels: list[str],
    resume_points: list[list[int]],
    *,
    rtol: float | None,
    atol: float | None,
    bitwise: list[bool] | None = None,
) -> dict[str, Any]:
    """The compare report (``--json`` object): each run after the first against the first.
    ``bitwise[i]``: run i and the first are expected to be equal to the bit (their
    tolerance is 0 unless one is given)."""
    ref = series[0]
    pairs = []
    default_rtol, default_atol = (1e-5 if rtol is None else rtol), (0.0 if atol is None else atol)
    for i in range(1, len(series)):
        other = series[i]
        exact = bool(bitwise and bitwise[i])
        p_rtol = (0.0 if exact else 1e-5) if rtol is None else rtol
        p_atol = 0.0 if atol is None else atol
        common = sorted(set(ref) & set(other))
        differ = [s for s in common if not _same_bits(ref[s], other[s])]
        failing = [s for s in common if not _passes(ref[s], other[s], p_rtol, p_atol)]
        points = sorted(set(resume_points[0]) | set(resume_points[i]))
        after = [
            {"from_step": k, **_diffs(ref, other, [s for s in common if s > k])} for k in points
        ]
        if not common:
            verdict = "no-overlap"
        else:
            verdict = "pass" if not failing else "fail"
        pairs.append(
            {
                "run": labels[i],
                "steps_compared": len(common),
                "first_step": common[0] if common else None,
                "last_step": common[-1] if common else None,
                "overall": _diffs(ref, other, common),
                "after_resume": after,
                "failing_steps": len(failing),
                "first_failing_step": failing[0] if failing else None,
                "first_differing_step": differ[0] if differ else None,
                "expected": "bits" if exact else "tolerance",
                "rtol": p_rtol,
                "atol": p_atol,
                "verdict": verdict,
            }
        )
    ok = all(p["verdict"] == "pass" for p in pairs)
    return {
        "reference": labels[0],
        "rtol": default_rtol,
        "atol": default_atol,
        "resume_points": dict(zip(labels, resume_points, strict=True)),
        "comparisons": pairs,
        "verdict": "pass" if ok else "fail",
    }


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def format_report(r: dict[str, Any], sources: list[str]) -> str:
    lines = [f"reference: {r['reference']} (losses from {sources[0]})"]
    tol = f"|b - a| <= {r['atol']:g} + {r['rtol']:g} * |a|"
    for p, source in zip(r["comparisons"], sources[1:], strict=True):
        o = p["overall"]
        lines.append(f"{p['run']} (losses from {source}):")
        if not p["steps_compared"]:
            lines.append("   no step in common with the reference")
        else:
            lines.append(
                f"   steps {p['first_step']}..{p['last_step']} ({p['steps_compared']} common): "
                f"max |diff| {_fmt(o['max_abs'])} (step {o['max_abs_step']}), "
                f"max rel {_fmt(o['max_rel'])} (step {o['max_rel_step']})"
            )
        for a in p["after_resume"]:
            if a["steps"]:
                lines.append(
                    f"   after resume at step {a['from_step']} ({a['steps']} steps): "
                    f"max |diff| {_fmt(a['max_abs'])}, max rel {_fmt(a['max_rel'])}"
                )
            else:
                lines.append(f"   after resume at step {a['from_step']}: no common steps")
        pair_tol = f"|b - a| <= {p['atol']:g} + {p['rtol']:g} * |a|"
        if p["expected"] == "bits":
            lines.append(
                f"   both ran with zephon.reproducible at one micro-batch size and one data "
                f"config: equal to the bit expected ({pair_tol})"
            )
        if p["steps_compared"]:
            first = p["first_differing_step"]
            lines.append(
                "   the same bits at every common step"
                if first is None
                else f"   the curves separate at step {first} (its losses differ in their bits)"
            )
        if p.get("explanation"):
            lines.append(f"   {p['explanation']}")
        if p["verdict"] == "fail":
            lines.append(
                f"   {p['failing_steps']} step(s) outside {pair_tol}, first at step "
                f"{p['first_failing_step']}"
            )
        lines.append(f"   -> {p['verdict'].upper()}")
    pairs = r["comparisons"]
    if pairs and all(p["expected"] == "bits" for p in pairs):
        tol = "|b - a| <= "
        tol += f"{pairs[0]['atol']:g} + {pairs[0]['rtol']:g} * |a|"
        tol += " (to the bit)" if pairs[0]["rtol"] == pairs[0]["atol"] == 0 else ""
    verdict = (
        "PASS: all curves agree within"
        if r["verdict"] == "pass"
        else "FAIL: not all curves agree within"
    )
    lines.append(f"verdict: {verdict} {tol}")
    return "\n".join(lines)


def _explain(
    a: Path, b: Path, ta: Training | None, tb: Training | None, labels: tuple[str, str], exact: bool
) -> str:
    """What a separation of two curves means, given what verify says of their data."""
    verdict = _same_data(a, b)
    if verdict != "match":
        seen = "cannot be compared" if verdict is None else f"verify: {verdict.upper()}"
        return (
            f"the data is not shown to be the same ({seen}): run `zephon verify {a} {b}` "
            "before reading the curves"
        )
    if exact:
        return (
            "the data is the same (verify: MATCH) and both runs are reproducible: a "
            "difference in the bits is not summation order but a change in what was trained "
            "(a learning rate, an optimizer state, a setting outside the data config)"
        )
    return (
        "the data is the same (verify: MATCH): the difference is the summation order of "
        f"the gradients, not the data ({_why(ta, tb, labels)})"
    )


# ---------------------------------------------------------------- picture

PLOT_SIZE = (10.0, 6.5)  # inches
PLOT_DPI = 100


def plot(
    path: str | Path,
    series: list[dict[int, float]],
    labels: list[str],
    resume_points: list[list[int]],
    report: dict[str, Any],
) -> Path:
    """Loss curves overlaid (resume points as vertical lines), differences vs RUN_A below.

    The PNG is ``PLOT_SIZE * PLOT_DPI`` pixels.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=PLOT_SIZE, dpi=PLOT_DPI, sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    ref = series[0]
    for i, (s, label) in enumerate(zip(series, labels, strict=True)):
        steps = sorted(s)
        c = colors[i % len(colors)]
        top.plot(
            steps,
            [s[k] for k in steps],
            styles[i % len(styles)],
            color=c,
            lw=2.2 if i == 0 else 1.4,
            marker="o" if len(steps) <= 60 else None,
            ms=3,
            label=label + (" (reference)" if i == 0 and label != "reference" else ""),
        )
        if i:
            common = sorted(set(ref) & set(s))
            bottom.plot(
                common, [s[k] - ref[k] for k in common], styles[i % len(styles)], color=c,
                marker="o" if len(common) <= 60 else None, ms=3, label=f"{label} - {labels[0]}",
            )  # fmt: skip
    seen = set()
    for i, points in enumerate(resume_points):
        for k in points:
            for ax in (top, bottom):
                ax.axvline(k, color=colors[i % len(colors)], ls=":", lw=1.2, alpha=0.8)
            if (k, i) not in seen:
                seen.add((k, i))
                top.annotate(
                    f"resume from step {k}\n[{labels[i]}]", xy=(k, 1.0), xycoords=("data", "axes fraction"),
                    xytext=(4, -4), textcoords="offset points", va="top", fontsize=8,
                    color=colors[i % len(colors)],
                )  # fmt: skip
    top.set_ylabel("training loss")
    top.grid(alpha=0.3)
    top.legend(loc="upper right", fontsize=9)
    verdict = report["verdict"].upper()
    worst = max(
        (p["overall"]["max_rel"] or 0.0 for p in report["comparisons"] if p["steps_compared"]),
        default=0.0,
    )
    top.set_title(
        f"Loss curves: {verdict} (max relative difference {worst:.2g}, "
        f"rtol {report['rtol']:g}, atol {report['atol']:g})"
    )
    bottom.axhline(0.0, color="black", lw=0.8)
    bottom.set_ylabel(f"loss - {labels[0]}")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    bottom.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if len(series) > 1:
        bottom.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> int:
    if len(args.runs) < 2:
        raise ValueError("give at least two runs: RUN_A (the reference) and RUN_B")
    given = [t for t in (args.rtol, args.atol) if t is not None]
    if not all(0 <= t < math.inf for t in given):  # also refuses nan
        raise ValueError(
            f"tolerances must be finite and >= 0, got rtol {args.rtol}, atol {args.atol}"
        )
    runs = [Path(r) for r in args.runs]
    read = [losses(r) for r in runs]
    series, sources = [v for v, _ in read], [src for _, src in read]
    labels = _label(runs)
    points = [run_resume_points(r) for r in runs]
    trained = [run_training(r) for r in runs]
    bitwise = [False] + [bitwise_pair(trained[0], t) for t in trained[1:]]
    report = compare_losses(series, labels, points, rtol=args.rtol, atol=args.atol, bitwise=bitwise)
    for i, pair in enumerate(report["comparisons"], start=1):
        pair["training"] = {
            labels[0]: trained[0].describe() if trained[0] else None,
            labels[i]: trained[i].describe() if trained[i] else None,
        }
        if pair["first_differing_step"] is not None:
            pair["explanation"] = _explain(runs[0], runs[i], trained[0], trained[i],
                                           (labels[0], labels[i]), bitwise[i])  # fmt: skip
    report["sources"] = dict(zip(labels, sources, strict=True))
    if args.plot:
        report["plot"] = str(plot(args.plot, series, labels, points, report))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report, sources))
        if args.plot:
            print(f"plot: {report['plot']}")
    return 0 if report["verdict"] == "pass" else 1
