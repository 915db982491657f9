"""The store cache: token stores built on first use, once, into a shared folder.

Role: own the cache folder (``cache_root``) and the one way an entry is made
(``build_once``): under an exclusive ``fcntl.flock`` on ``<entry>.lock`` beside
it, the holder builds the store into a staging folder and renames it into
place; every other process waits on the lock (saying so every ~30 s) and then
finds the entry. The builtin store (``builtin.py``) is built this way.

Invariants:
- An entry that exists is complete: it appears by one rename, after its build
  succeeded. A build that fails leaves no entry and no staging folder, and the
  lock is released (the kernel drops it if the process dies).
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
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "ZEPHON_CACHE"
MANIFEST = "manifest.json"  # store.MANIFEST: an entry is complete when its manifest exists
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


def _wait_for_lock(fh, what: str, log: Log | None) -> bool:  # noqa: ANN001 - a file object
    """Take the exclusive lock, reporting the holder while waiting. False: no flock here."""
    start = time.monotonic()
    reported: float | None = None
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
        now = time.monotonic()
        if log is not None and (reported is None or now - reported >= WAIT_REPORT_S):
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            log(
                f"waiting for {holder} to prepare {what} "
                f"({now - start:.0f} s so far; its lock: {fh.name})"
            )
            reported = now
        time.sleep(delay)
        delay = min(1.0, delay * 2)


def build_once(
    out: Path,
    build: Callable[[Path], None],
    *,
    what: str = "a store",
    log: Log | None = None,
) -> Path:
    """The entry ``out`` (a store folder in the cache), built by ``build(dest)`` on first use.

    ``build`` must create a complete store at ``dest`` (a path that does not exist
    yet) or raise; the store is then renamed to ``out``. ``what`` and ``log`` name
    the work in the messages of processes that wait for it.
    """
    if (out / MANIFEST).is_file():
        return out
    root = out.parent
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{out.name}.lock", "a+") as fh:
        locked = _wait_for_lock(fh, what, log)
        try:
            if (out / MANIFEST).is_file():  # another process built it meanwhile
                return out
            if locked:
                fh.seek(0)
                fh.truncate()
                fh.write(_holder() + "\n")
                fh.flush()
                # Only the holder writes here: a build killed midway leaves its work for
                # the next holder (a resumable build can reuse it); a failure removes it.
                staging = root / f".{out.name}.building"
            else:
                if log is not None:
                    log(
                        f"the filesystem of {root} refuses file locks (flock): this process "
                        f"prepares {what} on its own; the first to finish wins. Put the "
                        "cache on local disk (ZEPHON_CACHE) or prepare ahead with `zephon "
                        "prepare` to do the work once."
                    )
                staging = root / f".{out.name}.building-{uuid.uuid4().hex}"
            _build_into(staging, out, build)
        finally:
            if locked:
                fcntl.flock(fh, fcntl.LOCK_UN)
    return out


def _build_into(staging: Path, out: Path, build: Callable[[Path], None]) -> None:
    dest = staging / "store"
    if dest.exists():  # complete but never moved: a holder died between the two renames
        shutil.rmtree(dest)
    staging.mkdir(parents=True, exist_ok=True)
    try:
        build(dest)
        try:
            os.rename(dest, out)
        except OSError:
            if not (out / MANIFEST).is_file():  # not a lost race with another builder
                raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(staging, ignore_errors=True)
