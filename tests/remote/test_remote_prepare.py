"""`zephon prepare` with raw inputs and outputs in object storage (ingest/objects.py), on
a real S3 API on loopback: the store of the same files has the same fingerprint as from
local disk, the output is uploaded manifest last, and bad input is one line with nothing
written."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import corpus_text
from tests.remote.conftest import SECRET, SESSION
from torchtitan_zephon.cli.main import main
from torchtitan_zephon.ingest.objects import _matches
from torchtitan_zephon.ingest.prepare import prepare_store
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.remote import RemoteTokenStore


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """JSONL (plain, gz), Parquet and text files, in a folder with a subfolder and a
    hidden file."""
    root = tmp_path_factory.mktemp("raw") / "corpus"
    (root / "sub").mkdir(parents=True)
    for k in range(3):
        lines = "".join(json.dumps({"text": corpus_text(10 * k + j, 40)}) + "\n" for j in range(9))
        (root / f"p{k}.jsonl.gz").write_bytes(gzip.compress(lines.encode(), mtime=0))
    (root / "plain.jsonl").write_text(
        "".join(json.dumps({"text": corpus_text(90 + j, 25)}) + "\n" for j in range(7))
    )
    texts = [corpus_text(200 + j, 30) for j in range(20)]
    pq.write_table(pa.table({"text": texts}), root / "sub" / "t.parquet", row_group_size=5)
    (root / "sub" / "notes.txt").write_text(corpus_text(300, 60))
    (root / ".hidden.jsonl").write_text('{"text": "never read"}\n')
    return root


@pytest.fixture(scope="module")
def bucket_corpus(s3, corpus: Path) -> str:
    for p in sorted(corpus.rglob("*")):
        if p.is_file():
            s3.put(f"raw/corpus/{p.relative_to(corpus).as_posix()}", p.read_bytes())
    return f"s3://{s3.bucket}/raw/corpus"


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def _keys(s3, prefix: str) -> list[str]:
    found = s3.client.list_objects_v2(Bucket=s3.bucket, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"] for o in found)


@pytest.mark.parametrize(
    "pattern",
    ["*.jsonl.gz", "", "sub/*.parquet", "**/*.jsonl*"],
    ids=["glob-gz", "prefix", "parquet", "recursive"],
)
def test_the_store_of_objects_is_the_store_of_the_same_files(
    tmp_path: Path, tokenizer_dir: Path, corpus: Path, bucket_corpus: str, pattern: str
) -> None:
    local_input = str(corpus / pattern) if pattern else str(corpus)
    remote_input = f"{bucket_corpus}/{pattern}" if pattern else bucket_corpus
    local = prepare_store([local_input], str(tokenizer_dir), str(tmp_path / "l"), progress=False)
    cache = tmp_path / "cache"
    remote = prepare_store([remote_input], str(tokenizer_dir), str(tmp_path / "r"),
                           progress=False, cache_dir=str(cache))  # fmt: skip
    assert remote.fingerprint == local.fingerprint
    assert [s["name"] for s in remote.manifest["sources"]] == [
        s["name"] for s in local.manifest["sources"]
    ]
    files = sorted(p.name for p in (tmp_path / "r").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "l").iterdir())
    assert all(
        (tmp_path / "r" / f).read_bytes() == (tmp_path / "l" / f).read_bytes() for f in files
    )
    assert not [p for p in cache.rglob("*") if p.is_file()]  # spool files removed


def test_one_object_and_a_list(
    tmp_path: Path, tokenizer_dir: Path, corpus: Path, bucket_corpus: str
):
    local = prepare_store([f"{corpus}/p1.jsonl.gz,{corpus}/plain.jsonl"], str(tokenizer_dir),
                          str(tmp_path / "l"), progress=False)  # fmt: skip
    remote = prepare_store([f"{bucket_corpus}/p1.jsonl.gz,{bucket_corpus}/plain.jsonl"],
                           str(tokenizer_dir), str(tmp_path / "r"), progress=False,
                           cache_dir=str(tmp_path / "c"))  # fmt: skip
    assert remote.fingerprint == local.fingerprint
    one = prepare_store([f"{bucket_corpus}/plain.jsonl"], str(tokenizer_dir),
                        str(tmp_path / "one"), progress=False, cache_dir=str(tmp_path / "c"))  # fmt: skip
    assert [s["name"] for s in one.manifest["sources"]] == ["plain.jsonl"]


def test_prepare_writes_a_store_to_the_bucket_manifest_last(
    capsys, s3, tmp_path: Path, tokenizer_dir: Path, corpus: Path, bucket_corpus: str, monkeypatch
) -> None:
    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "cache"))
    local = prepare_store([str(corpus)], str(tokenizer_dir), str(tmp_path / "l"), progress=False)
    code, out, err = _cli(capsys, "prepare", bucket_corpus, "--tokenizer", str(tokenizer_dir),
                          "--output", f"s3://{s3.bucket}/out/store", "--quiet", "--workers", "1")  # fmt: skip
    assert code == 0, err
    assert f"fingerprint {local.fingerprint}" in out
    assert _keys(s3, "out/store/") == sorted(
        f"out/store/{n}"
        for n in (
            "manifest.json",
            "tokens.bin",
            "doc_offsets.bin",
            "checksums.bin",
            "blocks.bin",
            "blocks.json",
        )  # fmt: skip
    )
    store = TokenStore.open(f"s3://{s3.bucket}/out/store")
    assert isinstance(store, RemoteTokenStore) and store.fingerprint == local.fingerprint
    assert main(["inspect", f"s3://{s3.bucket}/out/store", "--check"]) == 0
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]  # nothing kept
    assert list((tmp_path / "cache" / "remote-output").iterdir()) == []
    # a second prepare into the same prefix: refused, the store as it was
    before = _keys(s3, "out/")
    code, _, err = _cli(capsys, "prepare", bucket_corpus, "--tokenizer", str(tokenizer_dir),
                        "--output", f"s3://{s3.bucket}/out/store", "--quiet")  # fmt: skip
    assert code == 2 and err == (
        f"zephon prepare: error: output s3://{s3.bucket}/out/store already holds a token "
        "store (manifest.json); choose another prefix or delete it first.\n"
    )
    assert _keys(s3, "out/") == before
    for text in (out, err):
        assert SECRET not in text and SESSION not in text


def test_a_prefix_without_its_manifest_is_no_store_and_is_written_over(
    capsys, s3, tmp_path: Path, tokenizer_dir: Path, store_path: Path, bucket_corpus: str,
    monkeypatch,
) -> None:  # fmt: skip
    """An upload cut before manifest.json (every other file there) is not a store; a
    prepare into it writes the store."""
    url = s3.upload(store_path, "half/store", skip=("manifest.json",))
    code, _, err = _cli(capsys, "inspect", url)
    assert code == 2 and f"{url} holds no token store: it has no manifest.json" in err
    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "cache"))
    code, out, err = _cli(capsys, "prepare", f"{bucket_corpus}/plain.jsonl", "--tokenizer",
                          str(tokenizer_dir), "--output", url, "--quiet")  # fmt: skip
    assert code == 0, err
    assert TokenStore.open(url).num_documents == 7


def test_an_output_prefix_holding_other_objects_is_refused(
    capsys, s3, tmp_path: Path, tokenizer_dir: Path, bucket_corpus: str, monkeypatch
) -> None:
    s3.put("busy/store/notes.txt", b"mine")
    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "cache"))
    code, _, err = _cli(capsys, "prepare", bucket_corpus, "--tokenizer", str(tokenizer_dir),
                        "--output", f"s3://{s3.bucket}/busy/store", "--quiet")  # fmt: skip
    assert code == 2 and err == (
        f"zephon prepare: error: output s3://{s3.bucket}/busy/store already exists: it holds "
        "1 object(s) ('notes.txt'); choose another prefix or delete them first.\n"
    )
    assert _keys(s3, "busy/") == ["busy/store/notes.txt"]
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "inputs, output, message",
    [
        (["s3://no-such-bucket-zephon/raw/*.jsonl"], "OUT",
         "the bucket of s3://no-such-bucket-zephon/raw does not exist"),
        (["s3://zephon-test/raw/corpus/*.csv"], "OUT",
         "input pattern 's3://zephon-test/raw/corpus/*.csv' matches no object (7 under "
         "s3://zephon-test/raw/corpus/)"),
        (["s3://zephon-test/raw/nothing-here"], "OUT",
         "input 's3://zephon-test/raw/nothing-here' holds no object (nothing is stored under it)"),
        (["s3://zephon-test/raw/corpus", "LOCAL"], "OUT",
         "the inputs mix local paths"),
        (["s3://zephon-test/raw/corpus"], "s3://zephon-test/out/*",
         "--output 's3://zephon-test/out/*' is a pattern"),
        (["s3://zephon-test/raw/corpus"], "s3://zephon-test",
         "--output 's3://zephon-test' names a whole bucket"),
        (["s3://zephon-test/raw/corpus"], "gopher://x/y", "has the URL scheme 'gopher'"),
    ],
    ids=["missing-bucket", "no-match", "empty-prefix", "mixed", "glob-output", "bucket-output",
         "scheme"],
)  # fmt: skip
def test_bad_input_is_one_line_and_writes_nothing(
    capsys, s3, bucket_corpus, tmp_path, tokenizer_dir, corpus, monkeypatch, inputs, output, message
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "cache"))
    inputs = [str(corpus / "plain.jsonl") if i == "LOCAL" else i for i in inputs]
    before = _keys(s3, "")
    code, out, err = _cli(capsys, "prepare", *inputs, "--tokenizer", str(tokenizer_dir),
                          "--output", str(tmp_path / "out") if output == "OUT" else output,
                          "--quiet")  # fmt: skip
    assert code == 2, err
    assert err.startswith("zephon prepare: error: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # no output, no cache, no folder "s3:"
    assert _keys(s3, "") == before


def test_missing_credentials_name_the_variables(
    capsys, s3, bucket_corpus, tmp_path, tokenizer_dir, monkeypatch
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.chdir(tmp_path)
    code, _, err = _cli(capsys, "prepare", f"{bucket_corpus}/*.jsonl.gz", "--tokenizer",
                        str(tokenizer_dir), "--output", str(tmp_path / "out"))  # fmt: skip
    assert code == 2 and err.count("\n") == 1, err
    assert "AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN)" in err
    assert list(tmp_path.iterdir()) == []


def test_two_ranks_under_torchrun_read_the_bucket(
    s3, tmp_path: Path, tokenizer_dir: Path, corpus: Path, bucket_corpus: str
) -> None:
    """`torchrun --nproc-per-node 2 ... prepare s3://...` writes the store of one local
    process; each rank streams only the objects of its units."""
    local = prepare_store([str(corpus)], str(tokenizer_dir), str(tmp_path / "l"), progress=False)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "torchtitan_zephon", "prepare", bucket_corpus, "--tokenizer", str(tokenizer_dir),
           "--output", f"s3://{s3.bucket}/ranks/store", "--workers", "1", "--quiet"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "ZEPHON_CACHE": str(tmp_path / "cache")}  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "(2 ranks)" in res.stdout and f"fingerprint {local.fingerprint}" in res.stdout
    assert TokenStore.open(f"s3://{s3.bucket}/ranks/store").fingerprint == local.fingerprint
    for text in (res.stdout, res.stderr):
        assert SECRET not in text and SESSION not in text
    for p in (tmp_path / "cache").rglob("*"):
        if p.is_file():
            data = p.read_bytes()
            assert SECRET.encode() not in data and SESSION.encode() not in data, p


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.sampled_from(["a", "b.jsonl", ".h", "x.gz", "d"]), min_size=1, max_size=4),
    pattern=st.lists(
        st.sampled_from(["*", "**", "a", "*.jsonl", ".*", "?", "[ab]*", "d"]),
        min_size=1,
        max_size=4,
    ),
)
def test_patterns_match_as_a_local_glob_does(tmp_path_factory, parts, pattern) -> None:
    """``objects._matches`` against Python's glob on the same names on local disk (the
    slow reference: a real folder)."""
    import glob

    root = tmp_path_factory.mktemp("g")
    path = root.joinpath(*parts)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    except (FileExistsError, NotADirectoryError, IsADirectoryError):
        return
    found = {
        Path(m).relative_to(root).as_posix()
        for m in glob.glob(str(root.joinpath(*pattern)), recursive=True)
        if os.path.isfile(m)  # not Path(m): it drops the "/" of "a/", a match of "a/**"
    }
    assert _matches(parts, pattern) == ("/".join(parts) in found)


def test_plan_from_raw_objects_uses_the_cache_keyed_by_etag_and_size(
    capsys, s3, tmp_path: Path, tokenizer_dir: Path, corpus: Path, bucket_corpus: str
) -> None:
    """`zephon plan --store s3://.../*.jsonl.gz --tokenizer DIR` prepares the objects into
    the cache as the trainer does: the plan of the local files; a second run finds the
    entry without preparing (no object is fetched again); a replaced object (another ETag)
    makes another entry."""
    cache = tmp_path / "cache"
    common = ["--tokenizer", str(tokenizer_dir), "--cache-dir", str(cache), "--seq-len", "16",
              "--global-batch-size", "4", "--seed", "3", "--steps", "1:3", "--json"]  # fmt: skip
    code, local, err = _cli(capsys, "plan", "--store", f"{corpus}/*.jsonl.gz", *common)
    assert code == 0, err
    url = f"s3://{s3.bucket}/plan/corpus"
    for p in sorted(corpus.glob("*.jsonl.gz")):
        s3.put(f"plan/corpus/{p.name}", p.read_bytes())
    code, remote, err = _cli(capsys, "plan", "--store", f"{url}/*.jsonl.gz", *common)
    assert code == 0, err
    assert remote == local and remote.count('"ids"') == 3
    entries = sorted(p.name for p in cache.iterdir() if p.name.startswith("raw-") and p.is_dir())
    assert len(entries) == 2  # the local files' entry and the objects' entry
    fingerprints = {json.loads((cache / f"{e}.json").read_text())["fingerprint"] for e in entries}
    assert len(fingerprints) == 1  # the same store, from disk and from the bucket
    assert not [p for p in (cache / "remote-inputs").rglob("*") if p.is_file()]
    fetched = cache / "remote-inputs"
    code, again, _ = _cli(capsys, "plan", "--store", f"{url}/*.jsonl.gz", *common)
    assert code == 0 and again == local
    assert not fetched.exists() or not any(fetched.rglob("*"))
    assert len([p for p in cache.iterdir() if p.name.startswith("raw-") and p.is_dir()]) == 2
    s3.put("plan/corpus/p0.jsonl.gz", gzip.compress(b'{"text": "replaced"}\n', mtime=0))
    code, changed, _ = _cli(capsys, "plan", "--store", f"{url}/*.jsonl.gz", *common)
    assert code == 0
    assert len([p for p in cache.iterdir() if p.name.startswith("raw-") and p.is_dir()]) == 3
    keys = [json.loads(p.read_text()) for p in cache.glob("raw-*.json")]
    remote_keys = [k for k in keys if k["inputs"].startswith("s3://")]
    assert len(remote_keys) == 2
    for k in remote_keys:
        assert [row[2] for row in k["files"]] == [f"{url}/p{j}.jsonl.gz" for j in range(3)]


def test_a_bad_object_is_named_by_its_url_and_a_query_string_never_shown(
    capsys, s3, tmp_path: Path, tokenizer_dir: Path, monkeypatch
) -> None:
    """A corrupt object's error names its URL (not the spool file); a URL's query string
    (a signature, a SAS token) appears in no message and no file."""
    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "cache"))
    s3.put("bad/corpus/a.jsonl", b'{"text": "fine"}\n')
    s3.put("bad/corpus/b.jsonl", b'{"body": "no text field"}\n')
    code, _, err = _cli(capsys, "prepare", f"s3://{s3.bucket}/bad/corpus/*.jsonl", "--tokenizer",
                        str(tokenizer_dir), "--output", str(tmp_path / "out"), "--quiet")  # fmt: skip
    assert code == 2 and err.count("\n") == 1, err
    assert f"s3://{s3.bucket}/bad/corpus/b.jsonl" in err and "remote-inputs" not in err, err
    assert "--text-field" in err
    assert not (tmp_path / "out").exists()
    signed = f"s3://{s3.bucket}/nothing/*.jsonl?X-Amz-Signature={SECRET}"
    code, _, err = _cli(capsys, "prepare", signed, "--tokenizer", str(tokenizer_dir),
                        "--output", str(tmp_path / "out2"), "--quiet")  # fmt: skip
    assert code == 2 and err.count("\n") == 1, err
    assert SECRET not in err and "?<redacted>" in err, err
    for p in tmp_path.rglob("*"):
        if p.is_file():
            assert SECRET.encode() not in p.read_bytes(), p


def test_a_pattern_is_no_store_for_inspect_or_plan(capsys, s3) -> None:
    code, _, err = _cli(capsys, "inspect", f"s3://{s3.bucket}/out/*")
    assert code == 2 and err.count("\n") == 1
    assert f"'s3://{s3.bucket}/out/*' is a pattern; a store is one prefix" in err
    code, _, err = _cli(capsys, "plan", "--store", f"s3://{s3.bucket}/out/*", "--seq-len", "4",
                        "--global-batch-size", "2", "--seed", "1", "--steps", "1:2")  # fmt: skip
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "is a pattern" in err and "--tokenizer" in err  # raw inputs need a tokenizer


def test_an_input_replaced_after_listing_says_run_prepare_again(s3, tmp_path: Path) -> None:
    """The ETag listed is sent as If-Match: a replaced input object is refused with
    prepare's words (not the trainer's "a store must not be rewritten in place")."""
    from torchtitan_zephon.ingest.objects import fetch, list_inputs
    from torchtitan_zephon.store.format import StoreError

    s3.put("moving/a.jsonl", b'{"text": "before"}\n')
    [(_, src)] = list_inputs(f"s3://{s3.bucket}/moving/a.jsonl", tmp_path / "spool")
    s3.put("moving/a.jsonl", b'{"text": "after, and longer"}\n')
    with pytest.raises(StoreError) as e:
        fetch(src)
    assert str(e.value) == (
        f"s3://{s3.bucket}/moving/a.jsonl changed while it was read (its ETag is no longer "
        "the one it had when listed). An input object must stay put while prepare reads "
        "it: run the same command again once it does (finished parts are reused; the "
        "object is read as it is then)."
    )
    assert "rewritten in place" not in str(e.value)
    assert not [p for p in (tmp_path / "spool").rglob("*") if p.is_file()]  # nothing kept


@pytest.mark.parametrize("key", ["edge/bucketlist.jsonl", "edge/container.jsonl", "edge/x.jsonl"])
def test_a_missing_object_is_told_from_a_missing_bucket_by_its_kind(
    capsys, s3, tmp_path, tokenizer_dir, monkeypatch, key
) -> None:
    """A key holding "bucket" or "container" is a missing object like any other."""
    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "cache"))
    s3.put("edge/present.jsonl", b'{"text": "here"}\n')
    code, _, err = _cli(capsys, "prepare", f"s3://{s3.bucket}/{key}", "--tokenizer",
                        str(tokenizer_dir), "--output", str(tmp_path / "out"))  # fmt: skip
    assert code == 2 and err == (
        f"zephon prepare: error: input 's3://{s3.bucket}/{key}' holds no object (nothing is "
        "stored under it); expected a text/JSONL/Parquet object, a prefix of them or a glob "
        "pattern.\n"
    )
    code, _, err = _cli(capsys, "prepare", "s3://no-such-bucket-zephon/edge/bucketlist.jsonl",
                        "--tokenizer", str(tokenizer_dir), "--output", str(tmp_path / "out"))  # fmt: skip
    assert code == 2 and err.startswith("zephon prepare: error: the bucket of s3://no-such-")
    assert "does not exist (or is not visible with these credentials)" in err


def test_prepare_cache_dir_holds_the_spool_and_the_upload_staging(
    capsys, s3, tmp_path, tokenizer_dir, bucket_corpus, monkeypatch
) -> None:
    """--cache-dir (ZEPHON_CACHE unset) is where a URL --output is built and inputs are
    spooled, as plan's --cache-dir and the trainer's zephon.cache_dir are."""
    monkeypatch.delenv("ZEPHON_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cache = tmp_path / "given"
    url = f"s3://{s3.bucket}/cachedir/store"
    code, out, err = _cli(capsys, "prepare", f"{bucket_corpus}/plain.jsonl", "--tokenizer",
                          str(tokenizer_dir), "--output", url, "--quiet",
                          "--cache-dir", str(cache))  # fmt: skip
    assert code == 0, err
    assert TokenStore.open(url).num_documents == 7
    assert sorted(p.name for p in cache.iterdir()) == ["remote-inputs", "remote-output"]
    assert not [p for p in cache.rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert not (tmp_path / "home").exists()  # not the default ~/.cache
    code, _, err = _cli(capsys, "prepare", f"{bucket_corpus}/plain.jsonl", "--tokenizer",
                        str(tokenizer_dir), "--output", str(tmp_path / "o"),
                        "--cache-dir", f"s3://{s3.bucket}/c")  # fmt: skip
    assert code == 2 and "--cache-dir 's3://" in err and "is a URL" in err
    assert not (tmp_path / "o").exists()


def test_a_failed_prepare_of_objects_leaves_no_spool_file_and_inspect_names_the_folders(
    capsys, s3, tmp_path, tokenizer_dir, bucket_corpus, monkeypatch
) -> None:
    """An empty corpus (every object holds no text) fails in one line and leaves no spool
    file; `zephon inspect CACHE` says what remote-inputs and remote-output hold (issue
    28, item 12)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("ZEPHON_CACHE", str(cache))
    s3.put("hollow/a.jsonl", b"")
    s3.put("hollow/b.jsonl", b"\n")
    code, _, err = _cli(capsys, "prepare", f"s3://{s3.bucket}/hollow/*.jsonl", "--tokenizer",
                        str(tokenizer_dir), "--output", str(tmp_path / "out"), "--quiet")  # fmt: skip
    assert code == 2 and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
    assert not [p for p in (cache / "remote-inputs").rglob("*") if p.is_file()]
    url = f"s3://{s3.bucket}/inspected/store"  # leaves remote-output beside it
    code, _, err = _cli(capsys, "prepare", f"{bucket_corpus}/plain.jsonl", "--tokenizer",
                        str(tokenizer_dir), "--output", url, "--quiet")  # fmt: skip
    assert code == 0, err
    code, out, err = _cli(capsys, "inspect", str(cache))
    assert code == 0, err
    assert "not made by zephon's cache" not in out
    assert "  object storage (2):\n" in out
    assert "remote-inputs  0 bytes, 0 files: spool files of raw objects a prepare is reading" in out
    assert "remote-output  0 bytes, 0 files: stores `zephon prepare --output URL` built here" in out


