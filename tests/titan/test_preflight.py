"""The preflight, without torchrun: which checkpoint a job resumes (TorchTitan's rule, corrupt
and incomplete ones skipped), what it refuses, and that deciding writes nothing."""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.titan.expect import assert_unchanged, tree
from torchtitan_zephon.order.data_config import DataConfig, DataStateMismatch
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.state import DataState
from torchtitan_zephon.run import recorded as runs
from torchtitan_zephon.titan.start import preflight
from torchtitan_zephon.titan.start.decision import StartRefused, choose_checkpoint
from torchtitan_zephon.titan.start.preflight import decide_start
from torchtitan_zephon.tracker import SequenceTracker, log_path

CONFIG = DataConfig.make(
    seq_len=64,
    seed=0,
    schedule=BatchSchedule([(1, 8)]),
    sample_offset=0,
    num_samples=1000,
    store_fingerprint="f" * 64,
    tokenizer_hash="t" * 64,
)
TOPOLOGY = {"world_size": 1, "dp_degree": 1, "nnodes": 1}


def job(run: Path, **checkpoint) -> SimpleNamespace:
    ck = dict(
        enable=True,
        folder="checkpoint",
        load_step=-1,
        initial_load_path=None,
        initial_load_model_only=True,
        initial_load_in_hf=False,
        exclude_from_loading=[],
    )
    ck.update(checkpoint)
    zephon = SimpleNamespace(
        allow_changes=[], ignore_log_mismatch=False, start_over=False, audit="ids"
    )
    return SimpleNamespace(  # the fields of titan.settings.job_view.JobView the preflight reads
        dump_folder=str(run),
        steps=8,
        checkpoint=SimpleNamespace(**ck),
        zephon=zephon,
    )


def write_log(run: Path, steps: int) -> list[dict]:
    """A log of ``steps`` steps under CONFIG; returns each step's chain head."""
    tracker = SequenceTracker(log_path(run), config=CONFIG, writer=True)
    tracker.start(TOPOLOGY)
    heads = []
    for s in range(1, steps + 1):
        tracker.record(s, (s - 1) * 8, np.arange((s - 1) * 8, s * 8))
        heads.append(tracker.head())
    return heads


