"""Platform layer: make TorchTitan 0.3 run on a machine without an accelerator.

Invariant: on a machine where ``torch.cuda.is_available()`` (or any other
accelerator TorchTitan knows) this module changes nothing: ``apply()`` returns
``"cuda"`` (or that device type) and ``cpu_config_defaults`` returns no change.
Without an accelerator (or with ``ZEPHON_DEVICE=cpu``) it switches TorchTitan to
device ``cpu`` with the gloo backend, and changes exactly what is CUDA-, NCCL- or
triton-only, each for the reason given where it is done:

1. the device type and module (TorchTitan falls back to ``"cuda"``), also in the
   modules that copied those names at import time (``_MODULES_WITH_DEVICE_NAMES``,
   ``models/common/token_dispatcher.py`` among them); the device memory monitor
   then reports the process's peak resident memory;
2. FSDP gradient reductions are plain sums (gloo has no ``PREMUL_SUM``);
3. where triton is absent, a stub for the one TorchTitan module that imports it
   on the trainer's import path (``distributed/minimal_async_ep/kernels.py``);
4. the uneven list ``all_to_all`` of ``spmd_types`` (expert parallelism) goes
   through ``all_to_all_single`` with split sizes, which gloo has;
5. in the job's config, before the command line is parsed (so an explicit flag
   still wins; ``cpu_config_defaults``): SDPA with the same document-causal
   mask (``titan.components.attention.DocumentSDPA``) in place of FlexAttention / varlen
   attention (neither has a CPU backward), float32 FSDP parameters
   unless ``ZEPHON_CPU_BF16=1``, and CUDA graphs off (TorchTitan's config check
   rejects them with expert parallelism before any CUDA is touched);
6. in the parsed config (``cpu_parsed_settings``), what no flag can ask of a CPU:
   ``checkpoint.async_mode async_with_pinned_mem`` becomes ``async`` (DCP's stager
   copies into pinned memory with a non-blocking device copy, which needs an
   accelerator; it would fail at the first save, after steps were logged).

The process-group timeout barrier needs no change on torch >= 2.14 once the
device module is the CPU's (gloo accepts ``barrier(device_ids=[0])``).

Call ``apply()`` before a TorchTitan Trainer is built.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform as _py_platform
import resource
import sys
import types
from typing import Any

import torch

_APPLIED: str | None = None

# TorchTitan modules that bind ``device_type`` / ``device_module`` by name at import.
_MODULES_WITH_DEVICE_NAMES = (
    "torchtitan.tools.utils",
    "torchtitan.tools.profiler",
    "torchtitan.components.metrics",
    "torchtitan.distributed.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.models.common.token_dispatcher",
)

# The names ``distributed/minimal_async_ep/api.py`` imports from its triton kernels.
_TRITON_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
_TRITON_KERNEL_NAMES = (
    "copy_full_counts_to_peers_kernel",
    "copy_rows_to_peers_kernel",
    "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel",
    "fill_dispatch_metadata_kernel",
    "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel",
    "topk_scores_grad_kernel",
)

CPU_BF16 = "ZEPHON_CPU_BF16"
"""Environment: ``1`` keeps a config's bf16 FSDP parameters on the CPU."""


def accelerator_type() -> str | None:
    """The accelerator TorchTitan would use, or None when this machine has none.

    ``ZEPHON_DEVICE=cpu`` forces the CPU path even where a GPU is present.
    """
    if os.environ.get("ZEPHON_DEVICE", "").lower() == "cpu":
        return None
    from torch._utils import _get_available_device_type

    return _get_available_device_type()


class _CpuProperties:
    def __init__(self, total_memory: int) -> None:
        self.total_memory = total_memory
        self.name = _py_platform.processor() or _py_platform.machine() or "cpu"


