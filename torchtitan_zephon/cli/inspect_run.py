"""``zephon inspect`` for run folders and DCP checkpoint folders.

A run folder (TorchTitan ``job.dump_folder``) is summarised from what it holds:
the saved job config if any (TorchTitan 0.3 saves it only with
``--debug.save_config_file``), what Zephon recorded of the job's data at its newest
start (``zephon/run_data.json``: store, tokenizer, left-out list), its checkpoints (complete when DCP wrote
``.metadata``, which it writes last; corrupt when a shard is missing or shorter
than ``.metadata`` says; model-only), the Zephon data state of the latest
complete one, the sequence log (effective records, resume history with
topologies, the skips that took effect), the job holding the folder's lock if any, and the loss range in its
TensorBoard events. A checkpoint folder (``checkpoint/step-N``) is summarised by
its status and data state. For a mixture, each source's samples drawn by the
checkpointed steps against its exact target and the epoch it is in, computed
from the data state and the plan (O(1) in the step: nothing is replayed).

Invariant: inspecting reads only; a part that is missing or unreadable is
reported as such in its field, never as a traceback.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from torchtitan_zephon.job.run_data import read_run_data, recorded, run_data_path
from torchtitan_zephon.order.data_config import DataConfig
from torchtitan_zephon.order.exclusions import describe_saved
from torchtitan_zephon.order.state import DataState
from torchtitan_zephon.run import recorded as runs
from torchtitan_zephon.run.holder import lock_path, read_holder

_STEP_DIR = re.compile(r"step-(\d+)")


# ---------------------------------------------------------------- detection


def is_checkpoint(path: Path) -> bool:
    """A DCP folder: ``.metadata`` or ``*.distcp`` shards (a ``step-N`` folder may be incomplete)."""
    if not path.is_dir():
        return False
    return (path / ".metadata").is_file() or any(path.glob("*.distcp"))


def is_run(path: Path) -> bool:
    """A TorchTitan dump folder with at least one of checkpoint/, tb/ or the sequence log."""
    if not path.is_dir():
        return False
    return (
        (path / "checkpoint").is_dir()
        or (path / "tb").is_dir()
        or (path / "zephon" / "sequence_log.jsonl").is_file()
    )


# ---------------------------------------------------------------- describing


def _data_state(checkpoint: Path) -> dict[str, Any]:
    """The checkpoint's Zephon record, or ``{"error": ...}`` when it cannot be read."""
    try:
        state = runs.read_data_state(checkpoint)
    except Exception as e:  # noqa: BLE001 - a DCP folder can be broken in many ways
        return {"error": str(e) or type(e).__name__}
    return state.to_dict()


