"""Standalone unpad/pad utilities, drop-in compatible with ``flash_attn.bert_padding``.

``unpad_input`` and ``pad_input`` take and return what flash-attn's functions of the same names
do, without flash-attn installed; ``unpad_input`` syncs once (flash-attn twice). Masks are read
as ``nonzero = valid``, lengths and indices from one boolean mask, so they always agree (flash-attn's
disagree for values other than 0/1); for 0/1 and bool masks the results equal flash-attn's. For no
sync per layer, use a :class:`~varlen_attn.plan.VarlenPlan` with :func:`varlen_attn.pack`.
"""

from __future__ import annotations

import torch

from . import _stats
from ._errors import InputTypeError, InputValueError, check_size, describe
from .pack import gather_rows, scatter_rows

# pad_input's index dtypes: the integer dtypes torch's advanced indexing (flash-attn's
# ``output[indices] = values``) reads as positions; uint8/bool would be read as masks.
_INDEX_DTYPES = (torch.int64, torch.int32)


def _valid(name: str, mask: object, shape: torch.Size) -> torch.Tensor:
    """``mask`` checked and read as a bool ``[B, S]`` tensor, nonzero = True."""
    if not isinstance(mask, torch.Tensor):
        raise InputTypeError(f"{name} must be a [B, S] tensor, got {describe(mask)}")
    if mask.shape != shape:
        raise InputValueError(
            f"{name} must be [B, S] = {list(shape)} (hidden_states' first two dims), got shape "
            f"{tuple(mask.shape)}"
        )
    if mask.is_complex():
        raise InputTypeError(f"{name} must be bool, integer or floating (nonzero = valid), got dtype {mask.dtype}")
    return mask if mask.dtype == torch.bool else mask != 0


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None):
    """Drop padded tokens: ``[B, S, ...]`` -> ``[total, ...]``.

    Args:
        hidden_states: ``[B, S, ...]``.
        attention_mask: ``[B, S]`` bool, integer or floating; nonzero = valid token (anywhere in
            the row). Any nonzero value counts as one token.
        unused_mask: optional ``[B, S]``, same dtypes, tokens that are allocated but not used
            (kept in the output and in ``cu_seqlens``, excluded from ``seqused``), as in
            flash-attn. A token nonzero in both masks is one used token.

    Returns:
        ``(hidden_states_unpadded [total, ...], indices int64 [total], cu_seqlens int32 [B+1],
        max_seqlen_in_batch int, seqused int32 [B])``; ``cu_seqlens`` and ``seqused`` count
        nonzero entries, so ``cu_seqlens[-1] == len(indices)`` always.

    Equivalent PyTorch: ``hidden_states.flatten(0, 1)[attention_mask.flatten().nonzero()[:, 0]]``.
    """
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 2:
        raise InputValueError(f"hidden_states must be a tensor [B, S, ...], got {describe(hidden_states)}")
    shape = hidden_states.shape[:2]
    used_mask = _valid("attention_mask", attention_mask, shape)
    keep = used_mask if unused_mask is None else used_mask | _valid("unused_mask", unused_mask, shape)
    seqlens = keep.sum(dim=-1, dtype=torch.int32)
    used = used_mask.sum(dim=-1, dtype=torch.int32)
    # One sync for both facts a host needs: the token total and the max length.
    batch = hidden_states.shape[0]
    _stats.record_host_sync()
    total, max_len = torch.stack([seqlens.sum(), seqlens.max() if batch else seqlens.sum()]).tolist()
    # The positions of the True entries in order (== nonzero), with the size known: no 2nd sync.
    indices = torch.sort((~keep.flatten()).to(torch.uint8), stable=True).indices[:total]
    cu = torch.nn.functional.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
    return gather_rows(hidden_states.flatten(0, 1), indices), indices, cu, int(max_len), used


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Put packed tokens back: ``[total, ...]`` -> ``[batch, seqlen, ...]``, zeros elsewhere.

    ``indices``: 1-D int64 or int32 (as flash-attn's ``output[indices] = hidden_states``
    accepts), unique, each in ``[0, batch * seqlen)``.

    Equivalent PyTorch: ``out = zeros(batch * seqlen, ...); out[indices] = hidden_states``.
    """
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 1:
        raise InputValueError(f"hidden_states must be a packed tensor [total, ...], got {describe(hidden_states)}")
    if not isinstance(indices, torch.Tensor) or indices.dtype not in _INDEX_DTYPES or indices.dim() != 1:
        raise InputTypeError(f"indices must be a 1-D int64 or int32 tensor, got {describe(indices)}")
    if indices.shape[0] != hidden_states.shape[0]:
        raise InputValueError(
            f"indices must have one entry per packed token ({hidden_states.shape[0]}), got {indices.shape[0]}"
        )
    batch, seqlen = check_size("batch", batch), check_size("seqlen", seqlen)
    # index_copy_ (the scatter) wants int64 on the data's device; flash-attn's indexing takes
    # int32 and CPU indices as well.
    indices = indices.to(device=hidden_states.device, dtype=torch.int64)
    out = scatter_rows(hidden_states, indices, batch * seqlen)
    return out.reshape((batch, seqlen) + tuple(hidden_states.shape[1:]))
