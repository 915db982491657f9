"""Where each document starts within a batch: the per-document positions of its tokens.

Role: ``document_positions`` is the batch's ``positions`` input (TorchTitan 0.3 builds
block-causal masks and RoPE positions from it), a pure function of the sample windows
the loader delivers; the dataloader and the validator add it to each batch
(``titan.components.attention``), and ``loader`` exports it too.

Invariant: a row counts 0, 1, 2, ... from its first token and again from 0 at the token
after each EOS; nothing but the inputs is read, so it is the same on every rank and
topology.
"""

from __future__ import annotations

import torch


def document_positions(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Per-document positions of a micro-batch's inputs ``[b, L]``: a pure function of
    the sample windows. Each row counts 0, 1, 2, ... from its first token and again
    from 0 at the token after each ``eos_id``; document offsets are not read.
    TorchTitan 0.3 builds block-causal masks (and RoPE positions) from them."""
    length = inputs.shape[-1]
    index = torch.arange(length, dtype=torch.int64).expand_as(inputs)
    starts = torch.zeros_like(inputs, dtype=torch.bool)
    starts[..., 0] = True
    starts[..., 1:] = inputs[..., :-1] == eos_id
    last_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - last_start
