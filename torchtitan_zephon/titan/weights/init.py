"""Initial weights that do not depend on the topology.

Role: run a model's own ``init_weights`` (TorchTitan's distributions: depth-scaled
std, truncation bounds, ones for norms) under an interceptor that draws every
random initial value from a generator keyed by the parameter's canonical name,
on the parameter's *full* shape, and keeps only the local shard
(``titan.weights.init_draw``).

Invariant: with ``zephon.init = "zephon"``, the initial value of every parameter
is a pure function of (``debug.seed``, its canonical name, its full shape and
dtype, the init calls the model makes on it, the type of device it is drawn
on: the job's accelerator, or the CPU). It is bitwise the same on 1 rank and
under any FSDP / HSDP / TP / PP layout (CPU offload included) on that device type,
whatever wraps the module (torch.compile's ``_orig_mod``, activation
checkpointing's ``_checkpoint_wrapped_module``, FSDP, converters). CPU and GPU
generators differ, so CPU and GPU runs do not agree with each other.

How: during ``init_weights`` the ``torch.nn.init`` functions (``normal_``,
``trunc_normal_``, ``uniform_``, ``xavier_*``, ``kaiming_*``, ...), the in-place
random tensor methods (``Tensor.normal_``, ``uniform_``, ...) and TorchTitan 0.3's
``param_init`` entries called on a parameter are redirected, with the same
arguments, to the parameter's full shape and drawn from the keyed generators of
``init_draw`` (element-wise distributions chunk by chunk: a rank whose shard is a
range of rows draws only those rows' chunks; otherwise, e.g. TP ``Shard(1)`` or
FSDP x TP strided shards, the full value). Deterministic fills (``ones_``,
``zeros_``, ``constant_``, ``fill_``) run on the shard as they are. One parameter
at a time: the extra memory is at most one full parameter (the largest: the
embedding or the output projection) plus the sampler's temporaries of one chunk.

A parameter that the model initialises some other way, a buffer that is not
deterministic (RoPE caches, the MoE router's ``expert_bias_E`` and
``tokens_per_expert_E`` must be re-made or written in place without a random draw),
and a random draw outside a parameter's initialiser are errors naming them
(``init_coverage.NotTopologyFree``): the invariant would silently not hold.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from torchtitan_zephon.titan.weights.init_coverage import BufferWatch, refuse_uncovered
from torchtitan_zephon.titan.weights.init_draw import (
    canonical_name,
    draw_into,
    keep_local_shard,
    local_part,
    run_seeded,
)

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
# The names an in-place write on a buffer has when it draws at random.
_RANDOM_NAMES = frozenset(RANDOM_INIT_FUNCTIONS) | {m.__name__ for m in _RANDOM_METHODS}


def _skip_param_init() -> Callable[..., Any] | None:
    """TorchTitan's no-op initialiser of a tied parameter (None where it has none)."""
    try:
        from torchtitan.models.common.param_init import skip_param_init
    except ImportError:
        return None
    return skip_param_init


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
        self.buffers = BufferWatch(module, _RANDOM_NAMES)
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
        self._busy = True
        try:
            if not run_seeded(param, fn, self.seed, name, call, device=device):
                self.unset.add(name)
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
        """Give ``target`` its part of the full value ``fill`` draws (``init_draw``)."""
        call = self.calls.get(name, 0)
        self.calls[name] = call + 1
        device = self.device or local_part(target).device
        draw_into(target, fill, self.seed, name, call, elementwise=elementwise, device=device)

    # -- torch.nn.init functions ---------------------------------------------
    def _wrap_init(self, fname: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            name = self.name_of(tensor)
            if name is None and not self._busy and self.buffers.note_write(tensor, fname):
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
            self.buffers.note_write(args[0], getattr(func, "__name__", ""))
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
            self._untouched = self.buffers.untouched()
            self.buffers.release()  # the tensors before init: not kept alive
        if exc_type is None:
            self.check_all_initialised()

    def check_all_initialised(self) -> None:
        """Raise ``NotTopologyFree`` for what escaped the keyed draw (``init_coverage``)."""
        refuse_uncovered(
            final=self._final,
            calls=self.calls,
            unknown=self.unknown,
            unset=self.unset,
            untouched=self._untouched,
            random_buffers=self.buffers.random,
            stray_draws=self.stray_draws,
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