def save(run: Path, step: int, *, head: dict | None = None, model_only: bool = False) -> Path:
    """A DCP checkpoint like TorchTitan's: model weights, and unless ``model_only`` the
    optimizer, train state and Zephon data state of ``step``."""
    state: dict = {"tok_embeddings.weight": torch.arange(4096.0).reshape(64, 64)}
    if not model_only:
        data = DataState(CONFIG, step + 1, step * 8, tracker=head)
        state["optimizer"] = {"state.tok_embeddings.weight.exp_avg": torch.zeros(64, 64)}
        state["train_state"] = {"step": step}
        state["dataloader"] = {"zephon": data.to_json()}
    path = run / "checkpoint" / f"step-{step}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def shard(path: Path) -> Path:
    (found,) = path.glob("*.distcp")
    return found


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A run folder: log of 8 steps, full checkpoints at 4 and 8."""
    heads = write_log(tmp_path, 8)
    save(tmp_path, 4, head=heads[3])
    save(tmp_path, 8, head=heads[7])
    return tmp_path


@pytest.fixture
def current_config(monkeypatch: pytest.MonkeyPatch) -> DataConfig:
    """Stand in for the store and train-spec checks (tested end to end elsewhere)."""
    monkeypatch.setattr(preflight, "_check_job", lambda job, build_tokenizer: (None, CONFIG))
    return CONFIG


# ---------------------------------------------------------------- verifying checkpoints


def test_verify_checkpoint_finds_short_and_missing_shards_and_a_bad_metadata(run: Path):
    ck8 = run / "checkpoint" / "step-8"
    ok = runs.checkpoints(run, verify=True)
    assert [(c.step, c.status, c.holds) for c in ok] == [
        (4, "complete", "training"),
        (8, "complete", "training"),
    ]
    size = shard(ck8).stat().st_size
    os.truncate(shard(ck8), size - 1)
    (c8,) = [c for c in runs.checkpoints(run, verify=True) if c.step == 8]
    assert c8.status == "corrupt" and not c8.resumable
    assert c8.problem == (
        f"shard {shard(ck8).name} is truncated: {size - 1} bytes, its .metadata needs at "
        f"least {size}"
    )
    shard(ck8).unlink()
    (c8,) = [c for c in runs.checkpoints(run, verify=True) if c.step == 8]
    assert c8.problem == "shard __0_0.distcp is missing"
    os.truncate(ck8 / ".metadata", 10)
    (c8,) = [c for c in runs.checkpoints(run, verify=True) if c.step == 8]
    assert c8.status == "corrupt" and c8.problem.startswith(".metadata is unreadable")


# ---------------------------------------------------------------- choosing


def test_newest_good_checkpoint_is_chosen_and_pinned(run: Path):
    os.truncate(shard(run / "checkpoint" / "step-8"), 100)
    j = job(run)
    before = tree(run)
    chosen, plan, _ = choose_checkpoint(j)
    # TorchTitan loads what was checked: the trainer pins checkpoint.load_step to it
    assert chosen.step == 4 and plan.load_step == 4
    assert [(c.step, c.status) for c in plan.skipped] == [(8, "corrupt")]
    assert_unchanged(before, tree(run))
    # the same files give every rank the same choice
    j2 = job(run)
    chosen2, plan2, _ = choose_checkpoint(j2)
    assert chosen2.step == 4 and plan2.load_step == 4


def test_incomplete_newest_checkpoint_is_skipped(run: Path):
    (run / "checkpoint" / "step-8" / ".metadata").unlink()
    chosen, plan, _ = choose_checkpoint(job(run))
    assert chosen.step == 4 and [(c.step, c.status) for c in plan.skipped] == [(8, "incomplete")]


def test_no_loadable_checkpoint_is_refused(run: Path):
    for step in (4, 8):
        os.truncate(shard(run / "checkpoint" / f"step-{step}"), 100)
    with pytest.raises(StartRefused, match="no checkpoint in .* can be loaded .*step-4: shard"):
        choose_checkpoint(job(run))


def test_explicit_load_step_of_a_corrupt_checkpoint_is_refused(run: Path):
    os.truncate(shard(run / "checkpoint" / "step-8"), 100)
    with pytest.raises(StartRefused, match="--checkpoint.load_step=8 names .* which is corrupt"):
        choose_checkpoint(job(run, load_step=8))
    with pytest.raises(StartRefused, match="--checkpoint.load_step=6 but .* does not exist"):
        choose_checkpoint(job(run, load_step=6))
    chosen, _, _ = choose_checkpoint(job(run, load_step=4))
    assert chosen.step == 4


def test_initial_load_follows_torchtitans_rule_and_remote_uris_are_left_to_it(tmp_path: Path):
    """TorchTitan takes checkpoint.initial_load_path whenever its newest-checkpoint rule
    finds nothing: no checkpoint folder, or one whose step folders are all incomplete (a
    first save cut short). Zephon checks the path in both cases; a remote URI it cannot
    read: model only, TorchTitan's to load (noted); a whole run, refused."""
    (tmp_path / "checkpoint" / "step-10").mkdir(parents=True)  # no .metadata: incomplete
    missing = tmp_path / "nowhere" / "step-3"
    with pytest.raises(StartRefused, match=rf"initial_load_path {missing} is incomplete"):
        choose_checkpoint(job(tmp_path, initial_load_path=str(missing)))
    uri = "gs://bucket/run/checkpoint/step-1000"
    chosen, plan, why = choose_checkpoint(job(tmp_path, initial_load_path=uri))
    assert chosen is None and why == f"--checkpoint.initial_load_path {uri} is loaded model only"
    assert plan.notes == [
        f"checkpoint.initial_load_path {uri} is a remote URI, loaded model only: TorchTitan "
        "reads it; Zephon does not check it before the start"
    ]
    with pytest.raises(StartRefused, match="is a remote URI: Zephon resumes a run"):
        choose_checkpoint(job(tmp_path, initial_load_path=uri, initial_load_model_only=False))


