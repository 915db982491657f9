"""The store cache folder, and the one way an entry is made in it: built once, under a lock.

Role: where the cache lives (``cache_root``) and how an entry, a store folder in it
(``cache.raw_store``'s raw inputs, ``builtin``'s parts), is made (``build_once``):
under an exclusive ``fcntl.flock`` on ``<entry>.lock`` beside it, the holder builds
the store into a staging folder and renames it into place, writing its progress there
(``BuildProgress``); every other process waits on the lock, saying how far the holder
has come (refreshed every few seconds while it moves), and then finds the entry.

Invariants:
- An entry that exists is complete: it appears by one rename, after its build
  succeeded. A build that fails leaves no entry and the lock is released (the
  kernel drops it if the process dies); prepare's finished tokenized units stay in the
  staging folder ``.<entry>.building`` (its message names them), so the next
  holder continues where it stopped; with nothing finished the folder goes.
- A lock file exists only while a process uses it (or, after a holder was killed,
  until the next one): the holder removes it before releasing it, and a process
  that then holds the removed file starts over on the path (lock, then compare
  the inode), so two processes never both hold the lock.
- Under the lock one process builds an entry: once per machine with the cache on
  local disk, once per cluster on a shared filesystem whose ``flock`` works
  across machines. Where ``flock`` is unavailable (the filesystem refuses it)
  every process builds into a staging folder of its own and the first rename
  wins; entries are deterministic, so the result is the same, only the work is
  repeated.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchtitan_zephon.store.format import MANIFEST, StoreError

CACHE_ENV = "ZEPHON_CACHE"
WAIT_REPORT_S = 30.0
"""How often a process waiting for another's build says so."""

Log = Callable[[str], None]


