"""Store values and the store cache (``ingest.cache``, ``ingest.cache_folder``): raw
inputs are prepared once into a stat-keyed entry whose store equals ``zephon prepare``'s,
found again without reading the corpus, rebuilt when a file changes, refused clearly when
bad; the lock serializes builders and a failed build leaves no entry (only the parts
prepare finished, for the next run)."""

from __future__ import annotations

import builtins
import errno
import fcntl
import hashlib
import io
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import corpus_text
from torchtitan_zephon.ingest import cache, cache_folder
from torchtitan_zephon.ingest.cache import RawInputs
from torchtitan_zephon.ingest.inputs import OptionNames, resolve_inputs
from torchtitan_zephon.ingest.prepare import prepare_store
from torchtitan_zephon.ingest.tokenized import finished_units
from torchtitan_zephon.job.stores import open_mixture_stores, store_location
from torchtitan_zephon.order.mixture.config import MixtureConfig
from torchtitan_zephon.store.format import FORMAT_VERSION, StoreError
from torchtitan_zephon.store.reader import TokenStore


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.delenv(cache_folder.CACHE_ENV, raising=False)
    return tmp_path / "cache"


@pytest.fixture
def corpus(tmp_path) -> Path:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    for k in range(3):
        with open(root / f"part{k}.jsonl", "w") as f:
            for d in range(20):
                f.write(json.dumps({"text": corpus_text(10 * k + d, 40), "id": d}) + "\n")
    (root / "sub" / "notes.txt").write_text(corpus_text(99, 60))
    return root


def raw(tokenizer_dir: Path, cache_dir: Path, **kw) -> RawInputs:
    return RawInputs(tokenizer=str(tokenizer_dir), cache_dir=str(cache_dir), **kw)


def entries(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in cache_dir.iterdir() if p.is_dir()) if cache_dir.exists() else []


def test_raw_inputs_prepare_what_zephon_prepare_makes_however_spelled(
    tmp_path, tokenizer_dir, cache_dir, corpus
):
    reference = prepare_store(
        [str(corpus)], str(tokenizer_dir), str(tmp_path / "s"), progress=False
    )
    opts = raw(tokenizer_dir, cache_dir, workers=2)
    spellings = [
        str(corpus),
        f"{corpus}/*",
        f"{corpus}/part0.jsonl,{corpus}/part1.jsonl, {corpus}/part2.jsonl,{corpus}/sub",
        os.path.relpath(corpus) + "/",
    ]
    located = set()
    for value in spellings:
        location = store_location(value, opts)
        assert TokenStore.open(location).fingerprint == reference.fingerprint, value
        located.add(location)
    assert len(located) == 1 and entries(cache_dir) == [located.pop().name]
    (record,) = cache_dir.glob("raw-*.json")  # what the entry was prepared from
    info = json.loads(record.read_text())
    assert info["fingerprint"] == reference.fingerprint and info["text_field"] == "text"
    assert [s["sha256"] for s in info["sources"]] == [
        s["sha256"] for s in reference.manifest["sources"]
    ]


def test_a_hit_reads_no_input_file(tokenizer_dir, cache_dir, corpus, monkeypatch):
    opts = raw(tokenizer_dir, cache_dir)
    first = store_location(str(corpus), opts)

    def no_prepare(*a, **k):
        raise AssertionError("prepared again")

    real_open, real_io_open = builtins.open, io.open

    def guarded(opener):
        def open_(file, *a, **k):
            if isinstance(file, (str, os.PathLike)) and str(corpus) in os.path.realpath(file):
                raise AssertionError(f"read {file}")
            return opener(file, *a, **k)

        return open_

    monkeypatch.setattr("torchtitan_zephon.ingest.prepare.prepare_store", no_prepare)
    monkeypatch.setattr(builtins, "open", guarded(real_open))
    monkeypatch.setattr(io, "open", guarded(real_io_open))
    with pytest.raises(AssertionError, match="read"):  # the guard works
        (corpus / "part0.jsonl").read_bytes()
    assert store_location(str(corpus), opts) == first


@pytest.mark.parametrize("change", ["mtime", "size"])
def test_a_changed_file_makes_another_entry(tokenizer_dir, cache_dir, corpus, change):
    opts = raw(tokenizer_dir, cache_dir)
    first = store_location(str(corpus), opts)
    f = corpus / "part1.jsonl"
    if change == "mtime":  # same bytes, touched: stats are all the key knows
        st = f.stat()
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    else:
        with open(f, "a") as fh:
            fh.write(json.dumps({"text": "one more document"}) + "\n")
    second = store_location(str(corpus), opts)
    assert second != first and entries(cache_dir) == sorted([first.name, second.name])
    same = TokenStore.open(first).fingerprint == TokenStore.open(second).fingerprint
    assert same == (change == "mtime")