def _mixture(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """Per source of a mixture's data state: realized vs target samples and epoch."""
    if not state or "error" in state:
        return None
    from torchtitan_zephon.job.plans import mixture_progress

    try:
        return mixture_progress(DataState.from_dict(state))
    except Exception as e:  # noqa: BLE001 - reported in its field, never raised
        return {"error": str(e) or type(e).__name__}


def _status(c: runs.CheckpointInfo) -> dict[str, Any]:
    return {"status": c.status, "problem": c.problem, "holds": c.holds}


def describe_checkpoint(path: Path) -> dict[str, Any]:
    m = _STEP_DIR.fullmatch(path.name)
    files = [f for f in path.rglob("*") if f.is_file()]
    complete = (path / ".metadata").is_file()
    c = runs.verify_checkpoint(runs.CheckpointInfo(int(m.group(1)) if m else -1, path, complete, 0))
    info: dict[str, Any] = {
        "kind": "checkpoint",
        "path": str(path),
        "step": int(m.group(1)) if m else None,
        "complete": complete,
        **_status(c),
        "bytes": sum(f.stat().st_size for f in files),
        "files": len(files),
    }
    if not complete:
        info["data_state"] = {"error": "incomplete checkpoint (no .metadata): DCP was interrupted"}
    elif c.problem:
        info["data_state"] = {"error": f"corrupt checkpoint: {c.problem}"}
    else:
        info["data_state"] = _data_state(path)
    info["mixture"] = _mixture(info["data_state"])
    return info


_CONFIG_KEYS = {
    "job": ("description",),
    "model": ("name", "flavor"),
    "training": ("steps", "global_batch_size", "local_batch_size", "seq_len", "dtype"),
    "parallelism": ("data_parallel_shard_degree", "tensor_parallel_degree"),
    "checkpoint": ("interval",),
    "zephon": ("store", "mixture", "seed", "audit"),
}


def _config(run: Path) -> dict[str, Any] | None:
    found = runs.saved_config(run)
    if found is None:
        return None
    path, data = found
    summary = {
        f"{section}.{key}": data[section][key]
        for section, keys in _CONFIG_KEYS.items()
        for key in keys
        if isinstance(data.get(section), dict) and key in data[section]
    }
    return {"path": str(path), "summary": summary}


def _recorded(run: Path) -> dict[str, Any] | None:
    """What Zephon recorded of the job's data at the run's newest start."""
    data = read_run_data(run)
    if not data:
        return None
    sources = data["mixture"].get("sources") if recorded(data, "mixture", "given") else None
    return {
        "path": str(run_data_path(run)),
        "store": recorded(data, "store", "given"),
        "store_opened": recorded(data, "store", "opened"),
        "mixture": recorded(data, "mixture", "given"),
        "mixture_sources": sources if isinstance(sources, dict) else {},
        "tokenizer": recorded(data, "tokenizer"),
        "exclude": recorded(data, "exclude"),
        "checkpoint_folder": recorded(data, "checkpoint_folder") or "checkpoint",
    }


def _sequence_log(run: Path) -> dict[str, Any]:
    try:
        log = runs.sequence_log(run)
    except ValueError as e:
        return {"error": str(e)}
    steps = log.steps()
    starts = [runs.topology(e) for e in log.events if e.get("event") == "start"]
    return {
        "path": str(log.path),
        "records": len(steps),
        "first_step": steps[0] if steps else None,
        "last_step": steps[-1] if steps else None,
        "tokens_digests": bool(steps) and all("tokens_digest" in log.records[s] for s in steps),
        "head": {"step": steps[-1], "chain": log.records[steps[-1]]["chain"]} if steps else None,
        "start": starts[-1] if starts else None,
        "resumes": runs.resumes(log),
        "skips": runs.skips(log),
        "packing": _newest_packing(log),
        "truncated_tail": log.truncated_tail,
    }


def _newest_packing(log: Any) -> str | None:
    """The packing of the data config the log's newest start or resume records."""
    events = [e for e in log.events if e.get("event") in ("start", "resume")]
    config = events[-1].get("data_config") if events else None
    if not isinstance(config, dict):
        return None
    try:
        return DataConfig.from_dict(config).packing
    except ValueError:
        return None


def _losses(run: Path) -> dict[str, Any]:
    try:
        values, source = runs.losses(run)
    except Exception as e:  # noqa: BLE001 - unreadable events are reported, not raised
        return {"error": str(e) or type(e).__name__}
    steps = sorted(values)
    vals = [values[s] for s in steps]
    return {
        "source": source,
        "steps": len(steps),
        "first_step": steps[0],
        "last_step": steps[-1],
        "first": vals[0],
        "last": vals[-1],
        "min": min(vals),
        "max": max(vals),
    }


def _owner(run: Path) -> dict[str, Any] | None:
    """The job named by the run folder's lock: alive, dead, or unknown from here."""
    if not lock_path(run).exists():
        return None
    holder = read_holder(run)
    if holder is None:
        return {"error": f"unreadable lock file {lock_path(run)}"}
    p = holder.process
    alive = (p.alive() and "alive") if p.on_this_machine() else None
    return {
        "host": p.host,
        "pid": p.pid,
        "run_id": holder.run_id,
        "since": holder.acquired,
        "lease_s": holder.lease_s,
        "state": alive or ("dead" if p.on_this_machine() else "on another machine"),
    }


def describe_run(path: Path) -> dict[str, Any]:
    record = _recorded(path)
    folder = record["checkpoint_folder"] if record else "checkpoint"
    cks = runs.checkpoints(path, folder, verify=True)
    complete = [c for c in cks if c.status == "complete"]
    latest = complete[-1] if complete else None
    data_state = _data_state(latest.path) if latest else None
    return {
        "kind": "run",
        "path": str(path),
        "config": _config(path),
        "recorded": record,
        "owner": _owner(path),
        "checkpoints": [
            {
                "step": c.step,
                "path": str(c.path),
                "complete": c.complete,
                **_status(c),
                "bytes": c.bytes,
            }
            for c in cks
        ],
        "latest_complete_checkpoint": latest.step if latest else None,
        "data_state": data_state,
        "mixture": _mixture(data_state),
        "sequence_log": _sequence_log(path),
        "loss": _losses(path),
        "event_files": len(runs.event_files(path)),
    }


# ---------------------------------------------------------------- formatting


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _format_data_state(state: dict[str, Any] | None, indent: str = "  ") -> list[str]:
    if state is None:
        return [f"{indent}data state: none (no complete checkpoint)"]
    if "error" in state:
        return [f"{indent}data state: unavailable ({state['error']})"]
    ds = DataState.from_dict(state)
    cfg = ds.config
    lines = [
        f"{indent}data state (format {state.get('format')}):",
        f"{indent}  next step:          {ds.next_step}",
        f"{indent}  consumed positions: {ds.consumed_positions}",
        f"{indent}  store fingerprint:  {cfg.store_fingerprint}",
        f"{indent}  data config:        seq_len {cfg.seq_len}, seed {cfg.seed}, "
        f"{cfg.num_samples} samples, schedule {cfg.batch_schedule()}",
        f"{indent}  data config fingerprint: {cfg.fingerprint}",
    ]
    lines.append(f"{indent}  packing:            {describe_packing(cfg.packing)}")
    lines.append(f"{indent}  skip_steps:         {cfg.skip_steps or '(none)'}")
    lines.append(f"{indent}  left out:           {describe_saved(cfg.exclude)}")
    if ds.tracker:
        lines.append(
            f"{indent}  tracker head:       step {ds.tracker['step']}, chain {ds.tracker['chain']}"
        )
    return lines


def describe_packing(packing: str) -> str:
    """What a data config's ``packing`` makes a sample, for humans."""
    if packing == "none":
        return "none (a sample is a fixed window of the token stream)"
    return f"{packing} (a sample is whole documents packed into seq_len; ids are packed sample ids)"


def _format_mixture(mixture: dict[str, Any] | None, indent: str = "  ") -> list[str]:
    if mixture is None:
        return []
    if "error" in mixture:
        return [f"{indent}mixture: unavailable ({mixture['error']})"]
    rows = [("source", "weight", "drawn", "target", "deviation", "epoch", "per epoch")]
    for s in mixture["sources"]:
        num, _, den = s["target"].partition("/")
        rows.append(
            (
                s["name"],
                s["weight"],
                str(s["samples"]),
                f"{int(num) / int(den or 1):.2f}",
                f"{s['deviation']:+.3f}",
                str(s["epoch"]),
                str(s["num_samples"]),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        f"{indent}mixture at step {mixture['next_step']} ({len(mixture['sources'])} sources; the "
        f"plan's worst deviation over all steps: {mixture['max_deviation']:.3f} samples, "
        f"{mixture['max_deviation_source']!r}):"
    ]
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)
        ]
        lines.append(f"{indent}  " + "  ".join(cells))
    return lines


