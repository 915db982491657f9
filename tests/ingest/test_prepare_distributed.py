"""prepare over several ranks and across interruptions: the same bytes as one process
in one go; finished parts reused, changed inputs redone, bad input named."""

import gzip
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import corpus_text
from tests.titan.launch import kill_node
from torchtitan_zephon.bench.builtin_corpus import TOKENIZER_DIR, write_jsonl
from torchtitan_zephon.ingest import stage as prepare_module
from torchtitan_zephon.ingest.prepare import prepare_store
from torchtitan_zephon.store.format import StoreError


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _torchrun(nproc: int, *args: str, wait: bool = True, **kw):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "torchtitan_zephon", "prepare", *args]  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, **kw)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True, **kw)  # fmt: skip


class ThreadRanks:
    """Ranks as threads of this process: the collectives of a torch group, in memory."""

    def __init__(self, rank: int, shared: dict) -> None:
        self.rank, self.world_size, self._shared = rank, shared["world"], shared

    def barrier(self) -> None:
        self._shared["barrier"].wait(timeout=60)

    def all_gather_object(self, obj):
        self._shared["slots"][self.rank] = obj
        self.barrier()
        out = list(self._shared["slots"])
        self.barrier()
        return out


def _in_threads(world: int, call) -> list:
    """``call(ranks)`` on ``world`` thread ranks; each one's result or exception."""
    shared = {"world": world, "barrier": threading.Barrier(world), "slots": [None] * world}
    results: list = [None] * world

    def main(r: int) -> None:
        try:
            results[r] = call(ThreadRanks(r, shared))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            results[r] = e

    threads = [threading.Thread(target=main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


@pytest.fixture(scope="module")
def mixed_inputs(tmp_path_factory) -> Path:
    """Every input kind, with a JSONL and a Parquet file large enough to be split."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("mixed") / "in"
    root.mkdir()
    write_jsonl(root, max_docs=60)  # corpus.jsonl, ~1.3 MB of real text
    texts = [corpus_text(k, 50 + k % 40) for k in range(400)]
    pq.write_table(pa.table({"text": texts}), root / "b.parquet", row_group_size=50)
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts[:40])
    (root / "c.jsonl.gz").write_bytes(gzip.compress(lines.encode(), mtime=0))
    (root / "d.txt").write_text(corpus_text(7, 300))
    (root / "e.json").write_text(json.dumps([{"text": t} for t in texts[40:60]]))
    return root


def test_two_ranks_under_torchrun_write_the_bytes_of_one_process(tmp_path, mixed_inputs):
    """`torchrun --nproc-per-node 2 -m torchtitan_zephon prepare` with small units (the
    JSONL and Parquet files split across ranks) writes every store file byte for byte
    as a single process with default units does."""
    one = prepare_store([str(mixed_inputs)], str(TOKENIZER_DIR), str(tmp_path / "one"),
                        progress=False)  # fmt: skip
    report = tmp_path / "report.json"
    res = _torchrun(2, str(mixed_inputs), "--tokenizer", str(TOKENIZER_DIR), "--output",
                    str(tmp_path / "two"), "--workers", "1", "--quiet", "--unit-bytes", "4000",
                    "--report", str(report))  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "(2 ranks)" in res.stdout and res.stdout.count("prepared ") == 1, res.stdout
    r = json.loads(report.read_text())
    assert r["world_size"] == 2 and r["units"] > 5 + 30, r  # JSONL and Parquet split
    assert _files(tmp_path / "two") == _files(one.path)
    assert not list(tmp_path.glob(".two.*"))  # the staging folder is gone


def test_killed_torchrun_prepare_resumes_with_the_same_bytes(tmp_path):
    """SIGKILL the whole torchrun process tree once a part is finished; the same prepare
    run again (here by one process: parts do not depend on the world size) reuses every
    part the killed run finished, tokenizes only the rest, and writes the same bytes."""
    corpus = write_jsonl(tmp_path / "in", max_docs=300, repeat=2)  # ~10 MB, ~100 units
    args = [str(corpus), "--tokenizer", str(TOKENIZER_DIR), "--output", str(tmp_path / "out"),
            "--workers", "1", "--quiet", "--unit-bytes", "100000"]  # fmt: skip
    proc = _torchrun(2, *args, wait=False)
    parts = tmp_path / ".out.prepare" / "parts"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not list(parts.glob("*.json")):
        time.sleep(0.005)
    kill_node(proc.pid)
    _, err = proc.communicate()
    kept = {p.stem for p in parts.glob("*.json")}
    assert kept and not (tmp_path / "out").exists(), err[-3000:]
    report: dict = {}
    again = prepare_store([str(corpus)], str(TOKENIZER_DIR), str(tmp_path / "out"),
                          progress=False, unit_bytes=100_000, report=report)  # fmt: skip
    assert report["reused"] == len(kept) and report["tokenized"] == report["units"] - len(kept)
    assert report["tokenized"] > 0, "the killed run had finished everything: kill sooner"
    ref = prepare_store([str(corpus)], str(TOKENIZER_DIR), str(tmp_path / "ref"), progress=False)
    assert _files(again.path) == _files(ref.path)
    assert not (tmp_path / ".out.prepare").exists()


def test_corrupt_file_among_many_then_fixed_and_changed(tmp_path, tokenizer_dir):
    """A corrupt file among many: the error names it and its line, nothing at the output,
    the other files' parts kept (the message says where). Fixed, with another file
    changed meanwhile: the run again redoes exactly those two and gives the bytes of a
    fresh prepare."""
    root = tmp_path / "in"
    root.mkdir()
    for name in "abcd":
        lines = [json.dumps({"text": corpus_text(k + ord(name), 30)}) for k in range(20)]
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    (root / "z.jsonl").write_text('{"text": "alpha"}\n{"text": "beta"\n{"text": "gamma"}\n')
    out = tmp_path / "out"
    with pytest.raises(StoreError) as failed:
        prepare_store([str(root)], str(tokenizer_dir), str(out), progress=False)
    message = str(failed.value)
    staging = tmp_path / ".out.prepare"
    assert message.startswith(f"{root / 'z.jsonl'}:2: invalid JSON"), message
    assert f"The finished parts are kept in {staging}: run the same command again" in message
    assert not out.exists() and len(list((staging / "parts").glob("*.json"))) == 4
    (root / "z.jsonl").write_text('{"text": "alpha"}\n{"text": "beta"}\n')
    (root / "b.jsonl").write_text(json.dumps({"text": "a changed b"}) + "\n")
    report: dict = {}
    again = prepare_store([str(root)], str(tokenizer_dir), str(out), progress=False,
                          report=report)  # fmt: skip
    assert (report["units"], report["reused"], report["tokenized"]) == (5, 3, 2)
    fresh = prepare_store([str(root)], str(tokenizer_dir), str(tmp_path / "fresh"), progress=False)
    assert _files(again.path) == _files(fresh.path)


def test_changed_part_or_tokenizer_is_not_reused(tmp_path, tokenizer_dir):
    """A part file edited after it was finished, or another text field, is made again."""
    root = tmp_path / "in"
    root.mkdir()
    for name in "ab":
        rows = [json.dumps({"text": corpus_text(k, 20), "t2": corpus_text(k + 1, 9)})
                for k in range(10)]  # fmt: skip
        (root / f"{name}.jsonl").write_text("\n".join(rows) + "\n")
    (root / "z.jsonl").write_text("not json\n")
    for field in ("text", "t2"):
        with pytest.raises(StoreError, match="z.jsonl:1: invalid JSON"):
            prepare_store([str(root)], str(tokenizer_dir), str(tmp_path / "out"),
                          progress=False, text_field=field)  # fmt: skip
    parts = tmp_path / ".out.prepare" / "parts"
    assert len(list(parts.glob("*.json"))) == 4  # two files x two text fields
    tokens = sorted(parts.glob("*.tokens"))[0]
    data = bytearray(tokens.read_bytes())
    data[0] ^= 1
    tokens.write_bytes(bytes(data))
    (root / "z.jsonl").unlink()
    report: dict = {}
    prepare_store([str(root)], str(tokenizer_dir), str(tmp_path / "out"), progress=False,
                  report=report)  # fmt: skip
    assert (report["reused"], report["tokenized"]) == (1, 1)  # b reused, a made again


def test_input_changing_during_prepare_is_detected(tmp_path, tokenizer_dir, monkeypatch):
    root = tmp_path / "in"
    root.mkdir()
    growing = root / "a.jsonl"
    growing.write_text("".join(json.dumps({"text": corpus_text(k, 20)}) + "\n" for k in range(9)))
    real = prepare_module.iter_documents

    def appending(src, text_field, extent=None):
        for k, doc in enumerate(real(src, text_field, extent)):
            if k == 3:
                with open(growing, "a") as f:  # another program still writing the input
                    f.write(json.dumps({"text": "late"}) + "\n")
            yield doc

    monkeypatch.setattr(prepare_module, "iter_documents", appending)
    with pytest.raises(StoreError, match=r"a\.jsonl' changed while prepare was running"):
        prepare_store([str(root)], str(tokenizer_dir), str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


def test_ranks_given_different_inputs_are_refused(tmp_path, tokenizer_dir):
    """Every rank fails with one message naming the input that differs; nothing written."""
    root = tmp_path / "in"
    root.mkdir()
    (root / "a.txt").write_text("alpha beta")
    (root / "b.txt").write_text("gamma delta")
    inputs = [[str(root)], [str(root / "a.txt")]]  # rank 1 sees another input
    results = _in_threads(2, lambda ranks: prepare_store(
        inputs[ranks.rank], str(tokenizer_dir), str(tmp_path / "out"), progress=False,
        ranks=ranks))  # fmt: skip
    for e in results:
        assert isinstance(e, StoreError), e
        assert "ranks of this prepare were given different inputs" in str(e)
        assert "'b.txt' is an input on rank 0, not on rank 1" in str(e), e
    assert not list(tmp_path.glob("*out*"))


def test_error_on_one_rank_fails_every_rank(tmp_path, tokenizer_dir):
    """A corrupt file read by one rank: every rank raises its message, naming the rank."""
    root = tmp_path / "in"
    root.mkdir()
    for k in range(4):
        (root / f"{k}.txt").write_text(corpus_text(k, 40))
    (root / "9.jsonl").write_text("[1,\n")
    results = _in_threads(2, lambda ranks: prepare_store(
        [str(root)], str(tokenizer_dir), str(tmp_path / "out"), progress=False,
        ranks=ranks))  # fmt: skip
    messages = [str(e) for e in results]
    assert all(isinstance(e, StoreError) for e in results), results
    assert messages[0] == messages[1] and "9.jsonl:1: invalid JSON" in messages[0]
    assert "(rank " in messages[0] and "The finished parts are kept in" in messages[0]
    assert not (tmp_path / "out").exists()