def test_an_explicit_load_step_abandons_the_checkpoints_after_it(run: Path):
    save(run, 6)
    chosen, plan, _ = choose_checkpoint(job(run, load_step=4))
    assert chosen.step == 4 and [c.step for c in plan.abandoned] == [6, 8]
    assert choose_checkpoint(job(run))[1].abandoned == []  # the newest: nothing abandoned


def test_checkpointing_off_or_nothing_saved_resumes_nothing(run: Path, tmp_path_factory):
    assert choose_checkpoint(job(run, enable=False))[0] is None
    fresh = tmp_path_factory.mktemp("fresh")
    chosen, _, why = choose_checkpoint(job(fresh))
    assert chosen is None and "no checkpoint folder" in why


# ---------------------------------------------------------------- refusing


def test_model_only_checkpoint_names_the_last_full_one(run: Path, current_config):
    import shutil

    shutil.rmtree(run / "checkpoint" / "step-8")
    save(run, 8, model_only=True)
    before = tree(run)
    with pytest.raises(StartRefused) as e:
        decide_start(job(run), writer=True)
    assert "step-8 holds only the model" in str(e.value)
    assert "--checkpoint.load_step 4 (steps 5..8 trained again" in str(e.value)
    assert "--checkpoint.no-last_save_model_only" in str(e.value)
    assert_unchanged(before, tree(run))
    assert decide_start(job(run, load_step=4), writer=True).resume.step == 4


def test_resume_checks_the_data_config_and_the_log_without_writing(run: Path, current_config):
    j = job(run)
    plan = decide_start(j, writer=True)
    assert plan.resume.step == 8 and plan.state.next_step == 9
    # another log (its step 8 has another chain), without the index sidecars: the check
    # reads the whole log and must not rebuild the index (a refused start writes nothing)
    log_path(run).unlink()
    for sidecar in log_path(run).parent.glob("*.jsonl.*"):
        sidecar.unlink()
    other = SequenceTracker(log_path(run), config=CONFIG, writer=True)
    other.start(TOPOLOGY)
    for s in range(1, 9):
        other.record(s, (s - 1) * 8, np.arange(s, s + 8))
    for sidecar in log_path(run).parent.glob("*.jsonl.*"):
        sidecar.unlink()
    before = tree(run)
    with pytest.raises(StartRefused, match="does not match the checkpoint of step 8"):
        decide_start(job(run), writer=True)
    assert_unchanged(before, tree(run))
    j = job(run)
    j.zephon.ignore_log_mismatch = True  # accepted here; the dataloader warns and marks it
    assert decide_start(j, writer=True).resume.step == 8
    assert decide_start(job(run), writer=False).resume.step == 8  # the log is rank 0's


def test_changed_data_config_is_refused_with_the_trainer_hint(run: Path, monkeypatch):
    monkeypatch.setattr(
        preflight, "_check_job", lambda j, build: (None, dataclasses.replace(CONFIG, seed=3))
    )
    with pytest.raises(DataStateMismatch, match="(?s)seed: 0 -> 3.*--zephon.allow_changes"):
        decide_start(job(run), writer=False)
    j = job(run)
    j.zephon.allow_changes = ["seed"]
    assert decide_start(j, writer=False).resume.step == 8


@pytest.mark.parametrize("exclude", ["dataloader", "train_state"])
def test_excluding_the_data_or_trainer_state_is_refused(run: Path, current_config, exclude):
    with pytest.raises(StartRefused, match=f"'{exclude}' is in checkpoint.exclude_from_loading"):
        decide_start(job(run, exclude_from_loading=[exclude]), writer=False)


def test_history_not_resumed_is_refused_unless_start_over_or_same_job(run: Path, current_config):
    before = tree(run)
    with pytest.raises(StartRefused) as e:
        decide_start(job(run, enable=False), writer=True)
    message = str(e.value)
    assert "holds checkpoints step-4, step-8 and a sequence log with steps 1..8" in message
    assert "(checkpoint.enable is false)" in message and "--zephon.start_over" in message
    assert_unchanged(before, tree(run))
    assert decide_start(job(run, enable=False), writer=False).notes == []  # rank 0 decides
    j = job(run, enable=False)
    j.zephon.start_over = True
    assert "zephon.start_over" in decide_start(j, writer=True).notes[0]
    plan = decide_start(job(run, enable=False), writer=True, same_job=True)
    assert "an elastic restart of this job" in plan.notes[0]