def _format_status(c: dict[str, Any]) -> str:
    if c["status"] == "incomplete":
        return "INCOMPLETE (no .metadata, skipped on resume)"
    if c["status"] == "corrupt":
        return f"CORRUPT ({c['problem']}; skipped on resume)"
    if c["holds"] == "model":
        return "complete, model only (cannot be resumed)"
    if c["holds"] == "no data state":
        return "complete, no Zephon data state"
    return "complete"


def format_checkpoint(info: dict[str, Any]) -> str:
    status = _format_status(info)
    lines = [
        f"checkpoint: {info['path']}",
        f"  step:   {info['step'] if info['step'] is not None else '?'}",
        f"  status: {status}, {info['files']} files, {_size(info['bytes'])}",
    ]
    lines += _format_data_state(info["data_state"]) + _format_mixture(info.get("mixture"))
    return "\n".join(lines)


def format_run(info: dict[str, Any]) -> str:
    lines = [f"run folder: {info['path']}"]
    cfg = info["config"]
    if cfg:
        lines.append(f"  config: {cfg['path']}")
        lines += [f"    {k} = {v!r}" for k, v in cfg["summary"].items()]
    else:
        lines.append("  config: not saved (TorchTitan saves it only with --debug.save_config_file)")
    rec = info.get("recorded")
    if rec:
        lines.append(f"  data recorded at the newest start: {rec['path']}")
        if rec["mixture"]:
            lines.append(f"    mixture:   {rec['mixture']}")
            lines += [f"      {n}: {loc}" for n, loc in rec["mixture_sources"].items()]
        else:
            given = rec["store"] or "(the builtin store)"
            opened = f" (opened: {rec['store_opened']})" if rec["store_opened"] != given else ""
            lines.append(f"    store:     {given}{opened}")
        lines.append(f"    tokenizer: {rec['tokenizer'] or '(none)'}")
        lines.append(f"    exclude:   {rec['exclude'] or '(none)'}")
    else:
        lines.append("  data recorded: none (no zephon/run_data.json: written at each start)")
    owner = info["owner"]
    if owner and "error" in owner:
        lines.append(f"  owner: {owner['error']}")
    elif owner:
        lines.append(
            f"  owner: host {owner['host']}, pid {owner['pid']} ({owner['state']}; lease "
            f"{owner['lease_s']:g} s, since {owner['since']})"
        )
    cks = info["checkpoints"]
    lines.append(f"  checkpoints ({len(cks)}):")
    for c in cks:
        lines.append(f"    step-{c['step']:<6} {_size(c['bytes']):>10}  {_format_status(c)}")
    if not cks:
        lines.append("    none")
    if info["latest_complete_checkpoint"] is not None:
        lines.append(f"  latest complete checkpoint: step {info['latest_complete_checkpoint']}")
    lines += _format_data_state(info["data_state"], "  ")
    lines += _format_mixture(info.get("mixture"), "  ")
    log = info["sequence_log"]
    if "error" in log:
        lines.append(f"  sequence log: unavailable ({log['error']})")
    else:
        span = f"steps {log['first_step']}..{log['last_step']}" if log["records"] else "no steps"
        digests = "ids + tokens digests" if log["tokens_digests"] else "ids digests"
        lines.append(f"  sequence log: {log['path']}")
        lines.append(f"    {log['records']} effective records, {span}, {digests}")
        if log["head"]:
            lines.append(f"    head: step {log['head']['step']}, chain {log['head']['chain']}")
        if log.get("packing"):
            lines.append(f"    packing: {describe_packing(log['packing'])}")
        if log["start"]:
            lines.append(f"    started at step 0: {runs.format_topology(log['start'])}")
        for r in log["resumes"]:
            lines.append(f"    resumed from step {r['from_step']}: {runs.format_topology(r)}")
        for k in log["skips"]:
            n = k["steps"]
            lines.append(
                f"    skipped at step {k['step']}: the data of {n} step{'s' * (n != 1)} "
                f"({k['step']}..{k['step'] + n - 1})"
            )
        if log["truncated_tail"]:
            lines.append("    last line truncated (a job died mid-write); ignored")
    loss = info["loss"]
    if "error" in loss:
        lines.append(f"  loss: unavailable ({loss['error']})")
    else:
        lines.append(
            f"  loss ({loss['source']}, {info['event_files']} event files): steps "
            f"{loss['first_step']}..{loss['last_step']}, {loss['first']:.5f} -> {loss['last']:.5f} "
            f"(min {loss['min']:.5f}, max {loss['max']:.5f})"
        )
    return "\n".join(lines)


# (kind, detect, describe, format): appended to cli/inspect.py KINDS after the store.
RUN_KINDS = [
    ("checkpoint", is_checkpoint, describe_checkpoint, format_checkpoint),
    ("run", is_run, describe_run, format_run),
]