@pytest.mark.parametrize(
    "value, tokenizer, message",
    [
        (
            "{c}/missing.jsonl",
            None,
            r"token store '.*/missing.jsonl' does not exist.*or raw inputs",
        ),
        ("{c}/*.parquet", None, r"input pattern '.*/\*.parquet' matches no file"),
        ("{c}/part0.jsonl,{c}/gone.jsonl", None, r"input '.*/gone.jsonl' \(in .*\) does not exist"),
        ("{c}", "{t}/none", r"tokenizer.json in the tokenizer folder = '.*/none', but it does not"),
        ("{c}", "{c}/sub", r"but it holds \['notes.txt'\]"),
    ],
)
def test_bad_raw_inputs_are_refused_before_anything_is_written(
    tmp_path, tokenizer_dir, cache_dir, corpus, value, tokenizer, message
):
    opts = RawInputs(
        tokenizer=(tokenizer or str(tokenizer_dir)).format(t=tmp_path, c=corpus),
        cache_dir=str(cache_dir),
    )
    with pytest.raises(StoreError, match=message):
        store_location(value.format(c=corpus), opts)
    assert not cache_dir.exists()


def test_raw_inputs_without_a_tokenizer_are_refused(corpus):
    with pytest.raises(StoreError, match="names raw inputs, not a token store.*zephon prepare"):
        store_location(str(corpus))


def test_store_folders_stay_stores(tmp_path, store_path, cache_dir):
    assert store_location(str(store_path)) == store_path
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokens.bin").write_bytes(b"\0" * 8)  # a store whose manifest is missing
    assert store_location(str(broken), raw(tmp_path, cache_dir)) == broken
    with pytest.raises(StoreError, match="no manifest.json"):
        TokenStore.open(store_location(str(broken)))


def test_a_corrupt_file_is_named_leaves_no_entry_and_its_fix_resumes(
    tokenizer_dir, cache_dir, corpus
):
    """A failed build leaves no entry and frees the lock; the parts prepare finished
    stay where its message says, and the run after the fix reuses them."""
    good = (corpus / "part1.jsonl").read_text()
    with open(corpus / "part1.jsonl", "a") as f:
        f.write('{"text": "cut off\n')
    with pytest.raises(StoreError, match=r"part1.jsonl:21: invalid JSON") as e:
        store_location(str(corpus), raw(tokenizer_dir, cache_dir))
    assert [e for e in entries(cache_dir) if not e.startswith(".")] == []  # no entry
    assert list(cache_dir.glob("*.lock")) == []  # released, and removed while free
    (building,) = [p for p in cache_dir.iterdir() if p.name.startswith(".")]
    kept = building / ".store.prepare"
    assert f"kept in {kept}" in str(e.value) and finished_units(kept) == 1  # part0.jsonl, before it
    (corpus / "part1.jsonl").write_text(good)
    path = store_location(str(corpus), raw(tokenizer_dir, cache_dir))
    assert (
        TokenStore.open(path).fingerprint
        == prepare_store(
            [str(corpus)], str(tokenizer_dir), str(corpus.parent / "ref"), progress=False
        ).fingerprint
    )
    assert [p.name for p in cache_dir.iterdir() if p.name.startswith(".")] == []


def test_waiters_wait_for_the_lock_holder_and_say_so(tokenizer_dir, cache_dir, corpus):
    """A process that finds the entry's lock held waits (saying who holds it), then finds
    or builds the entry."""
    said: list[str] = []
    opts = raw(tokenizer_dir, cache_dir, log=said.append)
    cache_dir.mkdir()
    result: list[Path] = []
    # the entry's name, as the waiter will compute it: ask once in an empty cache copy
    probe = store_location(str(corpus), raw(tokenizer_dir, cache_dir / "probe"))
    work = json.loads((probe.parent / f"{probe.name}.json").read_text())["work"]
    with open(cache_dir / f"{work}.lock", "a+") as held:  # the inputs' lock, by name
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("node-7 pid 42\n")
        held.flush()
        waiter = threading.Thread(target=lambda: result.append(store_location(str(corpus), opts)))
        waiter.start()
        deadline = time.monotonic() + 60
        while not said and time.monotonic() < deadline:
            time.sleep(0.05)
        assert waiter.is_alive() and not result
        assert said and said[0].startswith("waiting for node-7 pid 42 to prepare the raw inputs")
        fcntl.flock(held, fcntl.LOCK_UN)
    waiter.join(120)
    assert result == [cache_dir / probe.name]
    assert TokenStore.open(result[0]).fingerprint == TokenStore.open(probe).fingerprint


