"""Old runs: a run checkpointed by the TorchTitan 0.2.2-based code resumes on 0.3.

The fixture ``old_run_022`` is a real run folder of the 0.2.2 code (see its
ORIGIN.md): 2 CPU ranks, the tiny job, 4 steps; its step-2 checkpoint, its
sequence log (steps 1..4) and its TensorBoard losses (steps 1..4). Resuming it on
0.3 from step 2 must see the data 0.2.2 saw at steps 3 and 4 and reach the losses
0.2.2 logged there.
"""

from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torchtitan.trainer", reason="TorchTitan 0.3 (torchtitan.trainer)")

from tests.titan.expect import (  # noqa: E402
    TOPOLOGY_RTOL,
    assert_losses,
    assert_refused,
    assert_same_data,
    assert_unchanged,
    resume_events,
    tree,
)
from tests.titan.launch import REPO, train  # noqa: E402
from torchtitan_zephon.migrate import old_runs  # noqa: E402
from torchtitan_zephon.run import recorded as runs  # noqa: E402
from torchtitan_zephon.titan import platform  # noqa: E402

platform.apply()

FIXTURE = Path(__file__).parent / "old_runs" / "run_022"
CHECKPOINT = FIXTURE / "checkpoint" / "step-2"
RESUME = ("--training.steps", "4", "--checkpoint.interval", "2", "--validation.no-enable")


def fixture_keys() -> frozenset[str]:
    info = runs.verify_checkpoint(runs.CheckpointInfo(2, CHECKPOINT, True, 0))
    assert info.problem is None and info.holds == "training", info
    return info.keys


def old_run(root: Path, name: str) -> Path:
    """A copy of the 0.2.2 run as a job that died after its step-2 checkpoint."""
    return Path(shutil.copytree(FIXTURE, root / name))


# ------------------------------------------------------------------ the map


def test_the_map_sends_every_022_llama3_key_onto_the_03_models():
    """Every key of the 0.2.2 checkpoint maps; the model keys land exactly on the 0.3
    llama3 tiny model's state_dict keys, the optimizer keys on its parameters."""
    from torchtitan_zephon.configs.config_registry import llama3_tiny

    keys = fixture_keys()
    old = old_runs.map_checkpoint(CHECKPOINT, keys, "llama3")
    assert old is not None and old.marker == "lr_scheduler._step_count"
    with torch.device("meta"):
        model = llama3_tiny().model_spec.model.build()
    model_keys = set(model.state_dict())
    parameters = {name for name, _ in model.named_parameters()}
    mapped = set(old.sources)
    assert {k for k in mapped if k.split(".")[0] not in runs.TRAINING_STATES} == model_keys
    optimizer = {k for k in mapped if k.startswith("optimizer.state.")}
    assert {k.removeprefix("optimizer.state.").rsplit(".", 1)[0] for k in optimizer} == parameters
    assert "layers.0.attention.qkv_linear.wqkv.weight" in parameters  # 0.3 fuses q/k/v
    assert old.sources["lm_head.weight"] == ["output.weight"]
    assert old.sources["layers.1.attention.qkv_linear.wk.weight"] == [
        "layers.1.attention.wk.weight"
    ]
    assert old.sources["optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg"] == [
        f"optimizer.state.layers.0.attention.w{p}.weight.exp_avg" for p in "qkv"
    ]
    assert old.sources["dataloader.zephon"] == ["dataloader.zephon"]  # the data record's key
    assert old.sources["lr_scheduler.last_epoch"] == ["lr_scheduler.last_epoch"]
    assert "lr_scheduler._step_count" in old.dropped


def test_the_map_sends_022_llama3_8b_names_onto_03_llama3_8b():
    """0.2.2's llama3 8B module names (recorded from its model on the meta device) map
    one to one onto 0.3's 8B: its state_dict keys, and (fused q/k/v) its parameters."""
    import json

    from torchtitan_zephon.configs.models import llama3_model

    recorded = json.loads((FIXTURE.parent / "llama3_8b_keys_022.json").read_text())["8B"]
    with torch.device("meta"):
        model = llama3_model("8B").model.build()
    state = [old_runs.parameter_name(k) for k in recorded["state"]]
    assert None not in state and len(set(state)) == len(state) == len(recorded["state"])
    assert set(state) == set(model.state_dict())
    parameters = {
        old_runs.optimizer_parameter(old_runs.parameter_name(k)) for k in recorded["params"]
    }
    assert parameters == {name for name, _ in model.named_parameters()}


def test_a_03_checkpoint_is_not_mapped():
    keys = {k for k in fixture_keys() if not k.startswith("lr_scheduler.")}
    assert old_runs.map_checkpoint(CHECKPOINT, keys | {"lr_scheduler.last_epoch"}, "llama3") is None


