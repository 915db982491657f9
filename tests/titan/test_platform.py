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
        "import torchtitan_zephon.titan\n"
        "import torchtitan, torchtitan.train\n"
        "print(importlib.util.find_spec('triton') is None, 'triton' in sys.modules)\n"
        "from torchtitan.models.moe.kernels import generate_permute_indices\n"
        "try:\n"
        "    generate_permute_indices()\n"
        "except RuntimeError as e:\n"
        "    print('raises:', 'triton' in str(e))\n"
    )
    if out.startswith("False"):
        pytest.skip("triton is installed here: the stand-in is not used")
    assert out.splitlines() == ["True False", "raises: True"]


def test_cpu_apply_switches_torchtitan_device_names():
    out = run_python(
        "from torchtitan_zephon.titan import platform\n"
        "print(platform.apply())\n"
        "import torchtitan.tools.utils as u, torchtitan.components.metrics as m, torchtitan.distributed.utils as d\n"
        "print(u.device_type, m.device_type, d.device_type, type(m.device_module).__name__)\n"
        "print(d.set_pg_timeouts.__name__)\n"
        "import os; print(os.environ['OMP_NUM_THREADS'])\n",
        ZEPHON_DEVICE="cpu",
    )
    assert out.splitlines() == ["cpu", "cpu cpu cpu CpuDeviceModule", "_set_pg_timeouts_cpu", "1"]


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


def test_cpu_job_defaults_fp32(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.delenv("ZEPHON_CPU_BF16", raising=False)
    job = SimpleNamespace(training=SimpleNamespace(mixed_precision_param="bfloat16"))
    changes = platform.cpu_job_defaults(job)
    assert job.training.mixed_precision_param == "float32" and len(changes) == 1
    monkeypatch.setenv("ZEPHON_CPU_BF16", "1")
    job.training.mixed_precision_param = "bfloat16"
    assert platform.cpu_job_defaults(job) == [] and job.training.mixed_precision_param == "bfloat16"


def test_force_sum_reductions_on_fsdp_modules():
    """gloo has no PREMUL_SUM: every FSDP module must reduce with a plain sum."""
    code = (
        "import os, torch, torch.distributed as dist\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors\n"
        "from torchtitan_zephon.titan import platform\n"
        "dist.init_process_group('gloo', rank=0, world_size=1, init_method='tcp://127.0.0.1:%d')\n"
        "mesh = init_device_mesh('cpu', (1,))\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))\n"
        "fully_shard(m[0], mesh=mesh); fully_shard(m, mesh=mesh)\n"
        "for mod in m.modules():\n"
        "    if hasattr(mod, 'set_gradient_divide_factor'): mod.set_gradient_divide_factor(1.0)\n"
        "print(platform.force_sum_reductions([m]))\n"
        "g = m._get_fsdp_state()._fsdp_param_groups[0]\n"
        "print(g.force_sum_reduction_for_comms)\n"
        "dist.destroy_process_group()\n"
    )
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = run_python(code % port)
    assert out.splitlines() == ["2", "True"]


def test_on_cpu_here():
    if torch.cuda.is_available():
        pytest.skip("a GPU machine: the CPU path is not taken")
    assert platform.on_cpu()
