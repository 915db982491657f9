"""Initial weights that do not depend on the topology.

Role: run a model's own ``init_weights`` (TorchTitan's distributions: depth-scaled
std, truncation bounds, ones for norms) under an interceptor that draws every
random initial value from a generator keyed by the parameter's canonical name,
on the parameter's *full* shape, and keeps only the local shard.

Invariant: with ``zephon.init = "zephon"``, the initial value of every parameter
is a pure function of (``debug.seed``, its canonical name, its full shape and
dtype, the init calls the model makes on it, the type of device it is drawn
on: the job's accelerator, or the CPU). It is bitwise the same on 1 rank and
under any FSDP / HSDP / TP / PP layout (CPU offload included) on that device type,
whatever wraps the module (torch.compile's ``_orig_mod``, activation
checkpointing's ``_checkpoint_wrapped_module``, FSDP, converters). CPU and GPU
generators differ, so CPU and GPU runs do not agree with each other.

How: during ``init_weights`` the ``torch.nn.init`` functions (``normal_``,
``trunc_normal_``, ``uniform_``, ``xavier_*``, ``kaiming_*``, ...) and the
in-place random tensor methods (``Tensor.normal_``, ``uniform_``, ...) called on
a parameter are redirected, with the same arguments, to the parameter's full
shape. Element-wise distributions (normal, truncated normal, uniform, ...) are
drawn over the flattened full tensor in fixed chunks of ``CHUNK_ELEMENTS``; chunk
``c`` of the ``k``-th call on parameter ``name`` uses a ``torch.Generator`` (on the
drawing device) seeded with ``sha256(seed, name, k, c)``. Shape-dependent ones
(``xavier_*``, ``orthogonal_``, ...) draw the whole tensor from chunk key 0. A
rank keeps its shard of the full value as DTensor's own semantics define it
for the parameter's placements (``distribute_tensor(..., src_data_rank=None)``:
no communication). Where the shard is a range of rows (FSDP's ``Shard(0)``,
with ``Replicate`` dims) only the chunks covering those rows are drawn, so a
rank's work and memory follow its shard; otherwise (TP ``Shard(1)``, FSDP x TP
strided shards) the full value is drawn. Deterministic fills (``ones_``,
``zeros_``, ``constant_``, ``fill_``) run on the shard as they are. One
parameter at a time: the extra memory is at most one full parameter (the
largest: the embedding or the output projection) plus the sampler's
temporaries of one chunk. A parameter that the model initialises some other
way (a ``copy_`` from a tensor of its own making, no init call at all, a
``param_init`` entry that leaves values unset) is an error naming it
(``NotTopologyFree``): the invariant would silently not hold.

Buffers (RoPE caches, the MoE router's ``expert_bias_E`` and
``tokens_per_expert_E``) must be deterministic: every buffer is re-made
(TorchTitan's ``_init_self_buffers`` assigns a fresh tensor) or written in place
by ``init_weights`` without a random draw. A buffer left as ``to_empty()`` made
it (uninitialised memory), a buffer drawn at random, and any random draw during
``init_weights`` outside a parameter's initialiser (``torch.randn``, ...: it would
consume the global generator, whose state is the same on every rank but not a
function of the names) are errors naming them, as for parameters.
"""

from __future__ import annotations

import contextlib
import hashlib
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.overrides import TorchFunctionMode

# Names that wrappers insert into parameter FQNs; DCP drops the same ones when it
# writes a checkpoint, so the init key of a parameter is its checkpoint key.
WRAPPER_NAME_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")

# Element-wise draws are made in chunks of this many elements of the flattened
# full tensor (part of the definition of the initial values: do not change it).
CHUNK_ELEMENTS = 1 << 24

# torch.nn.init functions that draw random numbers (all take ``generator=``).
RANDOM_INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)
# Those whose values are independent draws per element (the rest depend on the shape).
ELEMENTWISE_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_")
# torch.nn.init functions whose result is the same on a shard and on the full tensor.
FILL_INIT_FUNCTIONS = ("constant_", "ones_", "zeros_")
# torch.nn.init functions that are deterministic but depend on the full shape.
SHAPED_INIT_FUNCTIONS = ("eye_", "dirac_")

_RANDOM_METHODS = {
    getattr(torch.Tensor, m)
    for m in (
        "normal_",
        "uniform_",
        "bernoulli_",
        "exponential_",
        "geometric_",
        "log_normal_",
        "cauchy_",
        "random_",
    )
}
_FILL_METHODS = {torch.Tensor.fill_, torch.Tensor.zero_}
# Functions that create a tensor of random values (outside a parameter's initialiser,
# a draw from the global generator).
_RANDOM_FACTORIES = {
    getattr(torch, f)
    for f in (
        "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm",
        "normal", "bernoulli", "multinomial", "poisson",
    )
}  # fmt: skip
# Methods whose result, taken from a parameter, is the same values under another
# name (TorchTitan's trunc_normal_ initialises ``param.float()`` and copies back).
_ALIAS_METHODS = {
    torch.Tensor.float,
    torch.Tensor.to,
    torch.Tensor.detach,
    torch.Tensor.bfloat16,
    torch.Tensor.half,
    torch.Tensor.double,
    torch.Tensor.data.__get__,  # type: ignore[attr-defined]
}