def test_another_model_family_is_refused_naming_the_first_key_and_the_tag():
    keys = fixture_keys()
    with pytest.raises(old_runs.OldRunRefused) as e:
        old_runs.map_checkpoint(CHECKPOINT, keys, "deepseek_v3")
    message = str(e.value)
    assert "key 'layers.0.attention.wk.weight' (the first) has no deepseek_v3 name" in message
    assert "git tag titan-0.2.2 (`git checkout titan-0.2.2`)" in message
    assert "Nothing was changed on disk." in message


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (8, 2)])
def test_optimizer_states_merge_as_03_merges_the_weights(n_heads: int, n_kv_heads: int):
    """The fused q/k/v optimizer state is laid out as FusedQKVLinear lays out wqkv."""
    from torchtitan.models.common.attention import FusedQKVLinear

    head_dim, dim = 3, 5
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n_heads * head_dim, dim, generator=g)
    k = torch.randn(n_kv_heads * head_dim, dim, generator=g)
    v = torch.randn(n_kv_heads * head_dim, dim, generator=g)
    state = {"p.wq.weight": q, "p.wk.weight": k, "p.wv.weight": v}
    module = SimpleNamespace(head_dim=head_dim, heads_per_kv=n_heads // n_kv_heads)
    FusedQKVLinear._merge_qkv_on_load(module, state, "p.")
    assert torch.equal(old_runs._merge_qkv(q, k, v, head_dim), state["p.wqkv.weight"])


# ------------------------------------------------------------------ real jobs


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_022_run_resumes_on_03(e2e_root: Path, nproc: int):
    """From 0.2.2's step-2 checkpoint (written at 2 ranks), at 1 rank (2: FSDP, the fused
    q/k/v optimizer states sharded): steps 3-4 see 0.2.2's data (ids and token digests,
    chain) and reach 0.2.2's losses."""
    run = old_run(e2e_root, f"old_022_{nproc}")
    shutil.rmtree(run / "tb")  # the losses compared below are the resumed job's own
    job = train(run, nproc, *RESUME).check()
    assert "was written by the TorchTitan 0.2.2-based Zephon (git tag titan-0.2.2)" in job.output
    assert f"Zephon: resuming at step 3 (position 16) under DP degree {nproc}" in job.output
    (event,) = resume_events(run)
    assert event["from_step"] == 2 and event["dp_degree"] == nproc
    assert_same_data(FIXTURE, run, range(1, 5))
    verify = subprocess.run(
        [sys.executable, "-m", "torchtitan_zephon", "verify", str(FIXTURE), str(run)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "compared:  4 common steps (1..4), ids + tokens (4 steps)" in verify.stdout
    assert "verdict: MATCH" in verify.stdout
    # Model, optimizer and LR schedule restored: step 3's loss depends on the weights,
    # step 4's on the optimizer's update (fp32; 2 -> 1 ranks changes reduction order).
    assert_losses(FIXTURE, run, range(3, 5), rtol=TOPOLOGY_RTOL)
    info = runs.verify_checkpoint(runs.checkpoints(run)[-1])
    assert info.step == 4 and info.holds == "training"
    assert old_runs.map_checkpoint(info.path, info.keys, "llama3") is None  # 0.3 wrote it


def _add_key(checkpoint: Path, like: str, name: str) -> None:
    """Give the checkpoint's .metadata one more key (stored where ``like`` is)."""
    path = checkpoint / ".metadata"
    with open(path, "rb") as f:
        metadata = pickle.load(f)
    metadata.state_dict_metadata[name] = metadata.state_dict_metadata[like]
    for index, item in list(metadata.storage_data.items()):
        if index.fqn == like:
            metadata.storage_data[type(index)(name, index.offset, index.index)] = item
    with open(path, "wb") as f:
        pickle.dump(metadata, f)


# slow (issue 44 part e): the old-run refusal path is proven by
# test_022_checkpoint_is_refused_for_another_model_family, the map in-process
@pytest.mark.slow
def test_022_checkpoint_with_an_unmapped_key_is_refused(e2e_root: Path):
    run = old_run(e2e_root, "old_022_unmapped")
    ckpt = run / "checkpoint" / "step-2"
    _add_key(ckpt, "layers.0.attention.wq.weight", "layers.0.attention.q_norm.weight")
    before = tree(run)
    job = train(run, 1, *RESUME, log=e2e_root / "old_022_unmapped.log")
    assert_refused(
        job,
        f"the checkpoint {ckpt} was written by the TorchTitan 0.2.2-based Zephon",
        "key 'layers.0.attention.q_norm.weight' has no 0.3 llama3 name in the map",
        "git tag titan-0.2.2",
        "Nothing was changed on disk.",
    )
    assert_unchanged(before, tree(run))


def test_022_checkpoint_is_refused_for_another_model_family(e2e_root: Path):
    """The TOML job of the same run with the MoE model: refused before anything is
    written, naming the first key of 0.2.2's llama3 modules and the tag."""
    run = old_run(e2e_root, "old_022_family")
    before = tree(run)
    moe = ("--model.name", "zephon_deepseek_v3", "--model.flavor", "tiny")
    job = train(run, 1, *RESUME, *moe, log=e2e_root / "old_022_family.log")
    assert_refused(
        job,
        "this job's model is deepseek_v3: key 'layers.0.attention.wk.weight' (the first) has no",
        "git tag titan-0.2.2",
    )
    assert_unchanged(before, tree(run))


# slow (issue 44 part e): the old-run refusal path is proven by
# test_022_checkpoint_is_refused_for_another_model_family, verify_checkpoint in-process
# (test_preflight.py)
@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated shard", "unreadable metadata"])
def test_unreadable_022_checkpoint_is_refused(e2e_root: Path, damage: str):
    run = old_run(e2e_root, f"old_022_{damage.replace(' ', '_')}")
    ckpt = run / "checkpoint" / "step-2"
    if damage == "truncated shard":
        shard = ckpt / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[:1000])
        problem = "step-2: shard __1_0.distcp is truncated: 1000 bytes"
    else:
        (ckpt / ".metadata").write_bytes(b"not a pickle")
        problem = "step-2: .metadata is unreadable (UnpicklingError"
    before = tree(run)
    job = train(run, 1, *RESUME, log=e2e_root / f"{run.name}.log")
    assert_refused(job, f"no checkpoint in {run / 'checkpoint'} can be loaded", problem)
    assert_unchanged(before, tree(run))


# ------------------------------------------------------------------ model only

MODEL_ONLY = Path(__file__).parent / "old_runs" / "model_only_022" / "step-2"
"""A model-only checkpoint of the 0.2.2 code (``last_save_model_only``, its default for
the last step): the tiny job's step 2 at 2 ranks, 21 model keys (see ORIGIN.md)."""


def _tensors(checkpoint: Path, keys: set[str]) -> dict[str, torch.Tensor]:
    """The values of ``keys`` in a DCP checkpoint, read whole in this process."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    out = {
        k: torch.empty(tuple(metadata[k].size), dtype=metadata[k].properties.dtype) for k in keys
    }
    dcp.load(out, checkpoint_id=str(checkpoint))
    return out


def test_022_model_only_checkpoint_is_an_initial_load_through_the_map(e2e_root: Path):
    """`--checkpoint.initial_load_path` of a model-only 0.2.2 checkpoint with
    `--checkpoint.initial_load_model_only` starts a new run from its weights: at learning
    rate 0 the 0.3 job's step-1 checkpoint holds 0.2.2's weights bit for bit, under
    0.3's names (q/k/v through the fused projection, ``output`` -> ``lm_head``)."""
    old_keys = runs.verify_checkpoint(runs.CheckpointInfo(2, MODEL_ONLY, True, 0)).keys
    assert old_runs.written_by_022(old_keys) == "output.weight"
    run = e2e_root / "old_022_model_only"
    job = train(
        run, 1, "--training.steps", "1", "--checkpoint.interval", "1",
        "--checkpoint.initial_load_path", str(MODEL_ONLY),
        "--checkpoint.initial_load_model_only", "--checkpoint.no-last_save_model_only",
        "--optimizer.lr", "0", "--validation.no-enable",
    ).check()  # fmt: skip
    assert (
        f"checkpoint {MODEL_ONLY} was written by the TorchTitan 0.2.2-based Zephon (git tag "
        "titan-0.2.2); it is loaded through the llama3 name map: 21 keys, 7 renamed" in job.output
    )
    assert "Zephon: resuming" not in job.output  # model only: a new run from step 1
    (saved,) = runs.checkpoints(run)
    assert saved.step == 1
    old = _tensors(MODEL_ONLY, set(old_keys))
    new = _tensors(saved.path, {old_runs.parameter_name(k) for k in old_keys})
    for key, value in old.items():
        assert torch.equal(new[old_runs.parameter_name(key)], value), key


# slow (issue 44 part e): the old-run refusal path is proven by
# test_022_checkpoint_is_refused_for_another_model_family
@pytest.mark.slow
def test_022_model_only_checkpoint_for_another_model_family_is_refused(e2e_root: Path):
    run = e2e_root / "old_022_model_only_family"
    run.mkdir()
    before = tree(run)
    job = train(
        run, 1, "--training.steps", "1", "--checkpoint.initial_load_path", str(MODEL_ONLY),
        "--checkpoint.initial_load_model_only", "--model.name", "zephon_deepseek_v3",
        "--model.flavor", "tiny", log=e2e_root / "old_022_model_only_family.log",
    )  # fmt: skip
    assert_refused(
        job,
        f"the checkpoint {MODEL_ONLY} was written by the TorchTitan 0.2.2-based Zephon (it "
        "holds 'output.weight'",
        "this job's model is deepseek_v3: key 'layers.0.attention.wk.weight' (the first) has no",
        "git tag titan-0.2.2",
    )
    assert_unchanged(before, tree(run))
