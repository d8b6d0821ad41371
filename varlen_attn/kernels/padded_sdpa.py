"""``padded_sdpa``: SDPA on the *padded* tensors with the plan's key-padding mask, once per plan.

A padding mask is the outer product of the queries kept and the keys kept in each batch element
(Chroma's, Qwen-Image's, every text-padding mask): stock SDPA reads it as a dense
``[B, 1, Sq, Sk]`` mask, converts it to a bias in every layer and streams it through the
kernel. When the plan has at most one segment per batch element, the same attention is SDPA
with a ``[B, 1, 1, Sk]`` key bias (0 / -inf, made once per plan and dtype, aligned so that SDPA
copies nothing), then zeros at the query rows in no segment, as SDPA returns for rows with no
valid key. One SDPA call and one fill per layer: no gather, no scatter, no Python autograd node
(the backward is SDPA's and the fill's own), which is what a host-bound step pays for; and a
cheaper kernel than stock's, with no ``Sq x Sk`` bias to read (benchmarks/NOTES.md, entry 21).

It computes every padded position, so where padding is a large share of the tokens a varlen
kernel that skips it does less work. Batch elements with no valid key get a bias of zeros: their
rows are all in no segment, so they come out as zeros, and their zero gradients stay exact.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from ..pack import segment_ids
from ._base import Backend, VarlenInputs


# plan -> {dtype: (key bias [B, 1, 1, Sk], query rows in no segment [B, Sq, 1, 1] or None)}: made at
# the plan's first call, shared by every layer of the forward (and its recomputation).
_masks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def key_bias(plan, dtype: torch.dtype) -> torch.Tensor:
    """``[B, 1, 1, Sk]`` additive bias: 0 at the keys in the element's segment, -inf elsewhere;
    0 everywhere in an element with no key in a segment. Its rows are allocated at a multiple of
    16 elements (the memory-efficient kernel's alignment) and viewed down to ``Sk``, so SDPA
    neither pads nor copies it."""
    keep = segment_ids(plan, "k") >= 0
    keep = keep | ~keep.any(1, keepdim=True)
    b, sk = keep.shape
    aligned = -(-sk // 16) * 16
    bias = torch.zeros((b, 1, 1, aligned), dtype=dtype, device=keep.device)[..., :sk]
    return bias.masked_fill_(~keep[:, None, None, :], float("-inf"))


def _masks_of(plan, dtype: torch.dtype):
    entry = _masks.get(plan)
    if entry is None:
        entry = _masks.setdefault(plan, {})
    found = entry.get(dtype)
    if found is None:
        rows = None if plan.q_identity else (segment_ids(plan, "q") < 0)[:, :, None, None]
        found = entry[dtype] = (key_bias(plan, dtype), rows)
    return found


def padded_sdpa(q, k, v, plan, scale: float) -> torch.Tensor:
    """Padded ``[B, S, H, D]`` q, k, v -> ``[B, Sq, Hq, Dv]``: attention within the plan's
    segments (at most one per batch element), zeros at query positions in none."""
    bias, rows = _masks_of(plan, q.dtype)
    gqa = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias,
                                         scale=scale, **gqa).transpose(1, 2)
    return out if rows is None else out.masked_fill(rows, 0)


def one_segment_per_element(plan) -> bool:
    """At most one segment in each batch element: the mask is a key-padding mask per element."""
    return plan.static or len(set(plan.segment_batch)) == len(plan.segment_batch)


class PaddedSdpaBackend(Backend):
    NAME = "padded_sdpa"
    SUPPORTS_CAUSAL = False  # causal within segments is not causal by padded position
    SUPPORTS_DROPOUT = False
    STATIC_PLANS = True  # device ops only: the bias comes from cu_seqlens and the inverse index
    PADDED = True

    def not_supported_reasons(self, inp: VarlenInputs) -> list[str]:
        reasons = super().not_supported_reasons(inp)
        if not one_segment_per_element(inp.plan):
            reasons.append("a batch element holds more than one segment (a key-padding mask cannot "
                           "say which keys each query sees)")
        return reasons

    def forward_padded(self, q, k, v, plan, scale: float, causal: bool) -> torch.Tensor:
        return padded_sdpa(q, k, v, plan, scale)
