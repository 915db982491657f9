"""Training straight from raw inputs (issue 12, test 7c): a job whose --zephon.store is a
raw JSONL file trains on exactly the data of a job on `zephon prepare` of that file, and
bad raw inputs are refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.titan.expect import assert_losses, assert_refused, assert_same_data
from tests.titan.launch import copy_run_until, train
from torchtitan_zephon.cli.main import main
from torchtitan_zephon.ingest.builtin import TOKENIZER_DIR
from torchtitan_zephon.store.reader import TokenStore


def write_jsonl(path: Path, topics: int = 80) -> Path:
    """Python's documentation topics as JSON lines (~200k tokens: 8 steps of 8 samples of
    64 tokens plus 16 held out need ~5k)."""
    import pydoc_data.topics

    with open(path, "w") as f:
        for k in sorted(pydoc_data.topics.topics)[:topics]:
            f.write(json.dumps({"text": pydoc_data.topics.topics[k], "topic": k}) + "\n")
    return path


@pytest.mark.slow
def test_training_from_raw_jsonl_sees_the_data_of_its_prepared_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
):
    cache = tmp_path / "cache"
    monkeypatch.setenv("ZEPHON_CACHE", str(cache))  # the jobs inherit it
    data = write_jsonl(tmp_path / "docs.jsonl")
    store = tmp_path / "store"
    argv = ["prepare", str(data), "--tokenizer", str(TOKENIZER_DIR), "--output", str(store)]
    assert main([*argv, "--quiet", "--workers", "1"]) == 0

    raw = train(tmp_path / "raw", 2, "--zephon.store", str(data)).check().run
    prepared = train(tmp_path / "prepared", 2, "--zephon.store", str(store)).check().run

    # One cache entry, prepared by one of the two ranks, holding the same store.
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]
    assert TokenStore.open(entry).fingerprint == TokenStore.open(store).fingerprint
    output = (raw / "train.log").read_text()
    assert output.count("Zephon: preparing the raw inputs") == 1, output[-4000:]
    # Identical sequence logs (ids, token digests, chain) and the verify verdict on them.
    assert_same_data(prepared, raw, range(1, 9))
    capsys.readouterr()
    assert main(["verify", str(prepared), str(raw)]) == 0, capsys.readouterr()
    # Same data, same topology, same seed: the same losses, bit for bit.
    assert_losses(prepared, raw, range(1, 9), rtol=0)

    # A restart resumes the raw run from step 4 under another spelling of the same file (a
    # glob): the same cache entry, found without preparing again, and the same data.
    resumed = copy_run_until(raw, tmp_path / "resumed", 4)
    log = tmp_path / "resumed.log"
    train(resumed, 2, "--zephon.store", f"{tmp_path}/*.jsonl", log=log).check()
    assert "Zephon: preparing" not in log.read_text()
    assert_same_data(prepared, resumed, range(1, 9))
    assert_losses(prepared, resumed, range(1, 9), rtol=0)


def test_missing_raw_inputs_are_refused_before_anything_is_written(tmp_path: Path):
    run = tmp_path / "run"
    job = train(
        run, 2, "--zephon.store", f"{tmp_path}/corpus/*.jsonl", log=tmp_path / "refused.log"
    )
    assert_refused(job, "input pattern", "corpus/*.jsonl' matches no file")
    assert not run.exists()


def _dataset_dict(path: Path) -> Path:
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict(
        {
            name: datasets.Dataset.from_dict({"text": [f"{name} document {k}" for k in range(n)]})
            for name, n in (("train", 20), ("validation", 10))
        }
    ).save_to_disk(str(path))
    return path


# slow (issue 44 part e): the raw-input messages in-process
# (test_raw_input_errors_name_the_trainers_options), the refusal path end to end by default
@pytest.mark.slow
def test_a_split_the_dataset_dict_lacks_is_refused_in_the_trainers_spelling(tmp_path: Path):
    """Issue 18: the trainer reads raw DatasetDict inputs by split (--zephon.split); one
    it does not have is refused before anything is written, listing the splits there
    and naming the option as the trainer spells it."""
    data = _dataset_dict(tmp_path / "dd")
    run = tmp_path / "run"
    job = train(run, 2, "--zephon.store", str(data), "--zephon.split", "test",
                log=tmp_path / "refused.log")  # fmt: skip
    assert_refused(
        job,
        "is a Hugging Face DatasetDict with the splits ['train', 'validation']; it has no "
        "split 'test'. Choose one with --zephon.split NAME, or --zephon.split all",
    )
    assert "--split" not in job.output.replace("--zephon.split", "")
    assert not run.exists()


def test_raw_input_errors_name_the_trainers_options(tmp_path: Path, monkeypatch):
    """The trainer's raw-input errors name --zephon.text_field / --zephon.split (zephon
    prepare's say --text-field / --split), and a DatasetDict reads zephon.split."""
    from tests.titan.test_dataloader import job
    from torchtitan_zephon.job.settings import raw_inputs
    from torchtitan_zephon.job.stores import store_location
    from torchtitan_zephon.store.format import StoreError

    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "cache"))
    data = write_jsonl(tmp_path / "docs.jsonl", topics=3)
    config = job(tmp_path, store=str(data), text_field="body")
    with pytest.raises(StoreError) as e:
        store_location(str(data), raw_inputs(config))
    assert "unknown text field 'body'; fields present: ['text', 'topic']" in str(e.value)
    assert "Choose one with --zephon.text_field." in str(e.value)
    assert "--text-field" not in str(e.value)
    dd = _dataset_dict(tmp_path / "dd")
    for split, documents in (("", 20), ("validation", 10), ("all", 30)):
        location = store_location(str(dd), raw_inputs(job(tmp_path, store=str(dd), split=split)))
        assert TokenStore.open(location).num_documents == documents
    with pytest.raises(StoreError) as e:  # end to end: the slow test above
        store_location(str(dd), raw_inputs(job(tmp_path, store=str(dd), split="test")))
    assert (
        "is a Hugging Face DatasetDict with the splits ['train', 'validation']; it has no "
        "split 'test'. Choose one with --zephon.split NAME, or --zephon.split all"
    ) in str(e.value)
    assert "--split" not in str(e.value).replace("--zephon.split", "")
