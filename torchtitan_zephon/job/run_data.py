"""What a run folder records of its job's data, for Zephon's own tools.

At every accepted start (a fresh start or a resume), global rank 0 writes
``<dump_folder>/zephon/run_data.json``: the store as given (``zephon.store``) and as
opened (a prepared store's folder or URL; raw inputs' cache entry), or the mixture
file and each source's opened store, the tokenizer folder (``hf_assets_path``), the
left-out list (``zephon.exclude``), the checkpoint folder and the data config. It is
replaced whole (written aside, then renamed) at each start, so it describes the
newest job. ``zephon show`` / ``where`` / ``spikes`` / ``inspect`` read it: the run
folder alone finds the run's data, with or without TorchTitan's saved job config
(``--debug.save_config_file``).

Invariant: no secret reaches the file: every location in it passes
``store.location.scrub`` (a URL's user info and query string redacted, the value of
every secret variable removed). The trainer writes it only once the start is
accepted, so a refused start writes nothing. A missing or unreadable file reads as
``{}``: the tools then fall back to the saved job config and the builtin store.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torchtitan_zephon.store.urls import scrub

RUN_DATA = "run_data.json"
"""The file's name in the run folder's ``zephon/`` (beside the sequence log)."""
FORMAT = "zephon-run-data/1"


def run_data_path(dump_folder: str | os.PathLike) -> Path:
    return Path(dump_folder) / "zephon" / RUN_DATA


def _location(value: Any) -> str:
    return scrub(str(value)) if value else ""


def write_run_data(
    dump_folder: str | os.PathLike,
    *,
    store: str,
    opened: str,
    mixture: str,
    sources: dict[str, str],
    tokenizer: str,
    exclude: str,
    checkpoint_folder: str,
    data_config: dict[str, Any],
) -> Path:
    """Write the record (atomically); returns its path. ``store``/``mixture``/``exclude``:
    the settings as the job was given them; ``opened``: the store the job opened (its
    folder or URL), ``sources``: each mixture source's."""
    path = run_data_path(dump_folder)
    record = {
        "format": FORMAT,
        "store": {"given": _location(store), "opened": _location(opened)} if not mixture else None,
        "mixture": (
            {"given": _location(mixture), "sources": {n: _location(s) for n, s in sources.items()}}
            if mixture
            else None
        ),
        "tokenizer": _location(tokenizer and os.path.abspath(tokenizer)),
        "exclude": _location(exclude and os.path.abspath(exclude)),
        "checkpoint_folder": checkpoint_folder,
        "data_config": data_config,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{RUN_DATA}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def record_job(
    dump_folder: str | os.PathLike,
    zephon: Any,
    *,
    tokenizer: str,
    checkpoint_folder: str,
    data: Any,
    data_config: dict[str, Any],
) -> Path:
    """``write_run_data`` for a job: its ``zephon`` settings (store, mixture, exclude)
    and the job's data as opened (``job.data.JobData``)."""
    sources: dict[str, str] = {}
    opened = ""
    if data.mixture is not None:
        sources = {n: str(s.path) for n, s in zip(data.names, data.stores, strict=True)}
    else:
        opened = str(data.stores[0].path)
    return write_run_data(
        dump_folder,
        store=str(getattr(zephon, "store", "") or ""),
        opened=opened,
        mixture=str(getattr(zephon, "mixture", "") or ""),
        sources=sources,
        tokenizer=tokenizer or "",
        exclude=str(getattr(zephon, "exclude", "") or ""),
        checkpoint_folder=checkpoint_folder,
        data_config=data_config,
    )


def read_run_data(run: str | os.PathLike) -> dict[str, Any]:
    """The run's record ({} when there is none, or it cannot be read)."""
    try:
        data = json.loads(run_data_path(run).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) and data.get("format") == FORMAT else {}


def recorded(data: dict[str, Any], *keys: str) -> str:
    """``data[k1][k2]...`` when it is a string, else "" (missing, or another type)."""
    value: Any = data
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, str) else ""
