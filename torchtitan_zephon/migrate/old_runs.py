"""Old runs: checkpoints written by the TorchTitan 0.2.2-based Zephon, resumed on 0.3.

Role: tell a 0.2.2 checkpoint from a 0.3 one by its keys (0.2.2 saved the LR
scheduler's whole ``LambdaLR`` state, ``lr_scheduler._step_count`` and the rest;
0.3 saves only ``lr_scheduler.last_epoch``), map every one of its keys onto the
0.3 job's (``OLD_TO_NEW``: llama3's parameter names (FQNs) as 0.2.2's module
tree spelt them, onto 0.3's), refuse what does not map, and load such a
checkpoint through the map in TorchTitan's ``CheckpointManager`` (``install``).

What changed between the two llama3 trees:

* ``layers.N.attention.w{q,k,v}.weight`` -> ``layers.N.attention.qkv_linear.w{q,k,v}.weight``
  (0.3 fuses q/k/v into one ``qkv_linear.wqkv`` parameter and splits it back on save);
* ``output.weight`` -> ``lm_head.weight``; every other parameter keeps its name;
* the optimizer's state is keyed by parameter, so ``optimizer.state.<P>.<S>`` and
  ``optimizer.param_groups.<P>.<H>`` follow the parameter's rename, and 0.2.2's
  three states of ``wq``/``wk``/``wv`` are merged into the one of ``wqkv``, in
  the layout 0.3's ``FusedQKVLinear`` merges the weights (per KV group: its query
  heads, then its key head, then its value head);
* ``lr_scheduler.last_epoch``, ``train_state.*`` and the Zephon data record
  ``dataloader.zephon`` keep their keys (the data state's format did not change:
  the preflight checks it as it checks a 0.3 one); 0.2.2's other LR scheduler
  fields are dropped: 0.3 recomputes them from ``last_epoch`` and the optimizer.

A model-only 0.2.2 checkpoint (``--checkpoint.initial_load_path`` with
``--checkpoint.initial_load_model_only``, or a seed checkpoint ``step-0``) maps and
loads the same way, its model keys only.

Invariants:
- ``check`` only reads (the checkpoint's ``.metadata``); it runs in the preflight,
  so a refused start writes nothing. It refuses, naming the first key (in sorted
  order) that has no 0.3 name and the git tag ``titan-0.2.2`` that still serves
  0.2.2, every 0.2.2 checkpoint that does not map completely onto a llama3 job:
  another model family, a key outside the map.
- A mapped checkpoint loads every value the 0.3 job resumes from out of the old
  checkpoint, exactly (renamed, or for fused q/k/v optimizer states concatenated):
  a 0.3 key with no source in the map stops the load naming it. A 0.3 checkpoint
  is loaded by TorchTitan untouched. Renamed values are read as DCP reads them (each
  rank its shard); a fused state is read whole on every rank, one layer at a time
  (its q/k/v states: 2 x 96 MB a layer for llama3 8B in fp32), and each rank
  keeps its shard.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchtitan_zephon.run.recorded import DATA_STATE_KEY

TAG = "titan-0.2.2"
"""The git tag on the last commit of the 0.2.2-based code (it resumes any of its runs)."""

FAMILY = "llama3"
"""The one model family 0.2.2's Zephon trained (its TrainSpec ``zephon_llama3``)."""

LR_SCHEDULER_V3 = "lr_scheduler.last_epoch"
"""The only LR scheduler key 0.3 saves (``LRSchedulersContainer.state_dict``)."""

DROPPED = frozenset(
    {
        "lr_scheduler.base_lrs",
        "lr_scheduler._step_count",
        "lr_scheduler._is_initial",
        "lr_scheduler._get_lr_called_within_step",
        "lr_scheduler._last_lr",
        "lr_scheduler.verbose",
    }
)
"""0.2.2's LambdaLR fields that 0.3 recomputes from ``last_epoch`` and the optimizer."""

