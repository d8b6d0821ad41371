"""Standalone unpad/pad utilities, drop-in compatible with ``flash_attn.bert_padding``.

``unpad_input`` and ``pad_input`` take the same arguments and return the same tuple and dtypes
as flash-attn's functions of the same names, without needing flash-attn installed; gathers and
scatters use exact, atomic-free autograd. ``unpad_input`` syncs once (for ``max_seqlen``),
flash-attn's twice. To sync zero times per layer, build a :class:`~varlen_attn.plan.VarlenPlan`
once and use :func:`varlen_attn.pack` / :func:`varlen_attn.unpack` with it.
"""

from __future__ import annotations

import torch

from . import _stats
from ._errors import InputTypeError, InputValueError, describe
from .pack import gather_rows, scatter_rows


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None):
    """Drop padded tokens: ``[B, S, ...]`` -> ``[total, ...]``.

    Args:
        hidden_states: ``[B, S, ...]``.
        attention_mask: ``[B, S]`` bool or int, nonzero = valid token (anywhere in the row).
        unused_mask: optional ``[B, S]``, tokens that are allocated but not used (kept in the
            output and in ``cu_seqlens``, excluded from ``seqused``), as in flash-attn.

    Returns:
        ``(hidden_states_unpadded [total, ...], indices int64 [total], cu_seqlens int32 [B+1],
        max_seqlen_in_batch int, seqused int32 [B])``.

    Equivalent PyTorch: ``hidden_states.flatten(0, 1)[attention_mask.flatten().nonzero()[:, 0]]``.
    """
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 2:
        raise InputValueError(f"hidden_states must be a tensor [B, S, ...], got {describe(hidden_states)}")
    masks = [("attention_mask", attention_mask)] + ([("unused_mask", unused_mask)] if unused_mask is not None else [])
    for name, m in masks:
        if not isinstance(m, torch.Tensor):
            raise InputTypeError(f"{name} must be a [B, S] tensor, got {describe(m)}")
        if m.shape != hidden_states.shape[:2]:
            raise InputValueError(
                f"{name} must be [B, S] = {list(hidden_states.shape[:2])} (hidden_states' first "
                f"two dims), got shape {tuple(m.shape)}"
            )
        if m.is_floating_point() or m.is_complex():
            raise InputTypeError(f"{name} must be bool or integer (nonzero = valid), got dtype {m.dtype}")
    all_masks = attention_mask if unused_mask is None else (attention_mask.bool() | unused_mask.bool())
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    # One sync for both facts a host needs: the token total and the max length.
    batch = hidden_states.shape[0]
    _stats.record_host_sync()
    total, max_len = torch.stack([seqlens.sum(), seqlens.max() if batch else seqlens.sum()]).tolist()
    keep = all_masks.flatten().bool()
    indices = torch.sort((~keep).to(torch.uint8), stable=True).indices[:total]
    cu = torch.nn.functional.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
    return gather_rows(hidden_states.flatten(0, 1), indices), indices, cu, int(max_len), used


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Put packed tokens back: ``[total, ...]`` -> ``[batch, seqlen, ...]``, zeros elsewhere.

    Equivalent PyTorch: ``out = zeros(batch * seqlen, ...); out[indices] = hidden_states``.
    """
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 1:
        raise InputValueError(f"hidden_states must be a packed tensor [total, ...], got {describe(hidden_states)}")
    if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int64 or indices.dim() != 1:
        raise InputTypeError(f"indices must be a 1-D int64 tensor, got {describe(indices)}")
    if indices.shape[0] != hidden_states.shape[0]:
        raise InputValueError(
            f"indices must have one entry per packed token ({hidden_states.shape[0]}), got {indices.shape[0]}"
        )
    out = scatter_rows(hidden_states, indices, batch * seqlen)
    return out.reshape((batch, seqlen) + tuple(hidden_states.shape[1:]))
