"""Document-causal attention where FlexAttention cannot train: SDPA with a dense mask.

Role: ``document_positions`` (the loader's: a pure function of a batch's inputs) gives
each input token its position within its document (the batch's ``positions``, which the
dataloader and the validator add).
TorchTitan 0.3's default inner attention (FlexAttention, or varlen) masks
attention across the documents of a packed sample, from those ``positions``; neither has a backward on CPU. The platform layer puts
``DocumentSDPA`` in their place there (``platform.cpu_config_defaults``), and the
trainer and the validator hand it ``document_mask(positions)`` as the model's
``attention_masks`` (``with_document_masks``), since TorchTitan builds masks only
for its Flex and varlen backends.

Invariant: ``document_mask`` allows query ``q`` to attend key ``k`` exactly when
``k <= q`` and no document starts in ``(k, q]`` (a position 0 starts a document),
the mask TorchTitan's Flex path builds (causal AND packed-document); so on the same
batch DocumentSDPA computes what FlexAttention computes, up to floating-point
order (tests/titan/test_port_core.py compares them on CPU, where Flex runs forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torchtitan.models.common.attention import ScaledDotProductAttention

from torchtitan_zephon.job.documents import document_positions

__all__ = ["DocumentSDPA", "document_mask", "document_positions", "with_document_masks"]


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """``[b, 1, L, L]`` boolean: causal within each document of each row of
    ``positions`` (``[b, L]``, restarting at 0 where a document starts)."""
    doc = (positions == 0).cumsum(dim=-1)
    same = doc.unsqueeze(-1) == doc.unsqueeze(-2)
    length = positions.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=positions.device).tril()
    return (same & causal).unsqueeze(1)


class DocumentSDPA(ScaledDotProductAttention):
    """SDPA whose ``attention_masks`` is a dense boolean mask (``document_mask``);
    without one, plain causal SDPA."""

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        pass

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: torch.Tensor | None = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        if attention_masks is None:
            return super().forward(
                q_BLNH, k_BLNH, v_BLNH, scale=scale, enable_gqa=enable_gqa, is_causal=is_causal
            )
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_masks, scale=scale, enable_gqa=enable_gqa
        )
        return out.transpose(1, 2)


def uses_document_sdpa(model_config: Any) -> bool:
    """Whether the model's (first) attention is ``DocumentSDPA``."""
    attention = getattr(model_config, "first_attention", None)
    return isinstance(getattr(attention, "inner_attention", None), DocumentSDPA.Config)


def with_document_masks(model_config: Any, extra_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``extra_kwargs`` (the model's forward keyword arguments) with the document mask
    of its ``positions`` when the model attends with ``DocumentSDPA``."""
    positions = extra_kwargs.get("positions")
    if positions is not None and "attention_masks" not in extra_kwargs:
        if uses_document_sdpa(model_config):
            extra_kwargs["attention_masks"] = document_mask(positions)
    return extra_kwargs