_LAYER = r"layers\.(?P<n>\d+)\."
PARAMETERS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(old), new)
    for old, new in (
        (r"tok_embeddings\.weight", r"tok_embeddings.weight"),
        (_LAYER + r"attention\.w(?P<p>[qkv])\.weight", r"layers.\g<n>.attention.qkv_linear.w\g<p>.weight"),
        (_LAYER + r"attention\.wo\.weight", r"layers.\g<n>.attention.wo.weight"),
        (_LAYER + r"feed_forward\.w(?P<w>[123])\.weight", r"layers.\g<n>.feed_forward.w\g<w>.weight"),
        (_LAYER + r"(?P<norm>attention_norm|ffn_norm)\.weight", r"layers.\g<n>.\g<norm>.weight"),
        (r"norm\.weight", r"norm.weight"),
        (r"output\.weight", r"lm_head.weight"),
    )
)  # fmt: skip
"""0.2.2 llama3 parameter FQN -> 0.3 llama3 FQN as 0.3 checkpoints it (q/k/v split)."""

_FUSED = re.compile(r"(?P<prefix>layers\.\d+\.attention\.)qkv_linear\.w(?P<p>[qkv])\.weight")
"""A 0.3 name of one third of a fused q/k/v parameter (the optimizer holds ``wqkv``)."""

KEPT = frozenset({"train_state.step", "train_state.ntokens_seen", LR_SCHEDULER_V3, DATA_STATE_KEY})
"""Keys both versions save under the same name besides parameters: the trainer's, the LR
scheduler's step, and the Zephon data record (``dataloader.zephon``)."""

OPTIMIZER = re.compile(r"optimizer\.(?P<part>state|param_groups)\.(?P<rest>.+)")


class OldRunRefused(ValueError):
    """A 0.2.2 checkpoint this version cannot resume; the message says what to do."""


MODEL_ONLY_MARK = "output.weight"
"""0.2.2's name of the output projection: no 0.3 model has a top-level ``output`` (0.3's
decoders call it ``lm_head``), so a model-only checkpoint holding it was written by 0.2.2."""


def written_by_022(keys: frozenset[str] | set[str]) -> str | None:
    """The key that shows a checkpoint was written by 0.2.2, or None (0.3's): a training
    checkpoint by its LR scheduler fields, a model-only one (0.2.2's
    ``last_save_model_only`` default, a seed checkpoint) by ``output.weight``."""
    marks = sorted(k for k in keys if k.startswith("lr_scheduler.") and k != LR_SCHEDULER_V3)
    if "lr_scheduler._step_count" in marks:  # LambdaLR's own counter: the plainest witness
        return "lr_scheduler._step_count"
    if marks:
        return marks[0]
    if LR_SCHEDULER_V3 in keys:  # a training checkpoint 0.3 wrote
        return None
    if MODEL_ONLY_MARK in keys and "lm_head.weight" not in keys:
        return MODEL_ONLY_MARK
    return None


def parameter_name(old: str) -> str | None:
    """0.3's FQN of 0.2.2 llama3 parameter ``old`` (None: not a llama3 parameter)."""
    for pattern, new in PARAMETERS:
        m = pattern.fullmatch(old)
        if m:
            return m.expand(new)
    return None


def optimizer_parameter(new: str) -> str:
    """The parameter the 0.3 optimizer keys ``new`` by: a fused q/k/v third -> ``wqkv``."""
    m = _FUSED.fullmatch(new)
    return f"{m.group('prefix')}qkv_linear.wqkv.weight" if m else new


def _split_optimizer_key(rest: str, parameters: set[str]) -> tuple[str, str] | None:
    """(parameter, field) of ``<parameter>.<field>``; the parameter is one of ``parameters``."""
    head, _, tail = rest.rpartition(".")
    return (head, tail) if head in parameters and tail else None


def new_key(old: str, parameters: set[str]) -> str | None:
    """0.3's key of 0.2.2 checkpoint key ``old`` (None: unmapped). ``parameters``: the
    checkpoint's parameter FQNs (to split optimizer keys, whose fields may hold dots)."""
    if old in KEPT:
        return old
    name = parameter_name(old)
    if name is not None:
        return name
    m = OPTIMIZER.fullmatch(old)
    if m:
        split = _split_optimizer_key(m.group("rest"), parameters)
        if split is not None:
            parameter = parameter_name(split[0])
            if parameter is not None:
                return f"optimizer.{m.group('part')}.{optimizer_parameter(parameter)}.{split[1]}"
    return None


