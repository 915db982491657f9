"""prepare_store: all input kinds, byte-identical across worker counts, clear errors."""

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import EOS, build_tokenizer, corpus_text
from torchtitan_zephon.ingest.prepare import prepare_store
from torchtitan_zephon.ingest.tokenizer import dtype_for_vocab
from torchtitan_zephon.store.format import StoreError
from torchtitan_zephon.store.reader import TokenStore


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_identical_bytes_for_any_worker_count(tmp_path, tokenizer_dir, corpus_dir, store_path):
    two = prepare_store(
        [str(corpus_dir)], str(tokenizer_dir), str(tmp_path / "w2"), workers=2, progress=False
    )
    assert _files(store_path) == _files(two.path)
    assert set(_files(two.path)) == {
        "manifest.json",
        "tokens.bin",
        "doc_offsets.bin",
        "checksums.bin",
        "blocks.bin",  # block checksums, written by prepare since issue 21 item 4
        "blocks.json",
    }
    assert two.content == TokenStore.open(store_path).content  # checksums and max token id


def test_documents_are_tokens_plus_eos(tmp_path, tokenizer_dir):
    from tokenizers import Tokenizer

    (tmp_path / "a.txt").write_text("the quick brown fox")
    (tmp_path / "b.md").write_text("lazy dog zzz")  # zzz -> <unk>
    s = prepare_store(
        [str(tmp_path / "a.txt"), str(tmp_path / "b.md")],
        str(tokenizer_dir),
        str(tmp_path / "s"),
        progress=False,
    )
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    expected = []
    for text in ["the quick brown fox", "lazy dog zzz"]:
        expected += tok.encode(text, add_special_tokens=False).ids + [eos]
    assert s.tokens.tolist() == expected
    assert s.doc_offsets.tolist() == [0, 5]
    assert [src["name"] for src in s.manifest["sources"]] == ["a.txt", "b.md"]