def test_log_with_steps_and_no_checkpoint_is_refused_when_another_run_wrote_it(
    tmp_path: Path, current_config, monkeypatch
):
    write_log(tmp_path, 3)
    other = dataclasses.replace(CONFIG, seed=3)  # the job's data config differs from the log's
    monkeypatch.setattr(preflight, "_check_job", lambda job, build_tokenizer: (None, other))
    before = tree(tmp_path)
    with pytest.raises(StartRefused, match="holds a sequence log with steps 1..3"):
        decide_start(job(tmp_path), writer=True)
    assert_unchanged(before, tree(tmp_path))
    # a log with a start event only (a job that died before its first step) is no history
    log_path(tmp_path).unlink()
    for sidecar in log_path(tmp_path).parent.glob("*.jsonl.*"):
        sidecar.unlink()
    SequenceTracker(log_path(tmp_path), config=CONFIG, writer=True).start(TOPOLOGY)
    assert decide_start(job(tmp_path), writer=True).resume is None


def test_a_requeue_that_checkpointed_nothing_starts_again(tmp_path: Path, current_config):
    """Issue 43 case 5: the same command run again after a kill before the first
    checkpoint (a scheduler's requeue) starts from step 1, saying so; an interrupted
    checkpoint is not one. A whole checkpoint it does not load is another history."""
    write_log(tmp_path, 3)
    (tmp_path / "checkpoint" / "step-2").mkdir(parents=True)  # killed while saving
    start = decide_start(job(tmp_path), writer=True)
    assert start.resume is None
    assert any("(a requeue). It starts again from step 1" in n for n in start.notes)
    save(tmp_path, 4, head=None)
    with pytest.raises(StartRefused, match="holds checkpoints"):
        decide_start(job(tmp_path, enable=False), writer=True)


# ---------------------------------------------------------------- the job's data (issue 18)


@pytest.fixture(scope="module")
def lines_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store of Python's documentation lines (short documents), builtin tokenizer."""
    import json
    import pydoc_data.topics

    from torchtitan_zephon.ingest.builtin import TOKENIZER_DIR
    from torchtitan_zephon.ingest.prepare import prepare_store

    root = tmp_path_factory.mktemp("lines")
    with open(root / "lines.jsonl", "w") as f:
        for k in sorted(pydoc_data.topics.topics)[:20]:
            for line in pydoc_data.topics.topics[k].splitlines():
                if line.strip():
                    f.write(json.dumps({"text": line}) + "\n")
    prepare_store([str(root / "lines.jsonl")], str(TOKENIZER_DIR), str(root / "store"))
    return root / "store"


def small_store(lines_store: Path, folder: Path, samples: int, seq_len: int = 64) -> Path:
    """A store of exactly ``samples`` samples of ``seq_len`` (whole short documents)."""
    from torchtitan_zephon.store.reader import TokenStore
    from torchtitan_zephon.store.writer import slice_store

    store = slice_store(
        TokenStore.open(lines_store), 0, samples * seq_len + 1 + seq_len // 2, folder
    )
    assert store.num_samples(seq_len) == samples, store.num_tokens
    return folder


def open_store(path: Path | str):  # noqa: ANN201 - a TokenStore
    from torchtitan_zephon.store.reader import TokenStore

    return TokenStore.open(path)


def data_job(tmp: Path, **fields):  # noqa: ANN201 - a JobView
    """The trainer's view of the tiny job as the data checks read it (seq_len 64);
    ``fields``: JobView fields (seq_len, local_batch_size, hf_assets_path, dump_folder),
    the rest the zephon section's."""
    from tests.titan.test_dataloader import job as loader_job

    view_fields = {k: fields.pop(k) for k in list(fields) if k in VIEW_FIELDS}
    view = loader_job(tmp, **fields)
    return dataclasses.replace(view, **{"seq_len": 64, **view_fields})


VIEW_FIELDS = ("seq_len", "local_batch_size", "hf_assets_path", "dump_folder")