@dataclass
class OldCheckpoint:
    """A 0.2.2 checkpoint and how each of its keys maps onto the 0.3 llama3 job's."""

    path: Path
    marker: str
    """The key that shows 0.2.2 wrote it."""
    sources: dict[str, list[str]] = field(default_factory=dict)
    """0.3 key -> the 0.2.2 key(s) it is loaded from (three for a fused q/k/v state)."""
    dropped: list[str] = field(default_factory=list)

    def describe(self) -> str:
        fused = sum(len(v) > 1 for v in self.sources.values())
        renamed = sum(len(v) == 1 and v[0] != k for k, v in self.sources.items())
        return (
            f"checkpoint {self.path} was written by the TorchTitan 0.2.2-based Zephon (git tag "
            f"{TAG}); it is loaded through the llama3 name map: {len(self.sources)} keys, "
            f"{renamed} renamed, {fused} optimizer states merged from q/k/v into qkv_linear.wqkv, "
            f"{len(self.dropped)} LR scheduler fields dropped (0.3 recomputes them)"
        )


def _refusal(path: Path, marker: str, why: str) -> str:
    return (
        f"the checkpoint {path} was written by the TorchTitan 0.2.2-based Zephon (it holds "
        f"{marker!r}, which 0.3 does not save); {why}. This version resumes a 0.2.2 checkpoint "
        f"only for a {FAMILY} model, through a map of parameter names. Resume this run with "
        f"the 0.2.2-based code, git tag {TAG} (`git checkout {TAG}`), or start a new "
        "--dump_folder. Nothing was changed on disk."
    )


def map_checkpoint(
    path: Path, keys: frozenset[str] | set[str], model_name: str
) -> OldCheckpoint | None:
    """The map of a checkpoint's ``keys`` onto a ``model_name`` job's (None: not a 0.2.2
    checkpoint). Raises OldRunRefused naming the first key (sorted) that has no 0.3 name."""
    marker = written_by_022(keys)
    if marker is None:
        return None
    old = OldCheckpoint(Path(path), marker)
    parameters = {k for k in keys if parameter_name(k) is not None}
    if model_name != FAMILY:
        # the data record and the trainer's keys map for any family: the first key of
        # 0.2.2's llama3 modules is the first with no name in this job's model
        first = next(k for k in sorted(keys) if k not in KEPT and k not in DROPPED)
        raise OldRunRefused(
            _refusal(
                old.path,
                marker,
                f"its keys name 0.2.2's {FAMILY} modules, and this job's model is "
                f"{model_name or 'unnamed'}: key {first!r} (the first) has no {model_name} name",
            )
        )
    for key in sorted(keys):
        if key in DROPPED:
            old.dropped.append(key)
            continue
        new = new_key(key, parameters)
        if new is None:
            raise OldRunRefused(
                _refusal(old.path, marker, f"key {key!r} has no 0.3 {FAMILY} name in the map")
            )
        old.sources.setdefault(new, []).append(key)
    for olds in old.sources.values():  # q, k, v: the order FusedQKVLinear merges them in
        olds.sort(key=_qkv_order)
    return old


def _qkv_order(key: str) -> int:
    m = re.search(r"\.attention\.w([qkv])\.", key)
    return "qkv".index(m.group(1)) if m else 0


def check(info: Any, job: Any) -> OldCheckpoint | None:
    """The preflight's check of the checkpoint TorchTitan will load, a resume or model
    only (a verified ``runs.CheckpointInfo``)
    for ``job`` (a ``titan.settings.job_view.JobView``; its model is read only for a 0.2.2
    checkpoint): the map when 0.2.2 wrote it, None when 0.3 did; OldRunRefused when it
    does not map."""
    if written_by_022(info.keys) is None:
        return None
    return map_checkpoint(info.path, info.keys, job.model_name)


# ---------------------------------------------------------------- the load