class CpuDeviceModule(types.SimpleNamespace):
    """Stands in for ``torch.cuda`` where TorchTitan expects a device module."""

    @staticmethod
    def set_device(device: Any = None) -> None:  # one process per rank: nothing to bind
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
    def get_device_properties(device: Any = None) -> _CpuProperties:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 1 << 34
        return _CpuProperties(int(total))

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
    """(3) Let the trainer import where triton is not installed (CPU torch builds).

    ``models/common/token_dispatcher.py`` imports ``distributed/minimal_async_ep/api.py``,
    which imports its triton kernels. We pre-register that one module (not ``triton``
    itself: torch probes for a real triton and must keep seeing none) whose kernels
    fail loudly if called; only the minimal-async expert-parallel dispatcher, a GPU
    path, calls them.
    """
    try:
        have_triton = importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        have_triton = False
    if _TRITON_KERNELS in sys.modules or have_triton:
        return

    def no_triton(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError(
            "TorchTitan's minimal-async expert-parallel kernels need triton, which is not "
            "installed. Use another token dispatcher on CPU, or install triton on a GPU machine."
        )

    module = types.ModuleType(_TRITON_KERNELS, "torchtitan_zephon stand-in: triton is absent")
    for name in _TRITON_KERNEL_NAMES:
        setattr(module, name, no_triton)
    sys.modules[_TRITON_KERNELS] = module


def _use_cpu_device() -> None:
    """(1) TorchTitan falls back to ``"cuda"`` (hence nccl, ``cuda:0``) when it finds no
    accelerator; several modules copied the names at import, so each copy is set."""
    cpu_module = CpuDeviceModule()
    for name in _MODULES_WITH_DEVICE_NAMES:
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = cpu_module


def _force_sum_reductions() -> None:
    """(2) gloo has no ``PREMUL_SUM``, the reduction FSDP uses to divide gradients.
    TorchTitan already sets the divide factor to 1.0 (it scales the loss by the global
    token count itself), so a plain sum is the reduction it wants: after TorchTitan's
    ``disable_fsdp_gradient_division`` every FSDP module is also told to reduce with
    SUM. (``fully_shard`` in ``distributed/fsdp.py`` looks the name up at call time.)"""
    import torchtitan.distributed.fsdp as titan_fsdp
    from torch.distributed.fsdp import FSDPModule

    original = titan_fsdp.disable_fsdp_gradient_division
    if getattr(original, "zephon_sum", False):
        return

    def disable_division_and_sum(model: torch.nn.Module) -> None:
        original(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    disable_division_and_sum.zephon_sum = True  # type: ignore[attr-defined]
    titan_fsdp.disable_fsdp_gradient_division = disable_division_and_sum


class _GlooDist(types.ModuleType):
    """``torch.distributed`` as ``spmd_types`` sees it, with a list ``all_to_all`` that
    gloo takes for uneven chunks (gloo's ``alltoall`` wants equal sizes; its
    ``all_to_all_single`` takes split sizes)."""

    def __init__(self) -> None:
        super().__init__("zephon_gloo_dist")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)

    @staticmethod
    def all_to_all(
        output_tensor_list: list[torch.Tensor],
        input_tensor_list: list[torch.Tensor],
        group: Any = None,
        async_op: bool = False,
    ) -> None:
        if async_op:
            raise RuntimeError("zephon's gloo all_to_all is synchronous (async_op=False)")
        sizes_out = [t.numel() for t in output_tensor_list]
        flat_in = torch.cat([t.reshape(-1) for t in input_tensor_list])
        flat_out = flat_in.new_empty(sum(sizes_out))
        torch.distributed.all_to_all_single(
            flat_out,
            flat_in,
            output_split_sizes=sizes_out,
            input_split_sizes=[t.numel() for t in input_tensor_list],
            group=group,
        )
        for dst, src in zip(output_tensor_list, flat_out.split(sizes_out), strict=True):
            dst.copy_(src.view_as(dst))


def _gloo_all_to_all() -> None:
    """(4) Expert parallelism under ``spmd_types`` exchanges tokens with an uneven list
    ``all_to_all``, which gloo rejects ("invalid tensor size")."""
    import spmd_types._dist as spmd_dist

    spmd_dist.set_dist(_GlooDist())


def apply() -> str:
    """Select the device for this process and adapt TorchTitan if it is the CPU.

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
    # Intra-op threads: one per rank unless told otherwise (ranks share the cores).
    torch.set_num_threads(max(1, int(os.environ.setdefault("OMP_NUM_THREADS", "1"))))
    _use_cpu_device()
    _force_sum_reductions()
    _gloo_all_to_all()
    _APPLIED = "cpu"
    return "cpu"


def on_cpu() -> bool:
    return apply() == "cpu"


def cpu_config_defaults(config: Any) -> list[str]:
    """(5) Adjust a registry function's ``Trainer.Config`` for the CPU, before the
    command line is parsed (an explicit flag then still wins); returns what changed,
    for the log. Nothing changes where an accelerator is in use."""
    if not on_cpu():
        return []
    changes: list[str] = []
    spec = getattr(config, "model_spec", None)
    if spec is not None:
        # FlexAttention (0.3's llama3 default) and varlen attention have no backward on
        # CPU; PyTorch's SDPA does, with the same document-causal mask as a dense one.
        from torchtitan.models.common.attention import FlexAttention, VarlenAttention

        from torchtitan_zephon.titan.components.attention import DocumentSDPA

        hits = list(spec.model.traverse((FlexAttention.Config, VarlenAttention.Config)))
        for _fqn, _old, parent, attr in hits:
            if isinstance(attr, int):
                parent[attr] = DocumentSDPA.Config()
            else:
                setattr(parent, attr, DocumentSDPA.Config())
        if hits:
            kinds = sorted({type(old).__qualname__.split(".")[0] for _, old, _, _ in hits})
            changes.append(
                f"{len(hits)} attention module(s) {'/'.join(kinds)} -> DocumentSDPA (SDPA with "
                "the document-causal mask from positions; Flex has no CPU backward)"
            )
    training = config.training
    if training.mixed_precision_param != "float32" and os.environ.get(CPU_BF16) != "1":
        changes.append(
            f"training.mixed_precision_param {training.mixed_precision_param} -> float32 "
            f"(set {CPU_BF16}=1 to keep bf16, or pass --training.mixed_precision_param)"
        )
        training.mixed_precision_param = "float32"
    if not training.disable_cuda_graphs:
        training.disable_cuda_graphs = True
        changes.append("training.disable_cuda_graphs -> True (no CUDA)")
    return changes


def cpu_parsed_settings(config: Any) -> list[str]:
    """(6) Map, in the parsed ``Trainer.Config``, the settings that need an accelerator to
    the nearest that runs on the CPU; returns what changed, for the log (one line each).
    Nothing changes where an accelerator is in use."""
    if not on_cpu():
        return []
    changes: list[str] = []
    checkpoint = getattr(config, "checkpoint", None)
    if checkpoint is not None and str(checkpoint.async_mode).lower() == "async_with_pinned_mem":
        checkpoint.async_mode = "async"
        changes.append(
            "checkpoint.async_mode async_with_pinned_mem -> async (pinned-memory staging "
            "needs an accelerator; async stages in ordinary memory, then saves in the "
            "background the same way)"
        )
    return changes
