"""The platform layer: CPU device shims, and nothing changed where a GPU exists."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from torchtitan_zephon.titan import platform


def run_python(code: str, **env: str) -> str:
    import os

    full = {**os.environ, **env}
    out = subprocess.run(
        [sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_import_torchtitan_without_triton_only_stubs_moe_kernels():
    out = run_python(
        "import importlib.util, sys\n"
        "from torchtitan_zephon.titan import platform\n"
        "platform.apply()\n"
        "import torchtitan, torchtitan.train\n"
        "print(importlib.util.find_spec('triton') is None, 'triton' in sys.modules)\n"
        "if importlib.util.find_spec('triton') is not None: sys.exit(0)\n"
        "from torchtitan.distributed.minimal_async_ep.kernels import copy_full_counts_to_peers_kernel\n"
        "try:\n"
        "    copy_full_counts_to_peers_kernel()\n"
        "except RuntimeError as e:\n"
        "    print('raises:', 'triton' in str(e))\n"
    )
    if out.splitlines()[-1].startswith("False"):
        pytest.skip("triton is installed here: the stand-in is not used")
    assert out.splitlines()[-2:] == ["True False", "raises: True"]


def test_cpu_apply_switches_torchtitan_device_names():
    out = run_python(
        "from torchtitan_zephon.titan import platform\n"
        "print(platform.apply())\n"
        "import torchtitan.tools.utils as u, torchtitan.components.metrics as m, torchtitan.distributed.utils as d\n"
        "import torchtitan.models.common.token_dispatcher as t\n"
        "print(u.device_type, m.device_type, d.device_type, t.device_type, type(m.device_module).__name__)\n"
        "print(d.set_pg_timeouts.__name__)\n"
        "import os; print(os.environ['OMP_NUM_THREADS'])\n",
        ZEPHON_DEVICE="cpu",
    )
    # torch >= 2.14's gloo takes the timeout barrier's device_ids: set_pg_timeouts stays
    assert out.splitlines()[-4:] == [
        "cpu",
        "cpu cpu cpu cpu CpuDeviceModule",
        "set_pg_timeouts",
        "1",
    ]


def test_gpu_machine_is_left_alone(monkeypatch):
    """Where an accelerator is present, apply() reports it and patches nothing."""
    out = run_python(
        "import torch._utils as tu\n"
        "tu._get_available_device_type = lambda: 'cuda'\n"
        "from torchtitan_zephon.titan import platform\n"
        "print(platform.apply())\n"
        "import torchtitan.distributed.utils as d, torchtitan.tools.utils as u\n"
        "print(d.set_pg_timeouts.__name__, u.device_type)\n",
    )
    assert out.splitlines() == ["cuda", "set_pg_timeouts cuda"]


def test_cpu_memory_monitor_reports_peak_rss():
    dm = platform.CpuDeviceModule()
    stats = dm.memory_stats()
    assert stats["active_bytes.all.peak"] > 10 * 2**20  # this process holds torch: > 10 MiB
    assert dm.get_device_properties().total_memory > 2**30
    assert dm.current_device() == 0 and dm.device_count() == 1


def test_cpu_config_defaults_fp32_sdpa_no_cuda_graphs(monkeypatch):
    from torchtitan_zephon.configs.config_registry import llama3_tiny
    from torchtitan_zephon.titan.components.attention import DocumentSDPA

    monkeypatch.delenv("ZEPHON_CPU_BF16", raising=False)
    config = llama3_tiny()
    config.training.mixed_precision_param = "bfloat16"
    changes = platform.cpu_config_defaults(config)
    assert config.training.mixed_precision_param == "float32" and len(changes) == 3
    assert config.training.disable_cuda_graphs is True
    layers = config.model_spec.model.layers
    assert all(isinstance(b.attention.inner_attention, DocumentSDPA.Config) for b in layers)
    monkeypatch.setenv("ZEPHON_CPU_BF16", "1")
    config = llama3_tiny()
    config.training.mixed_precision_param = "bfloat16"
    platform.cpu_config_defaults(config)
    assert config.training.mixed_precision_param == "bfloat16"


def test_force_sum_reductions_on_fsdp_modules():
    """gloo has no PREMUL_SUM: after TorchTitan's disable_fsdp_gradient_division every
    FSDP module reduces with a plain sum."""
    code = (
        "import os, torch, torch.distributed as dist\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from torchtitan_zephon.titan import platform\n"
        "platform.apply()\n"
        "import torchtitan.distributed.fsdp as titan_fsdp\n"
        "dist.init_process_group('gloo', rank=0, world_size=1, init_method='tcp://127.0.0.1:%d')\n"
        "mesh = init_device_mesh('cpu', (1,))\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))\n"
        "fully_shard(m[0], mesh=mesh); fully_shard(m, mesh=mesh)\n"
        "titan_fsdp.disable_fsdp_gradient_division(m)\n"
        "groups = [s for mod in m.modules() if hasattr(mod, '_get_fsdp_state')\n"
        "          for s in mod._get_fsdp_state()._fsdp_param_groups]\n"
        "print(len(groups), all(g.force_sum_reduction_for_comms for g in groups))\n"
        "dist.destroy_process_group()\n"
    )
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = run_python(code % port, ZEPHON_DEVICE="cpu")
    assert out.splitlines()[-1] == "2 True"


def test_on_cpu_here():
    if torch.cuda.is_available():
        pytest.skip("a GPU machine: the CPU path is not taken")
    assert platform.on_cpu()


def test_cpu_parsed_settings_map_pinned_memory_staging_to_async():
    from torchtitan_zephon.configs.config_registry import llama3_tiny

    config = llama3_tiny()
    config.checkpoint.async_mode = "async_with_pinned_mem"
    (change,) = platform.cpu_parsed_settings(config)
    assert change.startswith("checkpoint.async_mode async_with_pinned_mem -> async")
    assert config.checkpoint.async_mode == "async"
    assert platform.cpu_parsed_settings(config) == []  # nothing else to map


# slow (issue 44 part e): the mapping in-process
# (test_cpu_parsed_settings_map_pinned_memory_staging_to_async), async saves end to end by
# tests/titan/test_checkpoint_folder.py
@pytest.mark.slow
def test_async_with_pinned_mem_on_cpu_checkpoints_and_resumes(tmp_path):
    """Issue 43 case 4: DCP's pinned-memory stager raised at the first save on a CPU,
    after steps were logged. Mapped to ``async`` with one log line: the job saves, and
    the same command resumes from its checkpoint."""
    from tests.titan.launch import train

    args = ("--training.steps", "2", "--checkpoint.interval", "1",
            "--checkpoint.async_mode", "async_with_pinned_mem", "--validation.no-enable")  # fmt: skip
    job = train(tmp_path / "run", 2, *args).check()
    assert job.output.count("CPU platform: checkpoint.async_mode async_with_pinned_mem") == 1
    assert (tmp_path / "run" / "checkpoint" / "step-2" / ".metadata").is_file()
    again = train(tmp_path / "run", 2, *args[:1], "3", *args[2:]).check()
    assert "Zephon: resuming at step 3" in again.output
