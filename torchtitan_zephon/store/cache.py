"""The node-local cache of remote stores: their checked blocks (or chunks), one file each.

Role: ``NodeCache`` keeps the blocks of content check that ``remote.RemoteTokenStore``
fetched (blocks of the store's block_tokens, 512 by default, with their block checksum,
or 65,536-token chunks for a store without block checksums) under ``<root>/remote-blocks/<fingerprint>/<kind>/`` (``root``:
the store cache folder, ``$ZEPHON_CACHE`` else ``zephon.cache_dir``), so that another rank
of the node, a restart or a later job reads them from local disk instead of object
storage. The cache holds bytes only: the store checks each block on use (``get`` hands it
over, ``discard`` drops one that failed) and fetches it again when it is missing or bad.

Invariants:
- A block's file is complete or absent: it is written under a temporary name in its
  folder (``.tmp-...``) and renamed into place (``os.replace``), and readers open final
  names only, so a partly written file is never read. A temporary file left by a crash
  was counted in ``.usage`` before it was written (so the bound still holds) and is
  removed by the next writer that lists the folder (writers hold the lock, so under it
  every temporary file is a leftover). A truncated or garbage file under a final name
  (a disk fault, a hand edit) fails the store's check on use, is discarded and fetched
  again.
- A file can only serve the block it was written for: the key is the store's
  fingerprint, the kind of block (``blocks-512``, ``chunks-65536``) and the block's index,
  and the store's check on use binds the bytes to that key (a block's file holds its
  block checksum XOR a hash of the store's seed, the kind and the index; a chunk is
  checked against checksums.bin by its index). So a file under another block's name,
  kind or store folder (copied there by hand or by a bug) fails its check and is
  fetched again. A file crafted to pass (tokens and check value rewritten together) is
  outside this boundary, as tokens.bin and blocks.bin rewritten together in the bucket
  are. The ETag is not part of the key (a store uploaded again unchanged keeps its
  cache; another store, or another version under the same prefix, has another
  fingerprint, so other files).
- Bounded: every write happens under an exclusive ``flock`` on ``<root>/remote-blocks/
  .lock``, and after it the files under ``remote-blocks`` (every store's, every job's:
  the bound is shared) total at most ``limit`` bytes. ``.usage`` holds an upper bound of
  that total (reserved before the files are written, so a crash only overstates it);
  when a write would pass ``limit`` the writer lists the folder (the true total),
  removes the least recently used files (``get`` touches a file's mtime) down to 90% of
  ``limit`` less what it writes, and records the new total. Readers take no lock: a
  file removed under a reader is either already open (POSIX keeps its bytes) or not
  found (a miss).
- Shared is what is cached: two processes that miss one block at the same moment both
  fetch it (the second rename replaces the first file with the same bytes).
- Hits do not count as fetched bytes (the store counts only object-storage reads); a
  cache that cannot be written (disk full, permissions) warns once and the job goes on
  fetching.
"""

from __future__ import annotations

import errno
import fcntl
import os
import uuid
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from torchtitan_zephon.store.urls import refuse_url

FOLDER = "remote-blocks"
"""The cache's subfolder of the store cache folder."""
LOW_WATER = 0.9
"""Eviction frees the cache down to this fraction of its bound (so it lists the folder
once per tenth of the bound written, not at every write)."""
_PER_FOLDER = 4096
"""Block files per subfolder."""
_TMP = ".tmp-"


class CacheError(ValueError):
    """The cache folder cannot be used (it is a URL, or cannot be created)."""