def test_all_input_kinds_give_the_same_tokens(tmp_path, tokenizer_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [corpus_text(k, 20 + k) for k in range(12)]
    (tmp_path / "t").mkdir()
    for k, t in enumerate(texts):
        (tmp_path / "t" / f"{k:02d}.txt").write_text(t)
    lines = "".join(json.dumps({"text": t, "n": k}) + "\n" for k, t in enumerate(texts))
    (tmp_path / "d.jsonl").write_text(lines)
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write(lines)
    pq.write_table(pa.table({"text": texts, "n": list(range(12))}), tmp_path / "d.parquet")

    ref = None
    for name in ["t", "d.jsonl", "d.jsonl.gz", "d.parquet"]:
        s = prepare_store(
            [str(tmp_path / name)], str(tokenizer_dir), str(tmp_path / f"s-{name}"), progress=False
        )
        assert s.num_documents == 12
        if ref is None:
            ref = np.array(s.tokens)
        assert np.array_equal(s.tokens, ref), name


def test_hf_dataset_input(tmp_path, tokenizer_dir):
    datasets = pytest.importorskip("datasets")
    texts = [corpus_text(k, 15) for k in range(9)]
    datasets.Dataset.from_dict({"body": texts}).save_to_disk(str(tmp_path / "hf"))
    s = prepare_store(
        [str(tmp_path / "hf")],
        str(tokenizer_dir),
        str(tmp_path / "s"),
        text_field="body",
        progress=False,
    )
    assert s.num_documents == 9 and s.manifest["sources"][0]["kind"] == "hf"
    with pytest.raises(StoreError, match=r"unknown text field 'text'.*\['body'\]"):
        prepare_store([str(tmp_path / "hf")], str(tokenizer_dir), str(tmp_path / "s2"))


def test_changed_input_changes_fingerprint(tmp_path, tokenizer_dir):
    f = tmp_path / "in" / "a.txt"
    f.parent.mkdir()
    f.write_text("alpha beta gamma")
    a = prepare_store([str(f.parent)], str(tokenizer_dir), str(tmp_path / "a"), progress=False)
    b = prepare_store([str(f.parent)], str(tokenizer_dir), str(tmp_path / "b"), progress=False)
    assert a.fingerprint == b.fingerprint
    f.write_text("alpha beta delta")  # same token count, different content
    c = prepare_store([str(f.parent)], str(tokenizer_dir), str(tmp_path / "c"), progress=False)
    assert c.num_tokens == a.num_tokens and c.fingerprint != a.fingerprint


def test_eos_fallback_and_large_vocab(tmp_path):
    tok = build_tokenizer(tmp_path / "tok", extra_vocab=70_000, eos_in_config=False)
    (tmp_path / "a.txt").write_text("w69999 alpha w0")
    s = prepare_store([str(tmp_path / "a.txt")], str(tok), str(tmp_path / "s"), progress=False)
    assert s.tokens.dtype == np.uint32 and s.manifest["dtype"] == "uint32"
    assert s.tokens[-1] == s.eos_id == 1
    assert int(s.tokens[0]) > 65535
    w = s.windows(np.array([2, 0]), 1)
    assert w.dtype == np.uint32 and w.tolist() == [s.tokens[2:4].tolist(), s.tokens[0:2].tolist()]


def test_vocab_dtype_limits():
    assert dtype_for_vocab(65536) == "uint16"
    assert dtype_for_vocab(65537) == "uint32"
    with pytest.raises(StoreError, match="too large"):
        dtype_for_vocab(2**32 + 1)


def test_errors(tmp_path, tokenizer_dir, corpus_dir):
    out = str(tmp_path / "out")
    with pytest.raises(StoreError, match="'missing.txt' does not exist"):
        prepare_store(["missing.txt"], str(tokenizer_dir), out)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("")
    with pytest.raises(StoreError, match="empty corpus"):
        prepare_store([str(tmp_path / "empty")], str(tokenizer_dir), out, progress=False)
    assert not Path(out).exists() and not list(tmp_path.glob(".out.*"))
    (tmp_path / "notok").mkdir()
    with pytest.raises(StoreError, match="no tokenizer.json"):
        prepare_store([str(corpus_dir)], str(tmp_path / "notok"), out)
    with pytest.raises(StoreError, match=r"unknown text field 'body'.*\['id', 'text'\]"):
        prepare_store([str(corpus_dir)], str(tokenizer_dir), out, text_field="body")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    with pytest.raises(StoreError, match="already exists; choose another path or delete"):
        prepare_store([str(corpus_dir)], str(tokenizer_dir), str(tmp_path / "taken"))


def test_no_eos_is_an_error(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("a a")
    with pytest.raises(StoreError, match="cannot determine the EOS token"):
        prepare_store([str(tmp_path / "a.txt")], str(tmp_path / "tok"), str(tmp_path / "s"))


def test_reopen_equals_returned(store_path, store):
    again = TokenStore.open(store_path)
    assert again.fingerprint == store.fingerprint
    assert np.array_equal(again.tokens, store.tokens)


def test_json_file_and_dataset_dict(tmp_path, tokenizer_dir):
    texts = [corpus_text(k, 10) for k in range(6)]
    (tmp_path / "a.json").write_text(json.dumps([{"text": t} for t in texts]))
    a = prepare_store([str(tmp_path / "a.json")], str(tokenizer_dir), str(tmp_path / "sa"))
    assert a.num_documents == 6 and a.manifest["sources"][0]["kind"] == "json"
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict(
        {
            "validation": datasets.Dataset.from_dict({"text": texts[3:]}),
            "train": datasets.Dataset.from_dict({"text": texts[:3]}),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    b = prepare_store([str(tmp_path / "dd")], str(tokenizer_dir), str(tmp_path / "sb"), split="all")
    assert np.array_equal(a.tokens, b.tokens)  # all splits, in sorted order: train, validation


def test_hf_without_datasets_package(tmp_path, tokenizer_dir, monkeypatch):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "state.json").write_text("{}")
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)
    with pytest.raises(StoreError, match="`datasets` package is not installed"):
        prepare_store([str(tmp_path / "hf")], str(tokenizer_dir), str(tmp_path / "s"))


def test_progress_bar_on_stderr(tmp_path, tokenizer_dir, corpus_dir, capfd):
    prepare_store([str(corpus_dir)], str(tokenizer_dir), str(tmp_path / "s"), progress=True)
    captured = capfd.readouterr()
    assert "zephon prepare" in captured.err and captured.out == ""


def test_dirty_inputs(tmp_path, tokenizer_dir):
    """Lone surrogates become U+FFFD; non-text columns and binary files are refused."""
    jl = tmp_path / "a.jsonl"
    jl.write_text(json.dumps({"text": "alpha \ud800 beta"}) + "\n")
    s = prepare_store([str(jl)], str(tokenizer_dir), str(tmp_path / "s"), progress=False)
    assert s.num_documents == 1 and s.num_tokens > 2
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    with pytest.raises(StoreError, match="is a number, not text"):
        prepare_store([str(tmp_path / "n.parquet")], str(tokenizer_dir), str(tmp_path / "s2"))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "tokens.bin").write_bytes(b"\x00\x01\x02abc")
    with pytest.raises(StoreError, match="looks binary"):
        prepare_store([str(tmp_path / "bin")], str(tokenizer_dir), str(tmp_path / "s3"))
    assert not (tmp_path / "s2").exists() and not (tmp_path / "s3").exists()


# ----------------------------------------------------------------------------- bad input


def _no_leftovers(tmp_path: Path, out: str = "out") -> None:
    """A refused prepare leaves neither the output nor a staging folder behind."""
    assert not (tmp_path / out).exists()
    assert not list(tmp_path.glob(f".{out}.*"))


def _kept_staging(tmp_path: Path, message: str, out: str = "out") -> Path:
    """A prepare stopped after finishing parts: no output, the staging folder kept with
    finished parts, and the message naming it and what to do."""
    assert not (tmp_path / out).exists()
    staging = tmp_path / f".{out}.prepare"
    assert list((staging / "parts").glob("*.json")), "no finished part kept"
    assert f"The finished parts are kept in {staging}: run the same command again" in message
    assert f"delete {staging} to start over" in message
    return staging


def _gz_lines(n: int) -> bytes:
    lines = "".join(json.dumps({"text": corpus_text(k, 40)}) + "\n" for k in range(n))
    return gzip.compress(lines.encode(), mtime=0)


@pytest.mark.parametrize(
    "name, content, message",
    [
        # cut in the middle: the reader saw some lines, then the stream ends
        pytest.param(
            "cut.jsonl.gz",
            _gz_lines(400)[:2000],
            r"cut\.jsonl\.gz: .*after line \d+.*truncated",
            id="truncated-gzip",
        ),
        # bytes overwritten in the middle of the deflate stream
        pytest.param(
            "bad.jsonl.gz",
            (lambda b: b[:40] + bytes(range(256)) * 4 + b[1064:])(_gz_lines(400)),
            r"bad\.jsonl\.gz: .*corrupt",
            id="corrupt-gzip",
        ),
        # JSON lines named .gz but not compressed
        pytest.param(
            "plain.jsonl.gz",
            b'{"text": "alpha"}\n',
            r"plain\.jsonl\.gz: .*not a gzip file",
            id="not-gzip",
        ),
        # compressed files under names prepare reads as text
        pytest.param(
            "notes.txt",
            __import__("bz2").compress(b"alpha " * 100),
            r"notes\.txt is bzip2-compressed",
            id="bzip2-as-text",
        ),
        pytest.param(
            "page.json.gz",
            gzip.compress(b'{"text": "alpha"}'),
            r"page\.json\.gz is gzip-compressed",
            id="json-gz",
        ),
    ],
)
def test_corrupt_compressed_input_is_a_clear_error(tmp_path, tokenizer_dir, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(StoreError, match=message):
        prepare_store([str(tmp_path / name)], str(tokenizer_dir), str(tmp_path / "out"))
    _no_leftovers(tmp_path)


def test_corrupt_parquet_is_a_clear_error(tmp_path, tokenizer_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"text": [corpus_text(k, 30) for k in range(50)]}), tmp_path / "a.parquet"
    )
    data = (tmp_path / "a.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.parquet").write_bytes(b"PAR1" + bytes(range(256)) * 3 + b"PAR1")
    for name in ("cut.parquet", "garbage.parquet"):
        with pytest.raises(StoreError, match=rf"{name}: cannot read Parquet"):
            prepare_store([str(tmp_path / name)], str(tokenizer_dir), str(tmp_path / "out"))
        _no_leftovers(tmp_path)


