"""The coverage check of Zephon's initial weights: what ``init_weights`` did to the
parameters and buffers outside the keyed draw, and the refusal that names it.

Invariant: ``titan.weights.init``'s invariant would silently not hold for a parameter that
the model initialises some other way (a ``copy_`` from a tensor of its own making,
no init call at all, a ``param_init`` entry that leaves values unset), for a buffer
left as ``to_empty()`` made it (uninitialised memory) or drawn at random, and for a
random draw during ``init_weights`` outside a parameter's initialiser
(``torch.randn``, ...: it would consume the global generator, whose state is the
same on every rank but not a function of the names). Each one is named in one
``NotTopologyFree``, with what to do instead. A buffer passes when ``init_weights``
re-made it (TorchTitan's ``_init_self_buffers`` assigns a fresh tensor) or wrote it
in place without a random draw.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchtitan_zephon.titan.weights.init_draw import canonical_name


class NotTopologyFree(RuntimeError):
    """``init_weights`` initialised a parameter or a buffer in a way whose value
    could depend on the topology; the message names each one."""


class BufferWatch:
    """``module``'s buffers as ``init_weights`` found them, and which of them it
    wrote in place (``written``) or drew at random (``random``). ``random_names``:
    the names of the in-place methods and ``torch.nn.init`` functions that draw."""

    def __init__(self, module: nn.Module, random_names: frozenset[str]) -> None:
        # canonical name -> (owning module, attribute, the tensor before init)
        self._buffers = {
            canonical_name(f"{mname}.{bname}" if mname else bname): (m, bname, b)
            for mname, m in module.named_modules()
            for bname, b in m._buffers.items()
            if b is not None
        }
        self._buffer_ids = {id(b): name for name, (_, _, b) in self._buffers.items()}
        self._random_names = random_names
        self.written: set[str] = set()
        self.random: set[str] = set()

    def note_write(self, tensor: Any, fname: str) -> bool:
        """Record an in-place ``fname`` (a method or ``torch.nn.init`` name) on a buffer;
        True when ``tensor`` is one."""
        name = self._buffer_ids.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        if name is None or self._buffers[name][2] is not tensor:
            return False
        if fname in self._random_names:
            self.random.add(name)
        elif fname.endswith("_"):
            self.written.add(name)
        return True

    def untouched(self) -> list[str]:
        """Buffers ``init_weights`` neither re-made nor wrote in place."""
        return sorted(
            name
            for name, (m, attr, before) in self._buffers.items()
            if m._buffers.get(attr) is before and name not in self.written
        )

    def release(self) -> None:
        """Drop the tensors before init (not kept alive)."""
        self._buffers.clear()
        self._buffer_ids.clear()


def refuse_uncovered(
    *,
    final: list[tuple[str, str | None]],
    calls: dict[str, int],
    unknown: set[str],
    unset: set[str],
    untouched: list[str],
    random_buffers: set[str],
    stray_draws: dict[str, int],
) -> None:
    """Raise ``NotTopologyFree`` naming every parameter and buffer whose initial value
    could depend on the topology, and every stray draw; nothing when there is none.
    ``final``: (canonical name, tracked name or None) of each parameter the module
    holds after ``init_weights``; ``calls``: the init calls per tracked name."""
    missed = sorted(
        fqn if name is None else name
        for fqn, name in final
        if name is None or (name not in calls and name not in unknown)
    )
    copied, left_unset, drawn = sorted(unknown), sorted(unset), sorted(random_buffers)
    stray = [f"{f} ({n} call{'s' if n > 1 else ''})" for f, n in sorted(stray_draws.items())]
    if missed or copied or left_unset or untouched or drawn or stray:
        lines = []
        if missed:
            lines.append(f"never initialised through torch.nn.init: {', '.join(missed)}")
        if left_unset:
            lines.append(f"left (partly) unset by their param_init: {', '.join(left_unset)}")
        if copied:
            lines.append(f"overwritten by copy_ from another tensor: {', '.join(copied)}")
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