def cache_root(configured: str = "") -> Path:
    """``$ZEPHON_CACHE``, else ``configured`` (the trainer's ``zephon.cache_dir``), else
    ``~/.cache/torchtitan_zephon``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "torchtitan_zephon"


def _holder() -> str:
    return f"{socket.gethostname()} pid {os.getpid()}"


# flock refused by the filesystem (not "held by another process").
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF}


def _wait_for_lock(fh, what: str, log: Log | None, progress: Path) -> bool:  # noqa: ANN001
    """Take the exclusive lock on the open file ``fh``, reporting the holder and its
    progress (``progress``, the holder's ``BuildProgress`` file) while waiting: at once,
    then every ``PROGRESS_REPORT_S`` while the progress moves, at least every
    ``WAIT_REPORT_S``. False: the filesystem refuses flock."""
    start = time.monotonic()
    reported: float | None = None
    said = ""
    delay = 0.05
    while True:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError as e:
            if e.errno in _NO_FLOCK:
                return False
            raise
        if log is not None:
            now = time.monotonic()
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            doing = _progress_of(progress, holder)
            due = reported is None or now - reported >= WAIT_REPORT_S
            if due or (doing != said and now - reported >= PROGRESS_REPORT_S):
                log(
                    f"waiting for {holder} to prepare {what}{': ' + doing if doing else ''} "
                    f"({now - start:.0f} s so far; its lock: {fh.name})"
                )
                reported, said = now, doing
        time.sleep(delay)
        delay = min(PROGRESS_REPORT_S / 5, 1.0, delay * 2)


PROGRESS_FILE = "progress.json"
"""In a build's staging folder: what its holder has done so far (``BuildProgress``)."""
PROGRESS_WRITE_S = 1.0
"""How often at most the holder rewrites its progress file (and at each new phase)."""
PROGRESS_REPORT_S = 5.0
"""How often a waiting process says how far the holder has come, while it moves."""


class BuildProgress:
    """The progress of the build that holds an entry's lock, for the processes waiting on
    it: ``progress.json`` in the build's staging folder, replaced atomically (at most
    every ``PROGRESS_WRITE_S``, and at each new phase), naming its holder so a file left
    by an earlier, killed holder is never taken for the current one's."""

    def __init__(self, staging: Path) -> None:
        self.path = staging / PROGRESS_FILE
        self._tmp = staging / f".{PROGRESS_FILE}.{os.getpid()}"
        self._phase: Any = None
        self._written = -math.inf

    def __call__(self, state: dict[str, Any]) -> None:
        now = time.monotonic()
        if state.get("phase") == self._phase and now - self._written < PROGRESS_WRITE_S:
            return
        self._phase, self._written = state.get("phase"), now
        try:
            self._tmp.write_text(json.dumps({**state, "holder": _holder()}))
            os.replace(self._tmp, self.path)
        except OSError:  # progress is a courtesy: it never fails a build
            pass

    def remove(self) -> None:
        """Remove the progress file (and any half-written one, a killed holder's too)."""
        for p in (self.path, *self.path.parent.glob(f".{PROGRESS_FILE}.*")):
            try:
                p.unlink(missing_ok=True)
            except OSError:
                pass


def _progress_of(path: Path, holder: str) -> str:
    """What the build of ``holder`` says it has done (``BuildProgress``), or ""."""
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(state, dict) or state.get("holder") != holder:
        return ""
    return describe_progress(state)


def describe_progress(state: dict[str, Any]) -> str:
    """One line for a prepare's progress (``prepare_store``'s ``on_progress`` states)."""
    phase = state.get("phase")
    if phase == "assembling":
        return "assembling the store (copying its tokenized units, hashing the inputs)"
    if phase != "tokenizing":
        return "starting (reading the inputs' listing)"
    try:
        done, total = int(state["bytes_done"]), int(state["bytes"])
        units = f"{int(state['units_done'])} of {int(state['units'])} units"
        documents = int(state["documents"])
    except (KeyError, TypeError, ValueError):
        return "tokenizing"
    percent = 100 * done / total if total else 100.0
    return (
        f"tokenizing, {units} done, {_mib(done)} of {_mib(total)} of input ({percent:.0f}%), "
        f"{documents:,} documents"
    )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def _lock_is(fh, path: Path) -> bool:  # noqa: ANN001 - a file object
    """Whether the open lock file ``fh`` is still the file at ``path``: a holder removes
    its lock file before releasing it, so a process that waited on the old file must
    lock the one at the path now (or find the entry)."""
    try:
        return os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino
    except FileNotFoundError:
        return False


def build_once(
    out: Path,
    build: Callable[[Path, Callable[[dict[str, Any]], None]], None],
    *,
    what: str = "a store",
    log: Log | None = None,
    work: str = "",
) -> Path:
    """The entry ``out`` (a store folder in the cache), built by ``build(dest, progress)``
    on first use.

    ``work`` names the lock and the staging folder (default: the entry's name): entries
    that are versions of the same inputs share them, so a build after a failed one of
    an earlier version finds its finished work.

    ``build`` must create a complete store at ``dest`` (a path that does not exist
    yet) or raise, telling ``progress`` how far it has come (``prepare_store``'s
    ``on_progress`` states); the store is then renamed to ``out``. ``what`` and ``log``
    name the work in the messages of processes that wait for it.

    The lock file ``<work>.lock`` exists only while someone uses it: its holder removes
    it before releasing it, and a process that then gets the lock on the removed file
    sees that (``_lock_is``) and starts over on the file at the path, so there is never
    more than one lock to hold.
    """
    if (out / MANIFEST).is_file():
        return out
    root = out.parent
    work = work or out.name
    lock_path = root / f"{work}.lock"
    locked_staging = root / f".{work}.building"
    while True:
        try:
            root.mkdir(parents=True, exist_ok=True)
            fh = open(lock_path, "a+")  # noqa: SIM115 - closed by the with below
        except OSError as e:
            raise StoreError(
                f"cannot create the cache folder {root} or write in it ({e.strerror}: "
                f"{e.filename}); set {CACHE_ENV} (the trainer: zephon.cache_dir) to a folder "
                "this process can write."
            ) from None
        with fh:
            locked = _wait_for_lock(fh, what, log, locked_staging / PROGRESS_FILE)
            current = locked and _lock_is(fh, lock_path)
            try:
                if locked and not current:
                    continue  # its holder removed this file: lock the file at the path now
                if (out / MANIFEST).is_file():  # another process built it meanwhile
                    return out
                if locked:
                    fh.seek(0)
                    fh.truncate()
                    fh.write(_holder() + "\n")
                    fh.flush()
                    # Only the holder writes here: a build killed or failed midway leaves
                    # its work for the next holder (prepare reuses its finished tokenized units).
                    staging = locked_staging
                else:
                    if log is not None:
                        log(
                            f"the filesystem of {root} refuses file locks (flock): this "
                            f"process prepares {what} on its own; the first to finish wins. "
                            "Put the cache on local disk (ZEPHON_CACHE) or prepare ahead "
                            "with `zephon prepare` to do the work once."
                        )
                    staging = root / f".{work}.building-{uuid.uuid4().hex}"
                _build_into(staging, out, build, keep_on_failure=locked)
                return out
            finally:
                if current or not locked:  # ours to remove (without flock: nobody's)
                    try:
                        lock_path.unlink(missing_ok=True)
                    except OSError:
                        pass
                if locked:
                    fcntl.flock(fh, fcntl.LOCK_UN)


def _build_into(
    staging: Path,
    out: Path,
    build: Callable[[Path, Callable[[dict[str, Any]], None]], None],
    *,
    keep_on_failure: bool,
) -> None:
    """Build into ``staging``/store and rename it to ``out``. After a failure the staging
    folder stays for the next holder when ``keep_on_failure`` and the build left work
    in it (prepare's finished tokenized units), else it is removed."""
    dest = staging / "store"
    if dest.exists():  # complete but never moved: a holder died between the two renames
        shutil.rmtree(dest)
    staging.mkdir(parents=True, exist_ok=True)
    progress = BuildProgress(staging)
    progress({"phase": "starting"})
    try:
        build(dest, progress)
        try:
            os.rename(dest, out)
        except OSError:
            if not (out / MANIFEST).is_file():  # not a lost race with another builder
                raise
    except BaseException:
        progress.remove()
        if not (keep_on_failure and staging.is_dir() and any(staging.iterdir())):
            shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(staging, ignore_errors=True)