def test_without_flock_each_process_builds_and_the_first_wins(
    tokenizer_dir, cache_dir, corpus, monkeypatch
):
    def refuse(fh, op):
        raise OSError(errno.ENOLCK, "No locks available")

    said: list[str] = []
    monkeypatch.setattr(cache_folder.fcntl, "flock", refuse)
    location = store_location(str(corpus), raw(tokenizer_dir, cache_dir, log=said.append))
    assert TokenStore.open(location).num_documents == 61
    assert any("refuses file locks" in s for s in said)
    assert [p.name for p in cache_dir.iterdir() if p.name.startswith(".")] == []


def test_an_edited_entry_is_refused(tokenizer_dir, cache_dir, corpus):
    opts = raw(tokenizer_dir, cache_dir)
    location = store_location(str(corpus), opts)
    manifest = json.loads((location / "manifest.json").read_text())
    manifest["sources"][0]["size"] += 1
    (location / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=r"cache entry .* does not hold what its key promises"):
        store_location(str(corpus), opts)


def test_mixture_sources_name_raw_inputs_relative_to_the_file(
    tmp_path, tokenizer_dir, cache_dir, corpus
):
    (tmp_path / "mix.toml").write_text(
        '[[source]]\nname = "jsonl"\nstore = "corpus/part0.jsonl,corpus/part1.jsonl"\n'
        '[[source]]\nname = "notes"\nstore = "corpus/sub"\n'
        "[[schedule]]\nfrom_step = 1\nweights = { jsonl = 1, notes = 1 }\n"
    )
    config = MixtureConfig.load(tmp_path / "mix.toml")
    assert config.sources[0].store == f"{tmp_path}/corpus/part0.jsonl,{tmp_path}/corpus/part1.jsonl"
    stores = open_mixture_stores(config, raw=raw(tokenizer_dir, cache_dir))
    expected = prepare_store(
        [f"{corpus}/part0.jsonl", f"{corpus}/part1.jsonl"],
        str(tokenizer_dir),
        str(tmp_path / "s"),
        progress=False,
    )
    assert stores["jsonl"].fingerprint == expected.fingerprint
    assert stores["notes"].num_documents == 1
    with pytest.raises(Exception, match="mixture source 'jsonl': .* names raw inputs"):
        open_mixture_stores(config)


def test_a_cache_folder_inside_the_inputs_is_refused(tokenizer_dir, corpus, monkeypatch):
    """The cache's own files (locks, entries) must never become inputs of the next run."""
    inside = corpus / "cache"
    with pytest.raises(StoreError, match=r"cache folder .*cache.* is inside the input folder"):
        store_location(str(corpus), raw(tokenizer_dir, inside))
    assert not inside.exists()
    hidden = corpus / ".cache"  # hidden names are not inputs: fine
    assert store_location(str(corpus), raw(tokenizer_dir, hidden)).parent == hidden


def test_a_cache_folder_that_cannot_be_made_is_a_clear_error(tokenizer_dir, corpus, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(StoreError, match=r"cannot create .*a-file/cache.*ZEPHON_CACHE"):
        store_location(str(corpus), raw(tokenizer_dir, blocker / "cache"))


# ----------------------------------------------------------------------------- issue 18


def test_the_split_of_a_dataset_dict_is_part_of_the_entry(tmp_path, tokenizer_dir, cache_dir):
    """Raw inputs holding a DatasetDict: the train split by default, another when asked,
    each its own entry equal to `zephon prepare --split` of it; a missing split is refused
    in the caller's spelling, listing the splits, before anything is written."""
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": [corpus_text(k, 8) for k in range(30)]}),
            "validation": datasets.Dataset.from_dict(
                {"text": [corpus_text(k, 5) for k in range(9)]}
            ),
        }
    ).save_to_disk(str(tmp_path / "dd"))
    value = str(tmp_path / "dd")
    located = {}
    for split in ("", "validation", "all"):
        located[split] = store_location(value, raw(tokenizer_dir, cache_dir, split=split))
        expected = prepare_store([value], str(tokenizer_dir), str(tmp_path / f"s-{split}"),
                                 progress=False, split=split)  # fmt: skip
        assert TokenStore.open(located[split]).fingerprint == expected.fingerprint
    assert [TokenStore.open(p).num_documents for p in located.values()] == [30, 9, 39]
    assert len(set(located.values())) == 3
    record = json.loads((cache_dir / f"{located['validation'].name}.json").read_text())
    assert record["splits"] == [["dd", ["validation"]]]
    assert record["sources"][0]["splits"] == ["validation"]
    assert store_location(value, raw(tokenizer_dir, cache_dir, split="train")) == located[""]
    before = sorted(p.name for p in cache_dir.iterdir())
    names = OptionNames(text_field="--zephon.text_field", split="--zephon.split")
    with pytest.raises(StoreError, match=r"splits \['train', 'validation'\]; it has no split "
                       "'test'. Choose one with --zephon.split NAME, or --zephon.split all"):  # fmt: skip
        store_location(value, raw(tokenizer_dir, cache_dir, split="test", names=names))
    assert sorted(p.name for p in cache_dir.iterdir()) == before