@pytest.mark.parametrize(
    "name, content, message",
    [
        pytest.param(
            "deep.jsonl",
            '{"text": "a"}\n' + "[" * 100_000 + "\n",
            r"deep\.jsonl:2: .*nested",
            id="jsonl-unclosed",
        ),
        pytest.param(
            "closed.jsonl",
            "[" * 50_000 + "]" * 50_000 + "\n",
            r"closed\.jsonl:1: .*nested",
            id="jsonl-closed",
        ),
        pytest.param("deep.json", "[" * 100_000, r"deep\.json: .*nested", id="json-unclosed"),
        pytest.param(
            "meta.json",
            '[{"text": "a", "meta": ' + "[" * 5000 + "]" * 5000 + "}]",
            r"meta\.json: .*nested",
            id="json-deep-field",
        ),
    ],
)
def test_deeply_nested_json_is_a_clear_error(tmp_path, tokenizer_dir, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(StoreError, match=message):
        prepare_store([str(tmp_path / name)], str(tokenizer_dir), str(tmp_path / "out"))
    _no_leftovers(tmp_path)


def test_symlink_loops_and_duplicate_links_are_read_once(tmp_path, tokenizer_dir):
    """Each real file is read once, whatever links lead to it; the order stays the walk's."""
    root = tmp_path / "in"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("alpha beta")
    (root / "sub" / "b.txt").write_text("gamma delta")
    (root / "sub" / "up").symlink_to("..")  # a loop: in/sub/up/sub/up/...
    (root / "z-link.txt").symlink_to("a.txt")  # a second name of a.txt
    (root / "dangling.txt").symlink_to("missing.txt")
    s = prepare_store([str(root)], str(tokenizer_dir), str(tmp_path / "s"), progress=False)
    assert [src["name"] for src in s.manifest["sources"]] == ["a.txt", "sub/b.txt"]
    assert s.num_documents == 2
    # two loops branch: without loop detection the walk would be exponential
    (root / "sub" / "self").symlink_to(".")
    two = prepare_store([str(root)], str(tokenizer_dir), str(tmp_path / "s2"), progress=False)
    assert two.fingerprint == s.fingerprint
    # the same folder reached through a link to it gives the same tokens
    (tmp_path / "link").symlink_to(root)
    again = prepare_store(
        [str(tmp_path / "link")], str(tokenizer_dir), str(tmp_path / "s3"), progress=False
    )
    assert again.num_documents == 2 and np.array_equal(again.tokens, s.tokens)


def test_corrupt_hf_dataset_is_a_clear_error(tmp_path, tokenizer_dir):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": [corpus_text(k, 10) for k in range(50)]}).save_to_disk(
        str(tmp_path / "hf")
    )
    (arrow,) = (tmp_path / "hf").glob("*.arrow")
    arrow.write_bytes(arrow.read_bytes()[:100])
    with pytest.raises(StoreError, match=r"hf: cannot read this Hugging Face dataset folder"):
        prepare_store([str(tmp_path / "hf")], str(tokenizer_dir), str(tmp_path / "out"))
    _no_leftovers(tmp_path)


