"""Pack and unpack: move valid tokens between padded ``[B, S, ...]`` and packed ``[total, ...]``.

Plan indices are unique, so a gather's gradient is a copy into zeros and a scatter's is a
gather: exact, deterministic, no atomics (``index_select``'s own backward uses ``index_add``).
Each function is the other's backward, so higher-order gradients work as well.
"""

from __future__ import annotations

import torch

from ._errors import InputValueError
from .plan import VarlenPlan


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(indices)
        ctx.rows = x.shape[0]
        return x.index_select(0, indices)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (indices,) = ctx.saved_tensors
        return _Scatter.apply(grad, indices, ctx.rows), None


def _scatter(y: torch.Tensor, indices: torch.Tensor, rows: int) -> torch.Tensor:
    out = y.new_zeros((rows,) + tuple(y.shape[1:]))
    return out.index_copy_(0, indices, y)


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, indices: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.save_for_backward(indices)
        return _scatter(y, indices, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (indices,) = ctx.saved_tensors
        return _Gather.apply(grad, indices), None, None


def gather_rows(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``x[indices]`` along dim 0 for unique indices, with exact autograd."""
    return _Gather.apply(x, indices)


def scatter_rows(y: torch.Tensor, indices: torch.Tensor, rows: int) -> torch.Tensor:
    """Zeros of ``[rows, ...]`` with ``out[indices] = y``, for unique indices, exact autograd."""
    return _Scatter.apply(y, indices, rows)


def _side(plan: VarlenPlan, which: str):
    if not plan.packable:
        raise InputValueError(f"plan is not packable ({plan.reason}); there is nothing to pack")
    if which == "q":
        return plan.indices_q, plan.seqlen_q, plan.q_identity
    if which == "k":
        return plan.indices_k, plan.seqlen_k, plan.k_identity
    raise InputValueError(f"which must be 'q' (queries) or 'k' (keys and values), got {which!r}")


def pack(x: torch.Tensor, plan: VarlenPlan, which: str = "q") -> torch.Tensor:
    """``[B, S, ...]`` -> ``[total, ...]``: the valid tokens of the plan's queries (``which="q"``)
    or keys/values (``"k"``), in packed order. Equivalent PyTorch:
    ``x.flatten(0, 1)[plan.indices_q]``. No host sync."""
    indices, seqlen, identity = _side(plan, which)
    if x.dim() < 2 or x.shape[0] != plan.batch_size or x.shape[1] != seqlen:
        raise InputValueError(
            f"x must be [B, S, ...] with B={plan.batch_size}, S={seqlen} (the plan's "
            f"{'query' if which == 'q' else 'key'} shape), got shape {tuple(x.shape)}"
        )
    flat = x.flatten(0, 1)
    return flat if identity else gather_rows(flat, indices)


def unpack(y: torch.Tensor, plan: VarlenPlan, which: str = "q") -> torch.Tensor:
    """``[total, ...]`` -> ``[B, S, ...]``, zeros at positions outside every segment (for
    queries: rows that attend nothing, where SDPA returns zeros). No host sync."""
    indices, seqlen, identity = _side(plan, which)
    total = plan.total_q if which == "q" else plan.total_k
    if y.dim() < 1 or y.shape[0] != total:
        raise InputValueError(
            f"y must be packed [total, ...] with total={total}, got shape {tuple(y.shape)}"
        )
    rows = plan.batch_size * seqlen
    flat = y if identity else scatter_rows(y, indices, rows)
    return flat.reshape((plan.batch_size, seqlen) + tuple(y.shape[1:]))
