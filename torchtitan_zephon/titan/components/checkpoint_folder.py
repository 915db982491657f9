"""What Zephon's trainer does to the run's checkpoint folder besides TorchTitan's saves.

Role: ``move_abandoned``: after a rollback (``--checkpoint.load_step K`` with
checkpoints after K), the abandoned branch's checkpoints are moved aside, so that no
later automatic resume picks them. ``keep_newest``: at a job's clean end, the folder
holds ``checkpoint.keep_latest_k`` checkpoints, as the setting says, asynchronous saves
included (TorchTitan purges when a save starts, before an asynchronous one has written
its folder, so it kept one or two more).

Invariants: a rollback's checkpoints are moved, never deleted, and each move is logged;
a move that fails leaves the job stopped before it trains, with what is left named.
``keep_newest`` removes only checkpoints older than the newest ``k`` whole ones.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from torchtitan.tools.logging import logger

from torchtitan_zephon.run import recorded as runs
from torchtitan_zephon.titan.settings.job_view import JobView


def move_abandoned(job: JobView, abandoned: list[Any]) -> str | None:
    """A rollback (``--checkpoint.load_step K`` with checkpoints after K): at the first
    step, once every rank has loaded checkpoint K and passed every check, rank 0
    (holding the run folder) moves the abandoned branch's checkpoints into the
    checkpoint folder's sibling ``<folder>_abandoned/rollback_to_step_K`` (``.2``, ...
    when a folder of that name exists), whose name TorchTitan's newest-checkpoint rule
    does not count. Moved, not deleted; each move is logged. A move that fails (another
    filesystem, permissions) returns why, naming what is left (the trainer stops before
    it trains); None when every move was made."""
    if not abandoned:
        return None
    k = job.checkpoint.load_step
    folder = (Path(job.dump_folder) / job.checkpoint.folder).resolve()
    base = folder.parent / f"{folder.name}_abandoned"
    dest, n = base / f"rollback_to_step_{k}", 1
    while dest.exists():
        n += 1
        dest = base / f"rollback_to_step_{k}.{n}"
    try:
        dest.mkdir(parents=True)
        for info in abandoned:
            os.replace(info.path, dest / info.path.name)
            logger.info(f"Zephon: moved {info.path} to {dest / info.path.name}")
    except OSError as e:
        left = ", ".join(str(i.path) for i in abandoned if i.path.exists())
        return (
            f"rollback to step {k}: could not move the checkpoints after it out of {folder} "
            f"({type(e).__name__}: {e}); still there: {left or 'none'}. Move them out of "
            f"{folder} by hand (a later automatic resume would pick the newest), then "
            "start again."
        )
    names = ", ".join(info.path.name for info in abandoned)
    logger.warning(
        f"Zephon: rollback to step {k}: the checkpoints after it ({names}) were moved to "
        f"{dest}, so that no later automatic resume picks the abandoned branch"
    )
    return None


def keep_newest(run: str | os.PathLike, folder: str, k: int) -> list[Path]:
    """Remove the checkpoints of ``run``'s checkpoint ``folder`` older than its newest
    ``k`` whole ones (``k`` <= 0: keep all); returns what was removed, each logged. For
    global rank 0 at a clean end, once every save has landed."""
    if k <= 0:
        return []
    found = runs.checkpoints(run, folder)
    whole = [c.step for c in found if c.complete]
    if len(whole) < k:
        return []
    oldest_kept = sorted(whole)[-k]
    removed = []
    for c in found:
        if c.step < oldest_kept:
            shutil.rmtree(c.path, ignore_errors=True)
            removed.append(c.path)
    if removed:
        logger.info(
            f"Zephon: removed {', '.join(p.name for p in removed)} (checkpoint.keep_latest_k "
            f"{k}: the newest {k} are kept; TorchTitan's purge runs before an asynchronous "
            "save has written its folder)"
        )
    return removed
