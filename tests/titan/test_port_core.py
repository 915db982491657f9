"""TorchTitan 0.3 core: the config path (registry -> Zephon's config -> CPU defaults ->
tyro), the dataloader's seam, document positions and topology-free init."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("torchtitan.trainer", reason="TorchTitan 0.3 (torchtitan.trainer)")

from torchtitan_zephon.job.loader import document_positions  # noqa: E402
from torchtitan_zephon.titan import platform  # noqa: E402

platform.apply()

from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention  # noqa: E402
from torchtitan.models.common.attention import (  # noqa: E402
    FlexAttention,
    get_causal_mask_mod,
    get_efficient_causal_mask_mod_for_packed_document,
)

from torchtitan_zephon.titan.components.attention import DocumentSDPA, document_mask  # noqa: E402
from torchtitan_zephon.titan.components.dataloader import ZephonDataLoader  # noqa: E402
from torchtitan_zephon.titan.components.validate import ZephonValidator  # noqa: E402
from torchtitan_zephon.train import parse_config  # noqa: E402


def _positions_by_loop(row: np.ndarray, eos: int) -> list[int]:
    out, p = [], 0
    for i, _ in enumerate(row):
        p = 0 if i == 0 or row[i - 1] == eos else p + 1
        out.append(p)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_document_positions_restart_at_the_window_and_after_each_eos(seed: int) -> None:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 5, size=(3, 17))  # EOS = 0 is frequent, also first and last
    got = document_positions(torch.from_numpy(tokens), 0)
    assert got.dtype == torch.int64
    assert got.tolist() == [_positions_by_loop(r, 0) for r in tokens]


def test_a_stock_config_gets_zephon_components_and_cpu_defaults(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = parse_config(["--module", "llama3", "--config", "llama3_debugmodel"])
    assert type(config).__qualname__ == "ZephonTrainer.Config"
    assert isinstance(config.dataloader, ZephonDataLoader.Config)
    assert isinstance(config.validator, ZephonValidator.Config)
    assert (config.validator.freq, config.validator.steps) == (5, 10)  # the stock values
    assert config.debug.seed == 0
    assert config.training.mixed_precision_param == "float32"
    assert config.training.disable_cuda_graphs
    spec = config.model_spec
    assert not list(spec.model.traverse(FlexAttention.Config))
    assert len(list(spec.model.traverse(DocumentSDPA.Config))) == 6


def test_an_explicit_flag_wins_over_the_cpu_defaults() -> None:
    config = parse_config(
        ["--module", "llama3", "--config", "llama3_debugmodel",
         "--training.mixed_precision_param", "bfloat16", "--debug.seed", "5"]
    )  # fmt: skip
    assert config.training.mixed_precision_param == "bfloat16"
    assert config.debug.seed == 5


def test_zephon_registry_overrides_reach_the_zephon_section() -> None:
    config = parse_config(
        ["--module", "torchtitan_zephon.configs", "--config", "llama3_debug",
         "--zephon.heldout_samples", "32", "--validator.microbatch_size", "2",
         "--dataloader.num_workers", "1"]
    )  # fmt: skip
    assert config.zephon.heldout_samples == 32
    assert config.validator.microbatch_size == 2
    assert config.dataloader.num_workers == 1
    assert (config.model_spec.name, config.model_spec.flavor) == ("llama3", "small")
    assert config.debug.seed == 42


def test_an_unknown_config_lists_the_registry_functions() -> None:
    functions = ("'deepseek_v3_16b', 'deepseek_v3_debug', 'llama3_8b', 'llama3_debug', "
                 "'llama3_tiny', 'qwen3_0_6b', 'qwen3_debug'")  # fmt: skip
    with pytest.raises(ValueError, match=rf"Available config functions: \[{functions}\]"):
        parse_config(["--module", "torchtitan_zephon.configs", "--config", "llama3_nope"])


def test_the_zephon_dataloader_refuses_to_be_built_without_zephons_trainer() -> None:
    with pytest.raises(ValueError, match="built by Zephon's trainer.*torchtitan_zephon.train"):
        ZephonDataLoader.Config().build(
            dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=64, local_batch_size=2
        )


def _tiny_initial_weights(seed: int) -> dict[str, torch.Tensor]:
    from torchtitan_zephon.configs.models import llama3_model
    from torchtitan_zephon.titan.weights.init import topology_free_parallelize

    spec = llama3_model("tiny")  # built only: the attention backend is never run
    with torch.device("meta"):
        model = spec.model.build()
    model = topology_free_parallelize(lambda m, **_: m, seed)(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_initial_weights_follow_the_seed_not_the_global_rng() -> None:
    torch.manual_seed(1)
    a = _tiny_initial_weights(7)
    torch.manual_seed(2)
    b = _tiny_initial_weights(7)
    c = _tiny_initial_weights(8)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    drawn = [k for k in a if not torch.equal(a[k], c[k])]
    assert "tok_embeddings.weight" in drawn
    assert "layers.0.attention.qkv_linear.wq.weight" in drawn  # fused q/k/v init too


@pytest.mark.parametrize("batch", [1, 3])
def test_document_sdpa_computes_what_flex_attention_computes(batch: int) -> None:
    """On CPU FlexAttention runs forward (eagerly): same batch, same positions, same mask."""
    g = torch.Generator().manual_seed(batch)
    length, heads, dim = 48, 2, 8
    tokens = torch.randint(0, 6, (batch, length), generator=g)  # EOS = 0: several documents
    positions = document_positions(tokens, 0)
    q, k, v = (torch.randn(batch, length, heads, dim, generator=g) for _ in range(3))
    mask_mod = and_masks(
        get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(positions)
    )
    block_mask = create_block_mask(mask_mod, batch, None, length, length, device="cpu",
                                   BLOCK_SIZE=16)  # fmt: skip
    flex = flex_attention(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=block_mask)
    ours = DocumentSDPA(DocumentSDPA.Config())(q, k, v, attention_masks=document_mask(positions))
    torch.testing.assert_close(ours, flex.transpose(1, 2), rtol=1e-5, atol=1e-6)
    causal_only = DocumentSDPA(DocumentSDPA.Config())(q, k, v)
    assert not torch.allclose(ours, causal_only, atol=1e-3)  # the documents do matter here


def test_an_unknown_module_is_refused_in_one_line_before_anything_is_written(tmp_path) -> None:
    """The entry point as users run it: exit 1, one line naming the module and the
    modules TorchTitan knows, no traceback, no dump folder."""
    import subprocess
    import sys

    from tests.titan.launch import REPO, job_env

    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_zephon.train", "--module", "torchtitan_zephon.nope",
         "--config", "llama3_debug", "--dump_folder", str(run)],
        cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (
        "Zephon refused to start: Cannot import module 'torchtitan_zephon.nope' or "
        "'torchtitan_zephon.nope.config_registry'. For shorthands, supported modules are: ["
    ) in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not run.exists()