def test_inputs_without_a_dataset_dict_keep_their_entry(tmp_path, tokenizer_dir, cache_dir, corpus):
    """The split joins the key only where a DatasetDict is read: the entry of other inputs
    keeps the name earlier versions gave it (so existing caches still hit)."""
    location = store_location(str(corpus), raw(tokenizer_dir, cache_dir, split="validation"))
    sources = resolve_inputs([str(corpus)])
    tokenizer_sha = hashlib.sha256((tokenizer_dir / "tokenizer.json").read_bytes()).hexdigest()
    key = {  # the key as issue 12 defined it
        "format": "zephon-raw-inputs/1",
        "store_version": FORMAT_VERSION,
        "tokenizer_sha256": tokenizer_sha,
        "text_field": "text",
        "files": cache.stat_listing(sources),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    assert location.name == f"raw-{digest[:24]}"


def test_lock_files_are_removed_when_free_and_never_let_two_in(tokenizer_dir, cache_dir, corpus):
    """A holder removes its lock file before releasing it; a process that waited on the
    removed file does not take it for the lock: it locks the file now at the path, so it
    keeps waiting while a newer holder has that one."""
    said: list[str] = []
    probe = store_location(str(corpus), raw(tokenizer_dir, cache_dir / "probe"))
    assert list((cache_dir / "probe").glob("*.lock")) == []  # built, and no lock left
    work = json.loads((probe.parent / f"{probe.name}.json").read_text())["work"]
    lock = cache_dir / f"{work}.lock"
    result: list[Path] = []
    old = open(lock, "a+")  # noqa: SIM115 - the first holder
    fcntl.flock(old, fcntl.LOCK_EX)
    old.write("node-1 pid 1\n")
    old.flush()
    waiter = threading.Thread(
        target=lambda: result.append(
            store_location(str(corpus), raw(tokenizer_dir, cache_dir, log=said.append))
        )
    )
    waiter.start()
    _wait_until(lambda: said)  # it waits on the first holder's file
    assert said[0].startswith("waiting for node-1 pid 1 to prepare")
    lock.unlink()  # the first holder leaves as holders do: remove, then release
    with open(lock, "a+") as new:  # a second holder took the path meanwhile
        fcntl.flock(new, fcntl.LOCK_EX)
        new.write("node-2 pid 2\n")
        new.flush()
        fcntl.flock(old, fcntl.LOCK_UN)
        old.close()
        _wait_until(lambda: any("node-2 pid 2" in s for s in said))
        assert waiter.is_alive() and not result  # not in while node-2 holds the lock
        fcntl.flock(new, fcntl.LOCK_UN)
    waiter.join(120)
    assert result == [cache_dir / probe.name]
    assert list(cache_dir.glob("*.lock")) == []


def _wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_waiters_show_the_holders_progress(tokenizer_dir, cache_dir, corpus, monkeypatch):
    """While another process prepares, a waiter says how far it has come (units and bytes
    of input done out of the total, documents), refreshed as it moves."""
    from torchtitan_zephon.ingest import stage as prepare_module

    monkeypatch.setattr(cache_folder, "PROGRESS_REPORT_S", 0.05)
    monkeypatch.setattr(cache_folder, "PROGRESS_WRITE_S", 0.0)
    real = prepare_module.iter_documents
    started = threading.Event()

    def slow(src, text_field, extent=None):  # each unit takes a moment: progress to watch
        started.set()
        time.sleep(0.4)
        yield from real(src, text_field, extent)

    monkeypatch.setattr(prepare_module, "iter_documents", slow)
    said: list[str] = []
    built: list[Path] = []
    builder = threading.Thread(
        target=lambda: built.append(store_location(str(corpus), raw(tokenizer_dir, cache_dir)))
    )
    builder.start()
    assert started.wait(60)
    waited = store_location(str(corpus), raw(tokenizer_dir, cache_dir, log=said.append))
    builder.join(120)
    assert built == [waited]
    progress = [s for s in said if "units done" in s]
    assert len(progress) >= 2, said
    size = sum(f.stat().st_size for f in corpus.rglob("*") if f.is_file())
    assert (
        "of 4 units done, " in progress[0]
        and f"of {size / (1 << 20):,.1f} MiB of input" in progress[0]
    )
    done = [int(s.split("tokenizing, ")[1].split(" of 4")[0]) for s in progress]
    assert done == sorted(done) and done[-1] > done[0], said
    assert all(s.startswith(f"waiting for {socket.gethostname()} pid {os.getpid()} to prepare")
               for s in said)  # fmt: skip
    assert not (cache_dir / f".{waited.name}.building").exists()
    assert [p.name for p in cache_dir.iterdir() if p.name.startswith(".")] == []