def _skip_param_init() -> Callable[..., Any] | None:
    """TorchTitan's no-op initialiser of a tied parameter (None where it has none)."""
    try:
        from torchtitan.models.common.param_init import skip_param_init
    except ImportError:
        return None
    return skip_param_init


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
        piece = distribute_tensor(
            full, target.device_mesh, target.placements, src_data_rank=None
        ).to_local()
        target.to_local().copy_(piece)
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


class NotTopologyFree(RuntimeError):
    """``init_weights`` initialised a parameter or a buffer in a way whose value
    could depend on the topology; the message names each one."""


class TopologyFreeInit(TorchFunctionMode):
    """Context manager: random init calls on ``module``'s parameters draw from
    per-parameter generators on full shapes (see the module docstring)."""

    def __init__(self, module: nn.Module, seed: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.seed = int(seed)
        self.device = device  # where values are drawn (None: on each parameter's device)
        # id -> (weak reference, canonical name): aliases die with their users.
        self._names: dict[int, tuple[weakref.ref, str]] = {}
        self.calls: dict[str, int] = {}
        self.unknown: set[str] = set()
        self.unset: set[str] = set()  # a param_init entry left (some) values unset
        for fqn, param in module.named_parameters(remove_duplicate=True):
            self._track(param, canonical_name(fqn))
        self.names = sorted({name for _, name in self._names.values()})
        self._module = module
        # at exit: the parameters the module holds then (init_states may re-tie one, e.g.
        # tok_embeddings.weight = lm_head.weight), by tracked name; None: untracked
        self._final: list[tuple[str, str | None]] = []
        # buffers: canonical name -> (owning module, attribute, the tensor before init)
        self._buffers = {
            canonical_name(f"{mname}.{bname}" if mname else bname): (m, bname, b)
            for mname, m in module.named_modules()
            for bname, b in m._buffers.items()
            if b is not None
        }
        self._buffer_ids = {id(b): name for name, (_, _, b) in self._buffers.items()}
        self.written_buffers: set[str] = set()
        self.random_buffers: set[str] = set()
        self.stray_draws: dict[str, int] = {}
        self._untouched: list[str] = []
        self._busy = False
        self._saved: dict[str, Callable[..., Any]] = {}
        # TorchTitan 0.3 modules initialise each parameter with ``_param_init[name]``
        self._param_inits = [
            (m, m._param_init)
            for _, m in module.named_modules()
            if getattr(m, "_param_init", None) is not None
        ]

    # -- TorchTitan 0.3 per-parameter initialisers --------------------------
    def _run_param_init(self, fn: Callable[[torch.Tensor], Any], param: torch.Tensor) -> None:
        """``fn(param)`` (a module's ``_param_init`` entry) made topology-free: ``fn`` runs
        on a plain tensor of the parameter's full shape, with the RNG of the drawing
        device seeded by (seed, name, call), and the rank keeps its shard. Whatever
        ``fn`` does (rejection sampling, fused q/k/v assembled from fresh tensors) sees
        neither the shard nor the global RNG state."""
        name = self.name_of(param)
        if name is None or self._busy:
            fn(param)
            return
        self.calls.setdefault(name, 0)
        if fn is _skip_param_init():  # a tied parameter: the other owner initialises it
            return
        call = self.calls[name]
        self.calls[name] = call + 1
        device = self.device or local_part(param).device
        full = torch.empty(tuple(param.shape), dtype=param.dtype, device=device)
        devices = [device.index or 0] if device.type not in ("cpu", "meta") else []
        # NaN until ``fn`` writes: an initialiser that leaves values unset is caught
        # (``torch.empty`` would hand over whatever memory held; not on the meta device).
        check_unset = full.is_floating_point() and device.type != "meta"
        self._busy = True
        try:
            if check_unset:
                full.fill_(float("nan"))
            with torch.random.fork_rng(devices=devices, device_type=device.type):
                torch.manual_seed(parameter_seed(self.seed, name, call))
                fn(full)
            if check_unset and bool(torch.isnan(full).any()):
                self.unset.add(name)
            keep_local_shard(param, full)
        finally:
            self._busy = False

    @contextmanager
    def _patched_param_inits(self) -> Iterator[None]:
        for m, inits in self._param_inits:
            m._param_init = {
                key: (lambda p, fn=fn: self._run_param_init(fn, p)) for key, fn in inits.items()
            }
        try:
            yield
        finally:
            for m, inits in self._param_inits:
                m._param_init = inits

    # -- which parameter a tensor stands for --------------------------------
    def _track(self, tensor: torch.Tensor, name: str) -> None:
        self._names[id(tensor)] = (weakref.ref(tensor), name)

    def name_of(self, tensor: Any) -> str | None:
        """The canonical name of the parameter ``tensor`` is (or is an alias of)."""
        entry = self._names.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0]() is tensor else None

    def _draw(
        self,
        target: torch.Tensor,
        name: str,
        fill: Callable[[torch.Tensor, torch.Generator], Any],
        *,
        elementwise: bool,
    ) -> None:
        """Give ``target`` its part of the full value ``fill`` draws (module docstring)."""
        call = self.calls.get(name, 0)
        self.calls[name] = call + 1
        device = self.device or local_part(target).device

        def generator(chunk: int) -> torch.Generator:
            seed = parameter_seed(self.seed, name, call, chunk)
            return torch.Generator(device=device).manual_seed(seed)

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

    # -- torch.nn.init functions ---------------------------------------------
    def _wrap_init(self, fname: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            name = self.name_of(tensor)
            if name is None and not self._busy and self._note_buffer_write(tensor, fname):
                return original(tensor, *args, **kwargs)
            if name is None or self._busy or kwargs.get("generator") is not None:
                return original(tensor, *args, **kwargs)
            # torch >= 2.10 dispatches torch.nn.init through __torch_function__, which
            # passes every argument by keyword, generator=None included.
            kwargs.pop("generator", None)
            self._busy = True
            try:
                if fname in FILL_INIT_FUNCTIONS:
                    self.calls[name] = self.calls.get(name, 0)  # seen, no draw
                    return original(tensor, *args, **kwargs)
                if fname in SHAPED_INIT_FUNCTIONS:
                    self.calls[name] = self.calls.get(name, 0)
                    full = torch.empty(
                        tensor.shape,
                        dtype=tensor.dtype,
                        device=self.device or local_part(tensor).device,
                    )
                    original(full, *args, **kwargs)
                    keep_local_shard(tensor, full)
                    return tensor
                self._draw(
                    tensor,
                    name,
                    lambda full, g: original(full, *args, generator=g, **kwargs),
                    elementwise=fname in ELEMENTWISE_INIT_FUNCTIONS,
                )
                return tensor
            finally:
                self._busy = False

        init.__name__ = fname
        return init

    @contextmanager
    def _patched_nn_init(self) -> Iterator[None]:
        for fname in RANDOM_INIT_FUNCTIONS + FILL_INIT_FUNCTIONS + SHAPED_INIT_FUNCTIONS:
            original = getattr(nn.init, fname)
            self._saved[fname] = original
            setattr(nn.init, fname, self._wrap_init(fname, original))
        try:
            yield
        finally:
            for fname, original in self._saved.items():
                setattr(nn.init, fname, original)
            self._saved.clear()

    # -- buffers and stray draws ----------------------------------------------
    def _note_buffer_write(self, tensor: Any, fname: str) -> bool:
        """Record an in-place ``fname`` (a method or ``torch.nn.init`` name) on a buffer;
        True when ``tensor`` is one."""
        name = self._buffer_ids.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        if name is None or self._buffers[name][2] is not tensor:
            return False
        if fname in RANDOM_INIT_FUNCTIONS or fname in {m.__name__ for m in _RANDOM_METHODS}:
            self.random_buffers.add(name)
        elif fname.endswith("_"):
            self.written_buffers.add(name)
        return True

    # -- tensor methods ------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if self._busy:
            return func(*args, **kwargs)
        if func in _RANDOM_FACTORIES and kwargs.get("generator") is None:
            fname = f"torch.{func.__name__}"
            self.stray_draws[fname] = self.stray_draws.get(fname, 0) + 1
            return func(*args, **kwargs)
        if not args:
            return func(*args, **kwargs)
        name = self.name_of(args[0])
        if name is None:
            self._note_buffer_write(args[0], getattr(func, "__name__", ""))
            return func(*args, **kwargs)
        if func in _ALIAS_METHODS:
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.shape == args[0].shape:
                self._track(out, name)
            return out
        if func in _RANDOM_METHODS and kwargs.get("generator") is None:
            kwargs.pop("generator", None)
            self._busy = True
            try:
                elementwise = not any(
                    isinstance(a, torch.Tensor) for a in (*args[1:], *kwargs.values())
                )
                self._draw(
                    args[0],
                    name,
                    lambda full, g: func(full, *args[1:], generator=g, **kwargs),
                    elementwise=elementwise,
                )
            finally:
                self._busy = False
            return args[0]
        if func in _FILL_METHODS:
            self.calls[name] = self.calls.get(name, 0)
            return func(*args, **kwargs)
        if func is torch.Tensor.copy_:
            source = args[1] if len(args) > 1 else kwargs.get("src")
            if self.name_of(source) == name:  # param.copy_(its own initialised alias)
                return func(*args, **kwargs)
            self.unknown.add(name)
        return func(*args, **kwargs)

    def __enter__(self) -> TopologyFreeInit:
        self._patches = contextlib.ExitStack()
        self._patches.enter_context(self._patched_nn_init())
        self._patches.enter_context(self._patched_param_inits())
        try:
            super().__enter__()
        except BaseException:
            self._patches.close()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:  # noqa: ANN001
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            self._patches.close()
            self._final = [
                (canonical_name(fqn), self.name_of(p))
                for fqn, p in self._module.named_parameters(remove_duplicate=True)
            ]
            self._names.clear()
            self._untouched = self.untouched_buffers()
            self._buffers.clear()  # the tensors before init: not kept alive
            self._buffer_ids.clear()
        if exc_type is None:
            self.check_all_initialised()

    def untouched_buffers(self) -> list[str]:
        """Buffers ``init_weights`` neither re-made nor wrote in place."""
        return sorted(
            name
            for name, (m, attr, before) in self._buffers.items()
            if m._buffers.get(attr) is before and name not in self.written_buffers
        )

    def check_all_initialised(self) -> None:
        missed = sorted(
            fqn if name is None else name
            for fqn, name in self._final
            if name is None or (name not in self.calls and name not in self.unknown)
        )
        unknown = sorted(self.unknown)
        untouched, drawn = self._untouched, sorted(self.random_buffers)
        stray = [
            f"{f} ({n} call{'s' if n > 1 else ''})" for f, n in sorted(self.stray_draws.items())
        ]
        unset = sorted(self.unset)
        if missed or unknown or unset or untouched or drawn or stray:
            lines = []
            if missed:
                lines.append(f"never initialised through torch.nn.init: {', '.join(missed)}")
            if unset:
                lines.append(f"left (partly) unset by their param_init: {', '.join(unset)}")
            if unknown:
                lines.append(f"overwritten by copy_ from another tensor: {', '.join(unknown)}")
            if untouched:
                lines.append(
                    "buffers init_weights never set (they would keep to_empty()'s "
                    f"uninitialised memory): {', '.join(untouched)}"
                )
            if drawn:
                lines.append(f"buffers drawn at random: {', '.join(drawn)}")
            if stray:
                lines.append(
                    "random draws outside any parameter's initialiser (the global "
                    f"generator): {', '.join(stray)}"
                )
            raise NotTopologyFree(
                "zephon init cannot make these parameters and buffers independent of the "
                "topology ("
                + "; ".join(lines)
                + "). Initialise parameters with torch.nn.init functions in init_weights "
                "(param_init), give buffers deterministic values in _init_self_buffers, or set "
                "--zephon.init torchtitan to use TorchTitan's init (then the initial weights "
                "depend on the sharding)."
            )


def init_weights_topology_free(
    module: nn.Module,
    seed: int,
    init_weights: Callable[[], None],
    device: torch.device | None = None,
) -> TopologyFreeInit:
    """Run ``init_weights()`` (the model's own) so that ``module``'s parameters get
    topology-independent values, drawn on ``device`` (None: each parameter's own);
    returns the interceptor (its ``calls`` per name)."""
    interceptor = TopologyFreeInit(module, seed, device)
    with torch.no_grad(), interceptor:
        init_weights()
    return interceptor


def topology_free_parallelize(
    parallelize_fn: Callable[..., nn.Module], seed: int
) -> Callable[..., nn.Module]:
    """TorchTitan 0.3's seam for the initial weights: a ``ModelSpec.parallelize_fn``
    (keyword arguments, as TorchTitan calls it, also per pipeline stage) whose returned
    model runs its own ``init_weights`` under ``TopologyFreeInit`` keyed by ``seed``,
    drawing on the job's device type (even where parameters live on the CPU:
    ``training.enable_cpu_offload``)."""
    if getattr(parallelize_fn, "zephon_init_seed", None) is not None:
        return parallelize_fn

    def parallelize(model: nn.Module, **kwargs: Any) -> nn.Module:
        model = parallelize_fn(model, **kwargs)
        own = model.init_weights

        def init_weights(**init_kwargs: Any) -> None:
            from torchtitan.tools import utils as titan_utils

            init_weights_topology_free(
                model,
                seed,
                lambda: own(**init_kwargs),
                device=torch.device(titan_utils.device_type),
            )

        model.init_weights = init_weights  # type: ignore[method-assign]
        return model

    parallelize.zephon_init_seed = seed  # type: ignore[attr-defined]
    return parallelize