# ----------------------------------------------------------------------------- worker processes


def _children(pid: int) -> list[int]:
    """Live (not zombie) child processes of ``pid``, from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _is_worker(pid: int) -> bool:
    try:
        return b"spawn_main" in (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return False


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory) -> Path:
    """~45 MB of text: a few seconds of work for two tokenizer workers."""
    root = tmp_path_factory.mktemp("big") / "big"
    root.mkdir()
    text = corpus_text(3, 30_000)
    for k in range(300):
        (root / f"{k:03d}.txt").write_text(text)
    return root


def _start_prepare_and_wait_for_output(tmp_path, tokenizer_dir, corpus) -> tuple:
    """``zephon prepare --workers 2`` in its own session, once it has written tokens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchtitan_zephon", "prepare", str(corpus), "--tokenizer",
         str(tokenizer_dir), "--output", str(tmp_path / "out"), "--workers", "2", "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if list(tmp_path.glob(".out.prepare/parts/*.json")):  # a part finished
            workers = [c for c in _children(proc.pid) if _is_worker(c)]
            if len(workers) == 2:
                return proc, workers
        time.sleep(0.01)
    proc.kill()
    pytest.fail(f"prepare ended (or never wrote tokens) before the test could act: {proc.poll()}")


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str, float]:
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"prepare still running {timeout} s after the signal (hangs):\n{err[-3000:]}")
    return proc.returncode, out, err, time.monotonic() - t0


def test_killed_worker_fails_fast_and_cleans_up(tmp_path, tokenizer_dir, big_corpus):
    """A worker SIGKILLed mid-run (as by the OOM killer) ends prepare with a clear error
    within seconds: no store at the output path, the finished parts kept (the message
    says where and how to continue), no worker left."""
    proc, workers = _start_prepare_and_wait_for_output(tmp_path, tokenizer_dir, big_corpus)
    os.kill(workers[0], signal.SIGKILL)
    code, out, err, took = _finish(proc, timeout=60)
    assert code == 2, (code, err)
    assert "zephon prepare: error: tokenizer worker" in err and "SIGKILL" in err, err
    assert "fewer --workers" in err and "Traceback" not in err + out, err
    assert took < 30, took  # seconds: detection is immediate, the margin is for a busy machine
    _kept_staging(tmp_path, err)
    assert not any(_alive(w) for w in workers)


def test_ctrl_c_stops_prepare_promptly_and_cleans_up(tmp_path, tokenizer_dir, big_corpus):
    """SIGINT to the whole process group (what Ctrl-C in a terminal sends) stops prepare
    and its workers at once, without a traceback, keeping the finished parts (named)."""
    proc, workers = _start_prepare_and_wait_for_output(tmp_path, tokenizer_dir, big_corpus)
    os.killpg(proc.pid, signal.SIGINT)
    code, out, err, took = _finish(proc, timeout=60)
    assert code == 130, (code, err)
    assert err.startswith("zephon prepare: interrupted. The finished parts are kept in "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert took < 30, took
    _kept_staging(tmp_path, err)
    assert not any(_alive(w) for w in workers)


def test_worker_count_is_bounded(tmp_path, tokenizer_dir, corpus_dir):
    """Nothing is started for a worker count no machine could run (10**10 processes)."""
    from torchtitan_zephon.ingest.encode import max_workers

    for workers in (0, -3, max_workers() + 1, 10**10):
        with pytest.raises(
            StoreError,
            match=rf"workers must be in \[1, {max_workers()}\] \(4 .* per CPU at most\), got",
        ):
            prepare_store(
                [str(corpus_dir)], str(tokenizer_dir), str(tmp_path / "out"), workers=workers
            )
        _no_leftovers(tmp_path)


def test_reader_error_with_workers_stops_them(tmp_path, tokenizer_dir, corpus_dir):
    """A bad input found while workers are encoding earlier chunks: the reader's error,
    the workers stopped (none left running), nothing at the output; the parts finished
    before it kept for the next run."""
    (tmp_path / "in").mkdir()
    for k in range(3):
        (tmp_path / "in" / f"{k}.jsonl").write_text(
            "".join(json.dumps({"text": corpus_text(j, 400)}) + "\n" for j in range(3000))
        )
    (tmp_path / "in" / "9.jsonl").write_text('{"text": "alpha"}\n{"text": "be\n')
    with pytest.raises(StoreError, match=r"9\.jsonl:2: invalid JSON") as failed:
        prepare_store([str(tmp_path / "in")], str(tokenizer_dir), str(tmp_path / "out"), workers=2)
    _kept_staging(tmp_path, str(failed.value))
    assert not [c for c in _children(os.getpid()) if _is_worker(c)]


def test_a_second_prepare_of_the_same_output_is_refused_while_one_runs(
    tmp_path, tokenizer_dir, corpus_dir
):
    """Rank 0 holds a lock beside the output for the whole prepare: another prepare of
    that output is refused naming the holder and writes nothing; once free, it runs."""
    import fcntl

    out = tmp_path / "store"
    with open(tmp_path / ".store.prepare.lock", "a+") as held:  # a prepare in progress
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("node-3 pid 77\n")
        held.flush()
        before = sorted(p.name for p in tmp_path.iterdir())
        with pytest.raises(
            StoreError, match=r"another prepare \(node-3 pid 77\) is writing .*store"
        ):
            prepare_store([str(corpus_dir)], str(tokenizer_dir), str(out), progress=False)
        assert sorted(p.name for p in tmp_path.iterdir()) == before
        fcntl.flock(held, fcntl.LOCK_UN)
    store = prepare_store([str(corpus_dir)], str(tokenizer_dir), str(out), progress=False)
    assert store.num_tokens > 0 and not (tmp_path / ".store.prepare").exists()


def test_an_output_whose_parent_is_a_file_is_a_clear_error(tmp_path, tokenizer_dir, corpus_dir):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(StoreError, match=r"cannot create the folder of the output .*a-file"):
        prepare_store(
            [str(corpus_dir)], str(tokenizer_dir), str(blocker / "sub" / "store"), progress=False
        )
    assert blocker.read_text() == "not a folder"


@pytest.mark.parametrize("spelling", [".", "../here/.", "../here"])
def test_an_output_spelled_as_the_current_empty_folder_is_prepared_there(
    tmp_path, tokenizer_dir, corpus_dir, monkeypatch, spelling
):
    reference = prepare_store(
        [str(corpus_dir)], str(tokenizer_dir), str(tmp_path / "ref"), progress=False
    )
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    store = prepare_store([str(corpus_dir)], str(tokenizer_dir), spelling, progress=False)
    assert store.fingerprint == reference.fingerprint
    assert (here / "tokens.bin").read_bytes() == (tmp_path / "ref" / "tokens.bin").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here", "ref"]  # no staging left


def test_a_store_inside_an_input_folder_is_skipped_and_a_store_as_input_refused(
    tmp_path, tokenizer_dir, corpus_dir
):
    """A store prepared into its corpus folder holds no raw text: the next prepare of the
    folder skips it (same fingerprint as before it was there); naming it is refused."""
    first = prepare_store([str(corpus_dir)], str(tokenizer_dir), str(corpus_dir / "store"))
    again = prepare_store([str(corpus_dir)], str(tokenizer_dir), str(tmp_path / "again"))
    assert again.fingerprint == first.fingerprint
    with pytest.raises(StoreError, match=r"is a token store \(made by zephon prepare\), not raw"):
        prepare_store([str(corpus_dir / "store")], str(tokenizer_dir), str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------- issue 18


def test_a_dataset_dict_prepares_its_train_split_unless_asked(tmp_path, tokenizer_dir):
    """A saved DatasetDict with train and validation splits: the store holds the train
    rows only (held-out rows never train silently); another split or all of them when
    asked; the manifest records the splits read."""
    datasets = pytest.importorskip("datasets")
    rows = {"train": 200, "validation": 100}
    datasets.DatasetDict(
        {
            name: datasets.Dataset.from_dict({"text": [corpus_text(k, 6) for k in range(n)]})
            for name, n in rows.items()
        }
    ).save_to_disk(str(tmp_path / "dd"))

    def prepare(out: str, **kw) -> TokenStore:
        return prepare_store([str(tmp_path / "dd")], str(tokenizer_dir), str(tmp_path / out),
                             progress=False, **kw)  # fmt: skip

    report: dict = {}
    train = prepare("train", report=report)
    assert train.num_documents == 200 and train.manifest["sources"][0]["splits"] == ["train"]
    assert report["splits"] == [
        {"source": "dd", "read": ["train"], "present": ["train", "validation"]}
    ]
    assert prepare("explicit", split="train").fingerprint == train.fingerprint
    validation = prepare("validation", split="validation")
    assert validation.num_documents == 100
    assert validation.manifest["sources"][0]["splits"] == ["validation"]
    every = prepare("all", split="all")
    assert every.num_documents == 300
    assert every.manifest["sources"][0]["splits"] == ["train", "validation"]
    assert np.array_equal(every.tokens[: train.num_tokens], train.tokens)  # sorted: train first
    with pytest.raises(StoreError, match=r"DatasetDict with the splits \['train', 'validation'\]; "
                       "it has no split 'test'. Choose one with --split NAME, or --split all"):  # fmt: skip
        prepare("out", split="test")
    _no_leftovers(tmp_path)


def test_stores_of_other_inputs_keep_their_manifest(tmp_path):
    """The split is recorded only where a DatasetDict was read: the store of other inputs
    has the fingerprint the previous version gave it (pinned), with any split asked."""
    from torchtitan_zephon.ingest.builtin import TOKENIZER_DIR

    (tmp_path / "c" / "sub").mkdir(parents=True)
    (tmp_path / "c" / "a.txt").write_text("alpha beta gamma\n")
    (tmp_path / "c" / "sub" / "b.jsonl").write_text(
        '{"text": "delta epsilon"}\n{"text": "zeta eta theta"}\n'
    )
    for split in ("", "validation"):
        s = prepare_store([str(tmp_path / "c")], str(TOKENIZER_DIR), str(tmp_path / f"s{split}"),
                          progress=False, split=split)  # fmt: skip
        assert s.fingerprint == "e70bb69c19bb2b565f31a26b2ecf3c32862c4a8ee29e0d682efe5eedf40b92b3"
        assert all("splits" not in src for src in s.manifest["sources"])


def test_files_opening_with_a_bom_prepare_the_store_of_the_same_files_without(
    tmp_path, tokenizer_dir
):
    """Tokens and documents equal those of the same files without a byte-order mark (the
    sources' content hashes, so the fingerprint, differ: they are other bytes)."""
    lines = "".join(json.dumps({"text": corpus_text(k, 12)}) + "\n" for k in range(40))
    for folder, bom in (("plain", b""), ("bom", b"\xef\xbb\xbf")):
        root = tmp_path / folder
        root.mkdir()
        (root / "a.txt").write_bytes(bom + corpus_text(99, 30).encode())
        (root / "b.jsonl").write_bytes(bom + lines.encode())
        (root / "c.jsonl.gz").write_bytes(gzip.compress(bom + lines.encode()))
        (root / "d.json").write_bytes(bom + json.dumps([{"text": "alpha beta"}]).encode())
    plain = prepare_store([str(tmp_path / "plain")], str(tokenizer_dir), str(tmp_path / "p"),
                          progress=False)  # fmt: skip
    marked = prepare_store([str(tmp_path / "bom")], str(tokenizer_dir), str(tmp_path / "m"),
                           progress=False, unit_bytes=500)  # several units of b.jsonl  # fmt: skip
    assert marked.num_documents == plain.num_documents == 1 + 40 + 40 + 1
    assert np.array_equal(marked.tokens, plain.tokens)
    assert np.array_equal(marked.doc_offsets, plain.doc_offsets)