def test_a_sharded_store_is_written_to_the_bucket_by_each_rank_manifest_last(
    capsys, s3, tmp_path: Path, tokenizer_dir: Path, corpus: Path, monkeypatch
) -> None:
    """Issue 45 part a2: --shard-bytes into a bucket: two ranks upload their own shards,
    then rank 0 the shard list and the manifest; the one-file store's fingerprint."""
    from tests.ingest.test_prepare_distributed import _in_threads

    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "cache"))
    local = prepare_store([str(corpus)], str(tokenizer_dir), str(tmp_path / "l"), progress=False)
    url = f"s3://{s3.bucket}/sharded/store"
    results = _in_threads(
        2,
        lambda ranks: prepare_store(
            [str(corpus)], str(tokenizer_dir), url, progress=False, ranks=ranks,
            unit_bytes=2000, shard_bytes=700,
        ),
    )  # fmt: skip
    assert not any(isinstance(r, BaseException) for r in results), results
    keys = _keys(s3, "sharded/store/")
    shards = [k for k in keys if k.startswith("sharded/store/tokens/")]
    assert len(shards) > 2 and "sharded/store/tokens.bin" not in keys
    assert "sharded/store/shards.json" in keys
    store = TokenStore.open(url)
    assert isinstance(store, RemoteTokenStore) and store.shards == len(shards)
    assert store.fingerprint == local.fingerprint
    ids = np.arange(local.num_samples(64))
    np.testing.assert_array_equal(store.windows(ids, 64), local.windows(ids, 64))
    assert main(["inspect", url, "--check"]) == 0
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]  # nothing kept
