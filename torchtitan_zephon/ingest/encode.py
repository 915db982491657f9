"""Tokenize chunks of documents, in this process or in worker processes.

Role: turn ``(tag, texts)`` chunks into ``(tag, tokens, lengths)``: every
document's token ids followed by one EOS id (uint32), and each document's
length including its EOS.

Invariant: results come back in the order the chunks were given, and are the
same for any number of workers. With worker processes, a worker that dies
(SIGKILL, out-of-memory killer) raises ``WorkerLost`` within moments, and
Ctrl-C stops every worker; either way no worker is left running.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import signal
from collections import deque
from collections.abc import Iterable, Iterator
from multiprocessing import connection
from multiprocessing.connection import Connection
from typing import Any, NoReturn

import numpy as np

_WORKER_TOKENIZER: Any = None
_WORKER_EOS: int = -1


def init_worker(tokenizer_json: str, eos_id: int, limit_threads: bool) -> None:
    """Load this process's tokenizer (``encode_chunk`` uses it) and the EOS id."""
    global _WORKER_TOKENIZER, _WORKER_EOS
    if limit_threads:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _WORKER_TOKENIZER = Tokenizer.from_file(tokenizer_json)
    _WORKER_EOS = eos_id


def encode_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Tokens (uint32, each document followed by EOS) and per-document lengths."""
    tok = _WORKER_TOKENIZER
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    ids = [e.ids for e in encode(texts, add_special_tokens=False)]
    lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    eos = [_WORKER_EOS]
    flat = np.fromiter(
        itertools.chain.from_iterable(itertools.chain(x, eos) for x in ids),
        dtype=np.uint32,
        count=int(lengths.sum()),
    )
    return flat, lengths


def max_workers() -> int:
    """The most worker processes worth starting: 4 per CPU (at least 8)."""
    return max(8, 4 * (os.cpu_count() or 1))


def encode_in_order(
    chunks: Iterable[tuple[Any, list[str]]], tokenizer_json: str, eos_id: int, workers: int
) -> Iterator[tuple[Any, np.ndarray, np.ndarray]]:
    """(tag, tokens, lengths) of each chunk, in input order, computed by ``workers`` processes.

    Chunk ``j`` goes to worker ``j % workers``, which holds at most one chunk at a
    time, so results are taken back in order without reordering buffers.
    """
    if workers <= 1:
        init_worker(tokenizer_json, eos_id, limit_threads=False)
        for k, texts in chunks:
            yield (k, *encode_chunk(texts))
        return
    pool = WorkerPool(workers, tokenizer_json, eos_id)
    finished = False
    try:
        pending: deque[tuple[Any, int]] = deque()
        for j, (k, texts) in enumerate(chunks):
            w = j % workers
            if len(pending) == workers:  # the oldest chunk is worker w's: take it first
                k0, w0 = pending.popleft()
                yield (k0, *pool.result(w0))
            pool.submit(w, texts)
            pending.append((k, w))
        while pending:
            k0, w0 = pending.popleft()
            yield (k0, *pool.result(w0))
        finished = True
    finally:
        pool.close(wait=finished)


class WorkerLost(ChildProcessError):
    """A tokenizer worker process died (e.g. killed by the out-of-memory killer) or failed."""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = (
            " (the out-of-memory killer sends SIGKILL: use fewer --workers or a machine with "
            "more memory)"
            if -code == signal.SIGKILL
            else ""
        )
        return f"was killed by {name}{hint}"
    return f"exited with status {code}"


class WorkerPool:
    """``workers`` spawned processes, each with its own task and result pipe.

    Invariant: every wait also watches every worker's exit, so a worker that dies
    (SIGKILL, OOM killer) raises ``WorkerLost`` at once instead of leaving the
    caller waiting for a result that never comes; ``close`` leaves no worker
    running. Workers ignore SIGINT: Ctrl-C reaches this process, which stops them.
    """

    def __init__(self, workers: int, tokenizer_json: str, eos_id: int) -> None:
        ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._tasks: list[Connection] = []
        self._results: list[Connection] = []
        # Workers start with SIGINT blocked, so a Ctrl-C while they boot cannot print a
        # KeyboardInterrupt traceback from them; this process gets it once unblocked.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            for _ in range(workers):
                task_recv, task_send = ctx.Pipe(duplex=False)
                result_recv, result_send = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_worker_main,
                    args=(task_recv, result_send, tokenizer_json, eos_id),
                    daemon=True,
                )
                self._procs.append(proc)  # before start: close() must see it
                proc.start()
                task_recv.close()  # the worker's ends: a dead worker then reads as EOF here
                result_send.close()
                self._tasks.append(task_send)
                self._results.append(result_recv)
        except BaseException:
            self.close(wait=False)
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def submit(self, w: int, texts: list[str]) -> None:
        """Give worker ``w`` (idle: its previous result was taken) a chunk."""
        try:
            self._tasks[w].send(texts)
        except OSError:  # BrokenPipeError: the worker is gone
            self._lost(w)

    def result(self, w: int) -> tuple[np.ndarray, np.ndarray]:
        """Worker ``w``'s result for its chunk; WorkerLost as soon as any worker dies."""
        conn = self._results[w]
        sentinels = [p.sentinel for p in self._procs]
        ready = connection.wait([conn, *sentinels])
        for i, sentinel in enumerate(sentinels):
            if sentinel in ready:
                self._lost(i)
        try:
            ok, payload = conn.recv()
        except (EOFError, OSError):
            self._lost(w)
        if not ok:
            raise WorkerLost(f"tokenizer worker {w + 1} of {len(self._procs)} failed: {payload}")
        return payload

    def _lost(self, w: int) -> NoReturn:
        proc = self._procs[w]
        proc.join(timeout=5)
        raise WorkerLost(
            f"tokenizer worker {w + 1} of {len(self._procs)} (pid {proc.pid}) "
            f"{_describe_exit(proc.exitcode)} while encoding documents."
        )

    def close(self, *, wait: bool) -> None:
        """Stop every worker: let idle ones exit (``wait``) or terminate them at once."""
        if wait:
            for conn in self._tasks:
                try:
                    conn.send(None)
                except OSError:
                    pass
        for proc in self._procs:
            if proc.pid is None:  # never started
                continue
            if wait:
                proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in (*self._tasks, *self._results):
            conn.close()


def _worker_main(tasks: Connection, results: Connection, tokenizer_json: str, eos_id: int) -> None:
    """A worker: encode each chunk received until ``None`` or the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # now ignored
    try:
        init_worker(tokenizer_json, eos_id, limit_threads=True)
        while True:
            texts = tasks.recv()
            if texts is None:
                return
            try:
                reply: tuple[bool, Any] = (True, encode_chunk(texts))
            except BaseException as e:  # tokenizers panics are BaseExceptions
                reply = (False, f"{type(e).__name__}: {e}")
            results.send(reply)
    except (EOFError, BrokenPipeError):  # the parent is gone: nothing left to do
        return