def _merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q/k/v rows in 0.3's fused layout: per KV group its query heads, its key, its value
    (``FusedQKVLinear._merge_qkv_on_load``, applied here to optimizer states)."""
    n_kv = k.shape[0] // head_dim
    tail = tuple(q.shape[1:])
    hpk = q.shape[0] // k.shape[0]
    parts = (
        q.reshape(n_kv, hpk, head_dim, *tail),
        k.reshape(n_kv, 1, head_dim, *tail),
        v.reshape(n_kv, 1, head_dim, *tail),
    )
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def _head_dim(models: list[torch.nn.Module], new: str) -> int:
    """The head dim of the fused q/k/v module that optimizer key ``new`` belongs to."""
    name = new.removeprefix("optimizer.state.").split(".qkv_linear.")[0] + ".qkv_linear"
    for model in models:
        try:
            return int(model.get_submodule(name).head_dim)
        except AttributeError:
            continue
    raise RuntimeError(f"{new}: the model has no fused q/k/v module {name}")


def load(manager: Any, state_dict: dict[str, Any], checkpoint_id: str, old: OldCheckpoint) -> None:
    """Load the 0.2.2 checkpoint ``old`` into TorchTitan's ``state_dict`` (the one its
    ``CheckpointManager.dcp_load`` is given: model tensors flat, the other states as
    ``Stateful``s) through the map, then hand each state its values as DCP would."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
    from torch.distributed.checkpoint.stateful import Stateful
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.components.checkpointer.base import MODEL

    stateful = {k for k, v in state_dict.items() if isinstance(v, Stateful)}
    live = {k: (v.state_dict() if k in stateful else v) for k, v in state_dict.items()}
    flat, mapping = flatten_state_dict(live)
    request: dict[str, Any] = {}
    fused: dict[str, list[str]] = {}  # layer -> its fused q/k/v optimizer state keys
    for key, value in flat.items():
        sources = old.sources.get(key)
        if not sources:
            raise RuntimeError(
                f"the 0.2.2 checkpoint {checkpoint_id} has no value for the 0.3 job's key {key!r} "
                f"in the {FAMILY} name map: resume this run with git tag {TAG}"
            )
        if len(sources) == 1 or not isinstance(value, torch.Tensor) or value.dim() == 0:
            request[sources[0]] = value  # a step count, a hyperparameter: q's (all three agree)
        else:
            fused.setdefault(key.split(".qkv_linear.")[0], []).append(key)
    dcp.load(request, checkpoint_id=checkpoint_id)
    for key, value in flat.items():
        sources = old.sources[key]
        if len(sources) != 1 and isinstance(value, torch.Tensor) and value.dim() > 0:
            continue
        if isinstance(value, torch.Tensor):
            if request[sources[0]] is not value:
                value.copy_(request[sources[0]])
        else:
            flat[key] = request[sources[0]]
    # The fused states, one layer at a time (0.2.2's q/k/v states of a layer are read
    # whole on every rank, merged, and each rank keeps its shard).
    models = manager.states[MODEL].model
    metadata = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    for keys in fused.values():
        parts = {
            source: torch.empty(
                tuple(metadata[source].size), dtype=metadata[source].properties.dtype
            )
            for key in keys
            for source in old.sources[key]
        }
        dcp.load(parts, checkpoint_id=checkpoint_id)
        for key in keys:
            value = flat[key]
            full = _merge_qkv(*(parts[s] for s in old.sources[key]), _head_dim(models, key))
            if isinstance(value, DTensor):
                full = full.to(value.to_local().device)
                full = distribute_tensor(
                    full, value.device_mesh, value.placements, src_data_rank=None
                )
            else:
                full = full.to(value.device)
            value.copy_(full)
    nested = unflatten_state_dict(flat, mapping)
    for key in stateful:
        state_dict[key].load_state_dict(nested[key])
    manager.states[MODEL].load_state_dict({k: v for k, v in nested.items() if k not in stateful})


def install(manager: Any, old: OldCheckpoint) -> None:
    """Make TorchTitan's checkpoint manager load ``old`` through the map (and any other
    checkpoint its own way): the seam is the manager's ``dcp_load``."""
    own = manager.dcp_load
    target = Path(old.path).resolve()

    def dcp_load(
        state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool
    ) -> None:
        if not from_hf and Path(checkpoint_id).resolve() == target:
            load(manager, state_dict, checkpoint_id, old)
        else:
            own(
                state_dict,
                checkpoint_id=checkpoint_id,
                from_hf=from_hf,
                from_quantized=from_quantized,
            )

    manager.dcp_load = dcp_load