class NodeCache:
    """The cached blocks of one store (``fingerprint``) of one kind under ``root``;
    at most ``limit`` bytes under ``root/remote-blocks`` in all. See the module
    docstring."""

    def __init__(self, root: str | os.PathLike, fingerprint: str, kind: str, limit: int) -> None:
        refuse_url(str(root), "zephon.cache_dir", "The node cache is a local folder.")
        if limit <= 0:
            raise ValueError(f"the node cache needs a bound > 0 bytes, got {limit}.")
        self.top = Path(root) / FOLDER
        self.folder = self.top / fingerprint / kind
        self.kind = kind
        self.limit = int(limit)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CacheError(
                f"cannot create the node cache folder {str(self.folder)!r}: "
                f"{e.strerror or e}. Set zephon.cache_dir (or $ZEPHON_CACHE) to a writable "
                "local folder, or zephon.cache_bytes = 0 to read without a cache."
            ) from None
        self.hits = 0
        """Blocks served from the cache (checked good) by this process."""
        self.hit_bytes = 0
        self.misses = 0
        """Blocks looked up and not found (or found bad) by this process."""
        self.discarded = 0
        """Files found bad (truncated, garbage) and removed by this process."""
        self.written = 0
        """Blocks written by this process."""
        self._warned = False

    def path(self, block: int) -> Path:
        return self.folder / f"{block // _PER_FOLDER:06d}" / f"{block}.bin"

    # ------------------------------------------------------------------ reading

    def get(self, block: int) -> bytes | None:
        """The bytes of ``block``'s file (None: not cached); marks it recently used."""
        path = self.path(block)
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError:
            self.misses += 1
            return None
        try:
            os.utime(path)
        except OSError:
            pass  # evicted meanwhile: the bytes read are whole all the same
        return data

    def hit(self, nbytes: int) -> None:
        """Record a block served after its check passed."""
        self.hits += 1
        self.hit_bytes += nbytes

    def discard(self, block: int) -> None:
        """Remove ``block``'s file: it failed its check (truncated, garbage)."""
        self.discarded += 1
        self.misses += 1
        try:
            self.path(block).unlink()
        except OSError:
            pass

    # ------------------------------------------------------------------ writing

    def put_many(self, items: Iterable[tuple[int, bytes]]) -> int:
        """Cache the checked blocks ``items`` ((index, bytes)) not cached yet, evicting
        the least recently used files first so the bound holds; the bytes written."""
        items = [(u, d) for u, d in items if len(d) <= self.limit]
        if not items:
            return 0
        try:
            with self._locked():
                todo = [(u, d) for u, d in items if not self.path(u).exists()]
                new = sum(len(d) for _, d in todo)
                while todo and new > self.limit:
                    new -= len(todo.pop()[1])
                if not todo:
                    return 0
                usage = self._usage()
                if usage is None or usage + new > self.limit:
                    usage = self._evict(min(int(self.limit * LOW_WATER), self.limit - new))
                self._set_usage(usage + new)  # reserved first: a crash overstates it
                for block, data in todo:
                    self._write(self.path(block), data)
                self.written += len(todo)
                return new
        except OSError as e:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"the node cache {str(self.top)!r} cannot be written ({e.strerror or e}); "
                    "reading on without caching what is fetched.",
                    stacklevel=2,
                )
            return 0

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.top / ".lock", "a+b") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX)
            except OSError as e:  # the filesystem refuses flock: write nothing
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise OSError(e.errno, "file locks are not supported there") from None
                raise
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _usage(self) -> int | None:
        try:
            return int((self.top / ".usage").read_text())
        except (OSError, ValueError):
            return None

    def _set_usage(self, value: int) -> None:
        (self.top / ".usage").write_text(str(int(value)))

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{_TMP}{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except BaseException:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise

    def _files(self, *, clean: bool = True) -> list[tuple[float, int, str]]:
        """(mtime, size, path) of every block file under the cache (all stores); with
        ``clean`` (under the lock) temporary files, leftovers of a crash, are removed."""
        found = []
        for folder, _, names in os.walk(self.top):
            for name in names:
                if folder == str(self.top) and name in (".lock", ".usage"):
                    continue
                path = os.path.join(folder, name)
                try:
                    if name.startswith(_TMP):
                        if clean:
                            os.unlink(path)
                        continue
                    st = os.stat(path)
                except OSError:
                    continue
                found.append((st.st_mtime, st.st_size, path))
        return found

    def _evict(self, target: int) -> int:
        """Remove the least recently used files until they total at most ``target``
        bytes (under the lock); the total left."""
        files = self._files()
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= target:
                break
            try:
                os.unlink(path)
            except OSError:
                continue
            total -= size
        return total

    def total_bytes(self) -> int:
        """Bytes of every block file under the cache now (a listing: tests, reports)."""
        return sum(size for _, size, _ in self._files(clean=False))
