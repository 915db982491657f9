"""Platform layer: make TorchTitan 0.2.2 run on a machine without an accelerator.

Invariant: on a machine where ``torch.cuda.is_available()`` (or any other
accelerator TorchTitan knows) this module changes nothing; ``apply()`` returns
``"cuda"`` (or that device type) and leaves every TorchTitan function as shipped.
Without an accelerator it switches TorchTitan to device ``cpu`` with the gloo
backend and patches exactly the calls that are CUDA- or NCCL-only:

* ``torchtitan.tools.utils.device_type`` / ``device_module`` (TorchTitan falls
  back to ``"cuda"`` when nothing is present) and the copies of those names that
  other TorchTitan modules imported;
* the device memory monitor (``memory_stats`` and friends are CUDA-only): on CPU
  it reports the process's peak resident memory;
* ``set_pg_timeouts`` (gloo's barrier rejects ``device_ids``);
* ``import torchtitan`` imports ``triton``: a stub module is registered only when
  triton is not installed (it would fail to import otherwise, on any machine);
* FSDP reductions are forced to plain sums (see ``force_sum_reductions``),
  since gloo rejects ``PREMUL_SUM``;
* bf16 autocast / FSDP mixed precision defaults to fp32 (see ``cpu_job_defaults``),
  and intra-op threads follow ``OMP_NUM_THREADS`` (default 1 per rank).

Call ``apply()`` before importing ``torchtitan.train``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import platform as _py_platform
import resource
import sys
import types
from collections.abc import Iterable
from typing import Any

import torch

logger = logging.getLogger(__name__)

_APPLIED: str | None = None

# TorchTitan modules that copy ``device_type`` / ``device_module`` at import time.
_MODULES_WITH_DEVICE_NAMES = (
    "torchtitan.tools.utils",
    "torchtitan.tools.profiling",
    "torchtitan.components.metrics",
    "torchtitan.distributed.utils",
    "torchtitan.distributed.parallel_dims",
)


def accelerator_type() -> str | None:
    """The accelerator TorchTitan would use, or None when this machine has none.

    ``ZEPHON_DEVICE=cpu`` forces the CPU path even where a GPU is present.
    """
    if os.environ.get("ZEPHON_DEVICE", "").lower() == "cpu":
        return None
    from torch._utils import _get_available_device_type

    return _get_available_device_type()


class _CpuMemoryProperties:
    def __init__(self, total_memory: int) -> None:
        self.total_memory = total_memory


class CpuDeviceModule(types.SimpleNamespace):
    """Stands in for ``torch.cuda`` where TorchTitan expects a device module."""

    @staticmethod
    def set_device(device: Any) -> None:  # one process per rank, nothing to bind
        return None

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return _py_platform.processor() or _py_platform.machine() or "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> _CpuMemoryProperties:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 1 << 34
        return _CpuMemoryProperties(int(total))

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        # ru_maxrss is in KiB on Linux: the peak resident set of this rank.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None


def install_triton_stub() -> None:
    """Let ``import torchtitan`` succeed where triton is not installed.

    TorchTitan's package ``__init__`` reaches ``torchtitan.models.moe.kernels``,
    whose first line is ``import triton``; CPU builds of torch do not bring triton.
    We pre-register that one module (not ``triton`` itself: torch probes for a real
    triton and must keep seeing none) with a ``generate_permute_indices`` that
    fails loudly if an MoE model ever calls it. Dense models never do.
    """
    name = "torchtitan.models.moe.kernels"
    if name in sys.modules or importlib.util.find_spec("triton") is not None:
        return

    def generate_permute_indices(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError(
            "MoE token permutation needs triton, which is not installed. "
            "Install torchtitan_zephon[gpu] on a GPU machine."
        )

    module = types.ModuleType(name, "torchtitan_zephon stand-in: triton is not installed")
    module.generate_permute_indices = generate_permute_indices  # type: ignore[attr-defined]
    sys.modules[name] = module


def _set_pg_timeouts_cpu(timeout: Any, parallel_dims: Any) -> None:
    """``torchtitan.distributed.utils.set_pg_timeouts`` without ``device_ids``."""
    torch.distributed.barrier()
    groups = [m.get_group() for m in parallel_dims.get_all_one_dimensional_meshes().values()]
    for group in [*groups, None]:
        torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)


def apply() -> str:
    """Select the device for this process and patch TorchTitan if it is the CPU.

    Returns the device type in use (``"cuda"``, ``"cpu"``, ...). Idempotent.
    """
    global _APPLIED
    if _APPLIED is not None:
        return _APPLIED
    install_triton_stub()
    accel = accelerator_type()
    if accel is not None:
        _APPLIED = accel
        return accel

    threads = int(os.environ.setdefault("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(max(1, threads))

    import importlib

    cpu_module = CpuDeviceModule()
    for name in _MODULES_WITH_DEVICE_NAMES:
        mod = importlib.import_module(name)
        if hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = cpu_module

    import torchtitan.distributed.utils as dist_utils

    dist_utils.set_pg_timeouts = _set_pg_timeouts_cpu
    _APPLIED = "cpu"
    return "cpu"


def on_cpu() -> bool:
    return apply() == "cpu"


def force_sum_reductions(modules: Iterable[torch.nn.Module]) -> int:
    """Make every FSDP module reduce gradients with plain SUM (gloo has no PREMUL_SUM).

    TorchTitan sets the gradient divide factor to 1.0 and scales the loss by the
    global token count itself, so a sum is the reduction it wants. Returns the
    number of FSDP modules changed.
    """
    from torch.distributed.fsdp import FSDPModule

    n = 0
    for root in modules:
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
                n += 1
    return n


def cpu_job_defaults(job_config: Any) -> list[str]:
    """Adjust a parsed JobConfig for the CPU; returns what was changed, for the log.

    bf16 runs ~20x slower than fp32 on CPUs, so FSDP's param dtype becomes fp32
    unless ``ZEPHON_CPU_BF16=1``. ``torch.compile`` is left as configured.
    """
    changes = []
    training = job_config.training
    if training.mixed_precision_param != "float32" and os.environ.get("ZEPHON_CPU_BF16") != "1":
        changes.append(
            f"training.mixed_precision_param {training.mixed_precision_param} -> float32 "
            "(bf16 is ~20x slower on CPU; set ZEPHON_CPU_BF16=1 to keep it)"
        )
        training.mixed_precision_param = "float32"
    return changes
