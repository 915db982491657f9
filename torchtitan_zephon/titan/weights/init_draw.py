"""The keyed draw that defines Zephon's initial values: which generator a random
init call on a parameter draws from, and which part of the full value a rank keeps.

Invariant: chunk ``c`` (``CHUNK_ELEMENTS`` elements of the flattened full tensor) of
the ``k``-th random init call on parameter ``name`` is drawn from a
``torch.Generator`` (on the drawing device) seeded with ``sha256(seed, name, k, c)``,
and a rank keeps the shard of the full value that DTensor's own semantics assign
to it for the parameter's placements (``distribute_tensor(..., src_data_rank=None)``:
no communication). A range of elements is the same range of the full draw, so a
rank whose shard is a range of rows (FSDP's ``Shard(0)``, with ``Replicate`` dims)
draws only the chunks covering those rows. A TorchTitan 0.3 ``param_init`` entry
runs on a tensor of the full shape with the RNG seeded by ``sha256(seed, name, k,
0)``. ``name`` is the canonical name (the checkpoint key): wrappers' name parts do
not change it. ``titan.weights.init`` redirects a model's init calls here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

# Names that wrappers insert into parameter FQNs; DCP drops the same ones when it
# writes a checkpoint, so the init key of a parameter is its checkpoint key.
WRAPPER_NAME_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")

# Element-wise draws are made in chunks of this many elements of the flattened
# full tensor (part of the definition of the initial values: do not change it).
CHUNK_ELEMENTS = 1 << 24


def canonical_name(fqn: str) -> str:
    """A parameter's name without the parts that wrappers insert."""
    return ".".join(p for p in fqn.split(".") if p not in WRAPPER_NAME_PARTS)


def parameter_seed(seed: int, name: str, call: int, chunk: int = 0) -> int:
    """The generator seed of chunk ``chunk`` of the ``call``-th random init call
    on parameter ``name``."""
    key = f"zephon-init\0{seed}\0{name}\0{call}\0{chunk}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (a DTensor's local shard, or the tensor itself)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def keep_local_shard(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy into ``target`` (a plain tensor or a DTensor) its part of ``full``.

    For a DTensor this is the local shard that DTensor's own semantics assign to
    this rank for the target's placements (Shard with uneven splits, strided
    shards of FSDP x TP, Replicate), cut locally without communication.
    """
    if isinstance(target, DTensor):
        local = distribute_tensor(
            full, target.device_mesh, target.placements, src_data_rank=None
        ).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full)


def local_rows(target: torch.Tensor) -> tuple[int, int] | None:
    """``(start, stop)``: the rows (dim 0) of the full tensor that ``target``'s
    shard is, when it is exactly such a range (every placement ``Shard(0)`` or
    ``Replicate``); None otherwise."""
    if not isinstance(target, DTensor) or target.ndim == 0:
        return None
    if not all(
        type(p) is Replicate or (type(p) is Shard and p.dim == 0) for p in target.placements
    ):
        return None
    shape, offset = compute_local_shape_and_global_offset(
        target.shape, target.device_mesh, target.placements
    )
    if tuple(shape[1:]) != tuple(target.shape[1:]):
        return None
    return offset[0], offset[0] + shape[0]


def draw_flat(
    numel: int,
    lo: int,
    hi: int,
    fill: Callable[[torch.Tensor, torch.Generator], Any],
    generator: Callable[[int], torch.Generator],
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Elements ``[lo, hi)`` of a flat tensor of ``numel`` elements whose chunk ``c``
    (``CHUNK_ELEMENTS`` each) is ``fill(chunk, generator(c))``; only the chunks
    overlapping the range are drawn."""
    if hi <= lo:
        return torch.empty(0, dtype=dtype, device=device)
    first, last = lo // CHUNK_ELEMENTS, (hi - 1) // CHUNK_ELEMENTS
    base = first * CHUNK_ELEMENTS
    buf = torch.empty(min(numel, (last + 1) * CHUNK_ELEMENTS) - base, dtype=dtype, device=device)
    for c in range(first, last + 1):
        start = c * CHUNK_ELEMENTS - base
        fill(buf[start : start + CHUNK_ELEMENTS], generator(c))
    return buf[lo - base : hi - base]


def draw_into(
    target: torch.Tensor,
    fill: Callable[[torch.Tensor, torch.Generator], Any],
    seed: int,
    name: str,
    call: int,
    *,
    elementwise: bool,
    device: torch.device,
) -> None:
    """Give ``target`` its part of the full value that ``fill(tensor, generator)``
    draws, on ``device``, for the ``call``-th random init call on parameter ``name``:
    an element-wise ``fill`` chunk by chunk (only the chunks of ``target``'s rows where
    its shard is a range of rows), any other on the whole tensor from chunk key 0."""

    def generator(chunk: int) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(parameter_seed(seed, name, call, chunk))

    shape, numel = tuple(target.shape), target.numel()
    if not elementwise:
        full = torch.empty(shape, dtype=target.dtype, device=device)
        fill(full, generator(0))
        keep_local_shard(target, full)
        return
    rows = local_rows(target)
    if rows is None:
        flat = draw_flat(numel, 0, numel, fill, generator, dtype=target.dtype, device=device)
        keep_local_shard(target, flat.view(shape))
        return
    per_row = numel // shape[0] if shape[0] else 0
    start, stop = rows
    flat = draw_flat(
        numel, start * per_row, stop * per_row, fill, generator,
        dtype=target.dtype, device=device,
    )  # fmt: skip
    local_part(target).copy_(flat.view(stop - start, *shape[1:]))


def run_seeded(
    target: torch.Tensor,
    fn: Callable[[torch.Tensor], Any],
    seed: int,
    name: str,
    call: int,
    *,
    device: torch.device,
) -> bool:
    """``fn(full)`` (a TorchTitan 0.3 ``param_init`` entry) on a plain tensor of
    ``target``'s full shape on ``device``, with that device's RNG seeded by
    ``parameter_seed(seed, name, call)`` (the global RNG state is restored after);
    ``target`` keeps its part. False when ``fn`` left values unset (checked for
    floating-point tensors off the meta device)."""
    full = torch.empty(tuple(target.shape), dtype=target.dtype, device=device)
    devices = [device.index or 0] if device.type not in ("cpu", "meta") else []
    # NaN until ``fn`` writes: an initialiser that leaves values unset is caught
    # (``torch.empty`` would hand over whatever memory held; not on the meta device).
    check_unset = full.is_floating_point() and device.type != "meta"
    if check_unset:
        full.fill_(float("nan"))
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.manual_seed(parameter_seed(seed, name, call))
        fn(full)
    all_set = not (check_unset and bool(torch.isnan(full).any()))
    keep_local_shard(target, full)
    return all_set