def build_tokenizer(view):  # noqa: ANN001, ANN201
    """The job's tokenizer as Zephon's trainer builds it for the preflight (TorchTitan's)."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return lambda: HuggingFaceTokenizer.Config().build(tokenizer_path=view.hf_assets_path)


def test_a_store_too_short_or_too_small_is_refused_saying_what_to_change(lines_store, tmp_path):
    from torchtitan_zephon.titan.start.job_data import resolve_data

    short = small_store(lines_store, tmp_path / "short", 0)
    tokens = open_store(short).num_tokens
    with pytest.raises(ValueError) as e:
        resolve_data(data_job(tmp_path, store=str(short), heldout_samples=16))
    assert str(e.value) == (
        f"the store {short} has {tokens} tokens, but a sample of seq_len 64 needs seq_len + 1 = "
        "65 tokens (its inputs and the label of the last one), so it holds no sample. To "
        f"change it: use --training.seq_len {(tokens - 1) // 18} or less (the longest that "
        "gives 18 samples), or use a larger store."
    )
    seventeen = small_store(lines_store, tmp_path / "seventeen", 17)
    tokens = open_store(seventeen).num_tokens
    for heldout, message in [
        (16, f"the store {seventeen} (seq_len 64, 16 held out) has 1 training sample: every "
         "step would train on that one sample alone, repeated to fill the global batch (8 at "
         "step 1), whatever the seed or the number of ranks. A single store needs at least 2. "
         "To change it: lower --zephon.heldout_samples (now 16), or use --training.seq_len "
         f"{(tokens - 1) // 18} or less (the longest that gives 18 samples), or use a larger "
         "store."),
        (17, f"zephon.heldout_samples=17 must be in [0, 17): the store {seventeen} has 17 "
         "samples of seq_len 64. To change it: lower --zephon.heldout_samples (now 17)"),
    ]:  # fmt: skip
        with pytest.raises(ValueError) as e:
            resolve_data(data_job(tmp_path, store=str(seventeen), heldout_samples=heldout))
        assert str(e.value).startswith(message), str(e.value)
    # refused whatever the layout: the verdict is the data config's, not the topology's
    for local in (1, 2, 8):
        cfg = data_job(tmp_path, store=str(seventeen), heldout_samples=16, local_batch_size=local)
        with pytest.raises(ValueError, match="has 1 training sample"):
            resolve_data(cfg)
    # two training samples: trained on, with the warning
    source = resolve_data(data_job(tmp_path, store=str(seventeen), heldout_samples=15))
    assert source.warnings == [
        f"the store {seventeen} (seq_len 64, 15 held out) has 2 training samples, fewer than "
        "the global batch of 8 from step 1 on (batch schedule entry 1:8): every such step "
        "repeats samples within itself. Use a larger store or a smaller global batch."
    ]
    assert resolve_data(data_job(tmp_path, store=str(seventeen), heldout_samples=9)).warnings == []


def test_builtin_and_raw_stores_get_the_same_size_checks(lines_store, tmp_path, monkeypatch):
    """The builtin store and raw inputs reach the same check, named as the user named them."""
    from torchtitan_zephon.ingest.builtin import builtin_store_path
    from torchtitan_zephon.titan.start.job_data import resolve_data

    builtin = open_store(builtin_store_path())
    seq_len = (builtin.num_tokens - 1) // 19  # 19 samples: 3 to train on
    cfg = data_job(tmp_path, store="", heldout_samples=16, seq_len=seq_len)
    source = resolve_data(cfg)
    assert source.warnings == [
        f"the builtin store ({builtin.path}) (seq_len {cfg.seq_len}, 16 held out) has "
        "3 training samples, fewer than the global batch of 8 from step 1 on (batch schedule "
        "entry 1:8): every such step repeats samples within itself. Use a larger store or a "
        "smaller global batch."
    ]
    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "cache"))
    raw = tmp_path / "notes.txt"
    raw.write_text("hello world, a short note of a few dozen tokens.\n" * 8)
    cfg = data_job(tmp_path, store=str(raw), heldout_samples=0, seq_len=1)
    entry = resolve_data(cfg).path  # prepared into the cache on first use
    assert str(tmp_path / "cache") in entry and resolve_data(cfg).warnings == []
    cfg = dataclasses.replace(cfg, seq_len=(open_store(entry).num_tokens - 1) // 4)
    assert resolve_data(cfg).warnings == [
        f"the store {str(raw)!r} ({entry}) (seq_len {cfg.seq_len}) has 4 training "
        "samples, fewer than the global batch of 8 from step 1 on (batch schedule entry 1:8): "
        "every such step repeats samples within itself. Use a larger store or a smaller "
        "global batch."
    ]


@pytest.fixture(scope="module")
def own_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(tokenizer folder, store) of a small word-level tokenizer that is not the builtin."""
    from tests.conftest import build_tokenizer, corpus_text
    from torchtitan_zephon.ingest.prepare import prepare_store

    root = tmp_path_factory.mktemp("own")
    (root / "corpus").mkdir()
    for k in range(30):
        (root / "corpus" / f"d{k}.txt").write_text(corpus_text(k, 120))
    tokenizer = build_tokenizer(root / "tokenizer")
    prepare_store([str(root / "corpus")], str(tokenizer), str(root / "store"), progress=False)
    return tokenizer, root / "store"


