"""A store's packing index on disk (issue 31 part a1): built once per (store, seq_len)
into the cache, read back mapped, refused when it is not the store's or was edited; and
``zephon plan --packing best_fit`` prints the order over packed samples."""

from __future__ import annotations

import json

import numpy as np
import pytest

from torchtitan_zephon.cli.main import main
from torchtitan_zephon.job.packing import PIECES, document_lengths, open_packing, read_index
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.packing import pack
from torchtitan_zephon.order.stream import DataPlan
from torchtitan_zephon.store.format import MANIFEST, StoreError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_index_is_built_once_into_the_cache_and_read_back(store, cache):
    packed, folder = open_packing(store, 16)
    assert folder.parent == cache / "packing" / store.fingerprint
    assert folder.name == "best_fit-L16-v1"
    want = pack(document_lengths(store), 16)
    assert np.array_equal(packed.starts, want.starts) and np.array_equal(packed.pieces, want.pieces)
    assert packed.tokens() == store.num_tokens  # every token of the store, once
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["num_samples"] == packed.num_samples
    assert manifest["store_fingerprint"] == store.fingerprint
    stamp = (folder / PIECES).stat().st_mtime_ns
    again, same = open_packing(store, 16, workers=2)  # found, not built again
    assert same == folder and (folder / PIECES).stat().st_mtime_ns == stamp
    assert np.array_equal(again.pieces, packed.pieces)


def test_an_edited_index_is_refused_naming_the_folder(store, cache):
    _, folder = open_packing(store, 16)
    pieces = np.load(folder / PIECES)
    pieces[0, 2] += 1
    np.save(folder / PIECES, pieces)
    with pytest.raises(StoreError, match="does not hash to what its manifest records") as e:
        read_index(store, 16, folder)
    assert str(e.value).count(str(folder)) == 1  # named once (issue 43 case 13)


def test_open_packing_builds_a_damaged_index_again_saying_so_once(store, cache):
    """Issue 43 case 13: the index is a cache; a damaged one is built again, with one
    warning, and the result is the index built first."""
    packed, folder = open_packing(store, 16)
    want = np.array(packed.pieces)
    pieces = np.load(folder / PIECES)
    pieces[0, 2] += 1
    np.save(folder / PIECES, pieces)
    said: list[str] = []
    again, same = open_packing(store, 16, log=said.append)
    assert same == folder and np.array_equal(again.pieces, want)
    assert len(said) == 1 and said[0].count(str(folder)) == 1
    assert "pieces.npy does not hash to what its manifest records" in said[0]
    assert "it is a cache, so it is built again" in said[0]
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # nothing left
    (folder / "manifest.json").write_text("{not json")
    with pytest.warns(UserWarning, match="cannot be read"):
        assert open_packing(store, 16)[0].num_samples == packed.num_samples


def test_an_index_of_another_seq_len_is_refused(store, cache):
    _, folder = open_packing(store, 16)
    with pytest.raises(StoreError, match=r"at seq_len 32 \(it differs in seq_len\)"):
        read_index(store, 32, folder)


def test_plan_prints_the_order_over_packed_samples(store, store_path, cache, capsys):
    args = ["plan", "--store", str(store_path), "--seq-len", "16", "--seed", "5",
            "--global-batch-size", "4", "--json", "--packing", "best_fit"]  # fmt: skip
    packed, _ = open_packing(store, 16)
    epoch_steps = packed.num_samples // 4
    assert main([*args, "--steps", f"1:{epoch_steps}"]) == 0
    out = capsys.readouterr()
    lines = [json.loads(x) for x in out.out.splitlines()]
    plan = DataPlan(packed.num_samples, 5, BatchSchedule.parse("4"))
    assert all(x["ids"] == plan.global_ids(x["step"]).tolist() for x in lines)
    ids = [i for x in lines for i in x["ids"]]
    assert len(set(ids)) == len(ids) == epoch_steps * 4  # each packed sample once an epoch
    assert f"packing best_fit: {packed.num_samples} packed samples of seq_len 16" in out.err
    assert main([*args[:-2], "--steps", "1:1"]) == 0  # unpacked: the windows' ids
    windows = json.loads(capsys.readouterr().out)["ids"]
    assert (
        windows
        == DataPlan(store.num_samples(16), 5, BatchSchedule.parse("4")).global_ids(1).tolist()
    )


def test_plan_of_a_packed_mixture_prints_each_sources_packed_sample_ids(
    store, cache, tmp_path, capsys
):
    """``zephon plan --mixture FILE --packing best_fit``: each source packs its own
    documents; the keys printed are the trainer's (the packed ``JobData``'s plan)."""
    from torchtitan_zephon.job.data import JobData
    from torchtitan_zephon.order.mixture.config import MixtureConfig
    from torchtitan_zephon.store.writer import slice_store

    half = store.num_tokens // 2
    text = ""
    for name, (a, b) in {"a": (0, half), "b": (half, store.num_tokens)}.items():
        text += f'[[source]]\nname = "{name}"\nstore = "{slice_store(store, a, b, tmp_path / name).path}"\n'
    text += "[[schedule]]\nfrom_step = 1\nweights = { a = 0.25, b = 0.75 }\n"
    mixture = tmp_path / "m.toml"
    mixture.write_text(text)
    argv = ["plan", "--mixture", str(mixture), "--seq-len", "16", "--seed", "3",
            "--global-batch-size", "8", "--steps", "1:6", "--json", "--heldout-samples", "2",
            "--packing", "best_fit"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "mixture source 'a': packing best_fit:" in out.err
    assert "mixture source 'b': packing best_fit:" in out.err
    lines = [json.loads(x) for x in out.out.splitlines()]
    data = JobData.open_mixture(
        MixtureConfig.load(str(mixture)), 16, packing="best_fit", default_heldout=2
    )
    plan = data.plan(data.data_config(seed=3, schedule=BatchSchedule.parse("8")))
    for x in lines:
        names, ids = plan.decode(plan.global_ids(x["step"]))
        assert (x["sources"], x["ids"]) == (list(names), ids.tolist())
    assert main(argv[:-2]) == 0  # unpacked: the windows' ids, another plan
    assert [json.loads(x)["ids"] for x in capsys.readouterr().out.splitlines()] != [
        x["ids"] for x in lines
    ]


def test_plan_leaves_out_packed_sample_ids(store, store_path, cache, tmp_path, capsys):
    """With --packing an id of --exclude is a packed sample: from its step on it is never
    planned, and the others keep their order."""
    packed, _ = open_packing(store, 16)
    left = [packed.num_samples - 1, 3, 7]  # the last: past the count of windows
    exclude = tmp_path / "left.jsonl"
    exclude.write_text(json.dumps({"ids": left, "from_step": 2}) + "\n")
    args = ["plan", "--store", str(store_path), "--seq-len", "16", "--seed", "5",
            "--global-batch-size", "4", "--json", "--packing", "best_fit"]  # fmt: skip
    steps = packed.num_samples // 4 - 2
    assert main([*args, "--steps", f"2:{steps}", "--exclude", str(exclude)]) == 0
    ids = [i for x in capsys.readouterr().out.splitlines() for i in json.loads(x)["ids"]]
    assert not set(left) & set(ids) and len(set(ids)) == len(ids)
    assert packed.num_samples - 1 >= store.num_samples(16)  # a packed id, not a window's