def test_a_missing_or_unloadable_tokenizer_is_refused_naming_the_store_tokenizer(
    lines_store, own_store, tmp_path
):
    """TorchTitan's tokenizer error (or the tokenizers library's) becomes a refusal naming
    model.hf_assets_path, the sha256 the store records and where the builtin tokenizer is."""
    import hashlib

    from torchtitan_zephon.ingest.builtin import TOKENIZER_DIR

    builtin_sha = hashlib.sha256((TOKENIZER_DIR / "tokenizer.json").read_bytes()).hexdigest()
    missing = tmp_path / "no_such_folder"
    cfg = data_job(
        tmp_path, store=str(lines_store), heldout_samples=16, hf_assets_path=str(missing)
    )
    with pytest.raises(StartRefused) as e:
        preflight._check_job(cfg, build_tokenizer(cfg))
    assert str(e.value) == (
        f"hf_assets_path = {str(missing)!r} does not exist; TorchTitan builds the job's "
        f"tokenizer from that folder (its tokenizer.json). The store {lines_store} was prepared "
        f"with tokenizer sha256 {builtin_sha}, the builtin tokenizer in {TOKENIZER_DIR}: set "
        f"--hf_assets_path {TOKENIZER_DIR} (TOML: [model] hf_assets_path). Nothing was "
        "changed on disk."
    )
    # a store of another tokenizer: its sha256, and the builtin one is not it
    own, store = own_store
    own_sha = hashlib.sha256((own / "tokenizer.json").read_bytes()).hexdigest()
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{ not json")
    for path, found in [
        (missing, "does not exist"),
        (empty, "holds no tokenizer TorchTitan can load (No supported tokenizer files found"),
        (broken, "holds no tokenizer TorchTitan can load ("),
        (own / "tokenizer.json", "is a file, not a folder"),
    ]:
        cfg = data_job(tmp_path, store=str(store), heldout_samples=16, hf_assets_path=str(path))
        with pytest.raises(StartRefused) as e:
            preflight._check_job(cfg, build_tokenizer(cfg))
        msg = str(e.value)
        assert msg.startswith(f"hf_assets_path = {str(path)!r} {found}"), msg
        assert (
            f"The store {store} was prepared with tokenizer sha256 {own_sha}; the builtin "
            f"tokenizer in {TOKENIZER_DIR} is another one (sha256 {builtin_sha}). Point "
            "--hf_assets_path at the folder holding the tokenizer.json the data was "
            "prepared with"
        ) in msg
    cfg = dataclasses.replace(cfg, hf_assets_path=str(own))  # the right one: the checks pass
    assert preflight._check_job(cfg, build_tokenizer(cfg))[1].tokenizer_hash == own_sha
    # a mixture of builtin halves: the sources' tokenizer, the builtin one
    mixture = tmp_path / "halves.toml"
    mixture.write_text(
        '[[source]]\nname = "docs"\nstore = "builtin:docs"\n[[source]]\nname = "stdlib"\n'
        'store = "builtin:stdlib"\n[[schedule]]\nfrom_step = 1\nweights = { docs = 1, stdlib = 1 }\n'
    )
    cfg = data_job(tmp_path, mixture=str(mixture), heldout_samples=16, hf_assets_path=str(missing))
    with pytest.raises(StartRefused) as e:
        preflight._check_job(cfg, build_tokenizer(cfg))
    assert (
        f"The mixture {mixture} (sources docs, stdlib) was prepared with tokenizer sha256 "
        f"{builtin_sha}, the builtin tokenizer in {TOKENIZER_DIR}: set --hf_assets_path"
    ) in str(e.value)


# ---------------------------------------------------------------- the same, under torchrun


# slow (issue 44 part e): the same message in-process
# (test_a_missing_or_unloadable_tokenizer_is_refused_naming_the_store_tokenizer), the
# preflight refusal path end to end by default
@pytest.mark.slow
def test_the_trainer_refuses_a_missing_tokenizer_folder_naming_the_store_tokenizer(
    lines_store, tmp_path
):
    """Issue 18: a prepared store and no tokenizer at model.hf_assets_path was a 30-line
    traceback into TorchTitan's tokenizer; now a refusal, and nothing is written."""
    import hashlib

    from tests.titan.expect import assert_refused
    from tests.titan.launch import train
    from torchtitan_zephon.ingest.builtin import TOKENIZER_DIR

    sha = hashlib.sha256((TOKENIZER_DIR / "tokenizer.json").read_bytes()).hexdigest()
    run, missing = tmp_path / "run", tmp_path / "tokenizer"
    job = train(run, 1, "--zephon.store", str(lines_store), "--model.hf_assets_path",
                str(missing), log=tmp_path / "refused.log")  # fmt: skip
    assert_refused(
        job,
        f"hf_assets_path = {str(missing)!r} does not exist",
        f"The store {lines_store} was prepared with tokenizer sha256 {sha}, the builtin "
        f"tokenizer in {TOKENIZER_DIR}: set --hf_assets_path {TOKENIZER_DIR}",
    )
    assert "Traceback" not in job.output.split("Zephon refused to start")[0]
    assert not run.exists()


# slow (issue 44 part e): the store-size checks in-process
# (test_a_store_too_short_or_too_small_is_refused_saying_what_to_change), the preflight
# refusal path end to end by default
@pytest.mark.slow
def test_the_trainer_refuses_a_store_of_one_training_sample(lines_store, tmp_path):
    """Issue 18: a store smaller than one global batch trained silently on repeats. One
    training sample is refused, and nothing is written; three train, with one warning
    (rank 0) naming the store, its samples and the batch (below)."""
    from tests.titan.expect import assert_refused
    from tests.titan.launch import train

    one = small_store(lines_store, tmp_path / "one", 17)  # tiny.toml holds 16 out
    run = tmp_path / "run_one"
    job = train(run, 1, "--zephon.store", str(one), log=tmp_path / "refused.log")
    assert_refused(
        job,
        f"the store {one} (seq_len 64, 16 held out) has 1 training sample: every step would "
        "train on that one sample alone, repeated to fill the global batch (8 at step 1)",
        "lower --zephon.heldout_samples (now 16)",
    )
    assert not run.exists()


# slow (issue 44 part e): the store-size checks in-process
# (test_a_store_too_short_or_too_small_is_refused_saying_what_to_change), the preflight
# refusal path end to end by default
@pytest.mark.slow
def test_the_trainer_warns_once_for_a_store_smaller_than_a_batch(lines_store, tmp_path):
    from tests.titan.launch import train

    three = small_store(lines_store, tmp_path / "three", 19)
    job = train(tmp_path / "run_three", 2, "--zephon.store", str(three), "--training.steps", "1",
                "--checkpoint.no-enable", "--validation.no-enable").check()  # fmt: skip
    warning = (
        f"Zephon: the store {three} (seq_len 64, 16 held out) has 3 training samples, fewer "
        "than the global batch of 8 from step 1 on (batch schedule entry 1:8): every such "
        "step repeats samples within itself."
    )
    assert job.output.count(warning) == 1, job.output[-4000:]


def test_a_mixture_tokenizer_mismatch_names_the_source_without_the_jobs_tokenizer(
    own_store, tmp_path
):
    """Two sources, two tokenizers, no majority: model.hf_assets_path decides which source
    is the odd one out (here the second in name order, not simply 'the other one')."""
    from torchtitan_zephon.ingest.builtin import TOKENIZER_DIR
    from torchtitan_zephon.order.mixture.config import MixtureError
    from torchtitan_zephon.titan.start.job_data import resolve_data

    own, store = own_store
    mixture = tmp_path / "mixed.toml"
    mixture.write_text(
        f'[[source]]\nname = "a_words"\nstore = "{store}"\n[[source]]\nname = "docs"\n'
        'store = "builtin:docs"\n[[schedule]]\nfrom_step = 1\nweights = { a_words = 1, docs = 1 }\n'
    )
    for tokenizer, odd, right in ((TOKENIZER_DIR, "a_words", "docs"), (own, "docs", "a_words")):
        cfg = data_job(
            tmp_path, mixture=str(mixture), heldout_samples=4, hf_assets_path=str(tokenizer)
        )
        with pytest.raises(MixtureError) as e:
            resolve_data(cfg)
        assert (
            f"The odd one out: '{odd}' ('{right}' has the tokenizer of hf_assets_path "
            f"({tokenizer})). Re-run `zephon prepare` for '{odd}' with the tokenizer of "
            f"'{right}'."
        ) in str(e.value), str(e.value)


def test_a_misspelt_allow_changes_is_refused_at_every_start(tmp_path: Path):
    """A typo in --zephon.allow_changes was accepted on a fresh start and ended the
    resume it was meant for in a traceback: it is a refusal naming the option and every
    accepted value, before anything is written."""
    from torchtitan_zephon.titan.start.decision import StartRefused
    from torchtitan_zephon.titan.start.preflight import decide_start

    cfg = data_job(tmp_path, allow_changes=["sed"], dump_folder=str(tmp_path / "run"))
    with pytest.raises(StartRefused) as e:
        decide_start(cfg, writer=True)
    message = str(e.value)
    assert message.startswith("--zephon.allow_changes: unknown allow_changes entry 'sed'; "
                              "expected one of all, "), message  # fmt: skip
    assert "seed, seq_len" in message and "[" not in message.split("(TOML")[0], message
    assert not (tmp_path / "run").exists()


def test_too_few_held_out_samples_are_refused_before_anything_is_written(tmp_path):
    """Validation reads held-out samples in whole global batches: fewer than one (one
    store, or a mixture source that has some) was the validator's ValueError, a traceback
    after TorchTitan had written tb/, structured_logs/ and the lock; now the preflight's
    refusal, with validation on only."""
    from tests.titan.expect import assert_refused
    from tests.titan.launch import train

    run = tmp_path / "run"
    job = train(run, 1, "--zephon.heldout_samples", "4", log=tmp_path / "refused.log")
    assert_refused(
        job,
        "validation needs at least one global batch (8 samples) of held-out data; "
        "zephon.heldout_samples is 4. Set --zephon.heldout_samples to a multiple of 8.",
    )
    assert not run.exists()
    mixture = tmp_path / "halves.toml"
    mixture.write_text(
        '[[source]]\nname = "docs"\nstore = "builtin:docs"\nheldout_samples = 16\n'
        '[[source]]\nname = "stdlib"\nstore = "builtin:stdlib"\nheldout_samples = 3\n'
        "[[schedule]]\nfrom_step = 1\nweights = { docs = 1, stdlib = 1 }\n"
    )
    view = data_job(tmp_path, mixture=str(mixture))
    gbs = view.global_batch_size
    on = dataclasses.replace(view, validation=dataclasses.replace(view.validation, enable=True))
    with pytest.raises(ValueError) as e:  # decide_start says it as StartRefused (above)
        preflight._check_job(on, None)
    assert str(e.value) == (
        f"validation reads held-out samples in global batches of {gbs}; mixture source "
        f"'stdlib' holds 3 (heldout_samples). Set its heldout_samples to a multiple of {gbs}, "
        "or to 0 to not validate it."
    )
    off = dataclasses.replace(view, validation=dataclasses.replace(view.validation, enable=False))
    preflight._check_job(off, None)  # no validation: held-out samples are only left out
