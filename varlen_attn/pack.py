"""Pack and unpack: move valid tokens between padded ``[B, S, ...]`` and packed ``[total, ...]``.

Plan indices are unique, so a gather's gradient is a copy into zeros and a scatter's is a
gather: exact, deterministic, no atomics (``index_select``'s own backward uses ``index_add``).
Each function is the other's backward, so higher-order gradients work as well.
"""

from __future__ import annotations

import torch

from ._errors import InputValueError
from .plan import VarlenPlan


def _scatter(y, indices, rows, inverse=None, padding=None, zeros=False):
    """Zeros of ``[rows, ...]`` with ``out[indices] = y``. With the plan's inverse index it is a
    gather plus a fill of only the padding rows: faster than ``index_copy_`` into a zero-filled
    tensor (a slower scatter kernel and a full fill; benchmarks/NOTES.md, change 2). ``zeros``:
    ``y``'s rows past the segments are zeros (an ``INTO_ZEROS`` kernel's), so a static plan's
    padding, whose twins they are, needs no fill: the gather alone."""
    if zeros and inverse is not None and padding is not None and padding.dtype == torch.bool:
        return y.index_select(0, inverse)
    if inverse is None and padding is not None and padding.dtype == torch.bool and y.shape[0] == rows:
        # A static plan without an inverse: ``indices`` permutes every row, so every row is written;
        # the padding's twins hold what the kernel left past cu_seqlens[-1]: filled.
        out = y.new_empty((rows,) + tuple(y.shape[1:])).index_copy_(0, indices, y)
        return out.masked_fill_(padding.view((-1,) + (1,) * (out.dim() - 1)), 0)
    if inverse is None or y.shape[0] == 0:
        out = y.new_zeros((rows,) + tuple(y.shape[1:]))
        return out.index_copy_(0, indices, y)
    out = y.index_select(0, inverse)
    if padding.dtype == torch.bool:
        # A static plan: every row has a packed twin, and the padding's twins hold whatever the
        # kernel left past cu_seqlens[-1] (uninitialised, maybe NaN): filled, not multiplied.
        return out.masked_fill(padding.view((-1,) + (1,) * (out.dim() - 1)), 0)
    return out.index_fill_(0, padding, 0) if padding.numel() else out


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, indices, inverse=None, padding=None):
        ctx.save_for_backward(indices, inverse, padding)
        ctx.rows = x.shape[0]
        return x.index_select(0, indices)

    @staticmethod
    def backward(ctx, grad):
        indices, inverse, padding = ctx.saved_tensors
        return _Scatter.apply(grad, indices, ctx.rows, inverse, padding), None, None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, indices, rows, inverse=None, padding=None):
        ctx.save_for_backward(indices, inverse, padding)
        return _scatter(y, indices, rows, inverse, padding)

    @staticmethod
    def backward(ctx, grad):
        indices, inverse, padding = ctx.saved_tensors
        return _Gather.apply(grad, indices, inverse, padding), None, None, None, None


class _PackQKV(torch.autograd.Function):
    """q, k, v gathered in one autograd node (and their gradients scattered in one backward):
    fewer Python-level autograd calls per attention layer than three, the same kernels
    (benchmarks/NOTES.md, change 3)."""

    @staticmethod
    def forward(ctx, q, k, v, q_side, k_side):
        ctx.q_side, ctx.k_side = q_side, k_side
        ctx.rows = (q.shape[0], k.shape[0])
        qi, ki = q_side[0], k_side[0]
        return (q if qi is None else q.index_select(0, qi), k if ki is None else k.index_select(0, ki),
                v if ki is None else v.index_select(0, ki))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        (qi, qinv, qpad), (ki, kinv, kpad) = ctx.q_side, ctx.k_side
        rq, rk = ctx.rows
        dq = dq if qi is None else _scatter(dq, qi, rq, qinv, qpad)
        dk = dk if ki is None else _scatter(dk, ki, rk, kinv, kpad)
        dv = dv if ki is None else _scatter(dv, ki, rk, kinv, kpad)
        return dq, dk, dv, None, None


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: VarlenPlan):
    """``(pack(q, plan, "q"), pack(k, plan, "k"), pack(v, plan, "k"))`` in one autograd node.
    The backward is first-order only (use :func:`pack` for higher-order gradients)."""
    sides = []
    for x, which in ((q, "q"), (k, "k")):
        indices, seqlen, identity, inverse, padding = _side(plan, which)
        if x.dim() < 2 or x.shape[0] != plan.batch_size or x.shape[1] != seqlen:
            raise InputValueError(
                f"{'query' if which == 'q' else 'key'} must be [B, S, ...] with B={plan.batch_size}, "
                f"S={seqlen}, got shape {tuple(x.shape)}"
            )
        sides.append((None, None, None) if identity else (indices, inverse, padding))
    if v.shape[:2] != k.shape[:2]:
        raise InputValueError(f"value must match key's [B, S], got {tuple(v.shape)} and {tuple(k.shape)}")
    return _PackQKV.apply(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), sides[0], sides[1])


def gather_rows(x: torch.Tensor, indices: torch.Tensor, inverse=None, padding=None) -> torch.Tensor:
    """``x[indices]`` along dim 0 for unique indices, with exact autograd. ``inverse`` (row ->
    packed position, any value for padding rows) and ``padding`` (rows not in ``indices``) make
    the backward scatter a gather."""
    return _Gather.apply(x, indices, inverse, padding)


def scatter_rows(y: torch.Tensor, indices: torch.Tensor, rows: int, inverse=None, padding=None) -> torch.Tensor:
    """Zeros of ``[rows, ...]`` with ``out[indices] = y``, for unique indices, exact autograd."""
    return _Scatter.apply(y, indices, rows, inverse, padding)


def _side(plan: VarlenPlan, which: str):
    if not plan.packable:
        raise InputValueError(f"plan is not packable ({plan.reason}); there is nothing to pack")
    if which == "q":
        return plan.indices_q, plan.seqlen_q, plan.q_identity, plan.inverse_q, plan.padding_q
    if which == "k":
        return plan.indices_k, plan.seqlen_k, plan.k_identity, plan.inverse_k, plan.padding_k
    raise InputValueError(f"which must be 'q' (queries) or 'k' (keys and values), got {which!r}")


def gather_packed(x: torch.Tensor, plan: VarlenPlan, which: str) -> torch.Tensor:
    """:func:`pack` without autograd or shape checks (for callers that own the backward)."""
    indices, _, identity, _, _ = _side(plan, which)
    flat = x.flatten(0, 1)
    return flat if identity else flat.index_select(0, indices)


def scatter_packed(y: torch.Tensor, plan: VarlenPlan, which: str, zeros: bool = False) -> torch.Tensor:
    """:func:`unpack` without autograd or shape checks (for callers that own the backward);
    ``zeros``: ``y``'s rows past the segments are zeros (:func:`_scatter`)."""
    indices, seqlen, identity, inverse, padding = _side(plan, which)
    flat = y if identity else _scatter(y, indices, plan.batch_size * seqlen, inverse, padding, zeros)
    return flat.reshape((plan.batch_size, seqlen) + tuple(y.shape[1:]))


def pack(x: torch.Tensor, plan: VarlenPlan, which: str = "q") -> torch.Tensor:
    """``[B, S, ...]`` -> ``[total, ...]``: the valid tokens of the plan's queries (``which="q"``)
    or keys/values (``"k"``), in packed order. Equivalent PyTorch:
    ``x.flatten(0, 1)[plan.indices_q]``. No host sync."""
    indices, seqlen, identity, inverse, padding = _side(plan, which)
    if x.dim() < 2 or x.shape[0] != plan.batch_size or x.shape[1] != seqlen:
        raise InputValueError(
            f"x must be [B, S, ...] with B={plan.batch_size}, S={seqlen} (the plan's "
            f"{'query' if which == 'q' else 'key'} shape), got shape {tuple(x.shape)}"
        )
    flat = x.flatten(0, 1)
    return flat if identity else gather_rows(flat, indices, inverse, padding)


def unpack(y: torch.Tensor, plan: VarlenPlan, which: str = "q") -> torch.Tensor:
    """``[total, ...]`` -> ``[B, S, ...]``, zeros at positions outside every segment (for
    queries: rows that attend nothing, where SDPA returns zeros). No host sync."""
    indices, seqlen, identity, inverse, padding = _side(plan, which)
    total = plan.total_q if which == "q" else plan.total_k
    if y.dim() < 1 or y.shape[0] != total:
        raise InputValueError(
            f"y must be packed [total, ...] with total={total}, got shape {tuple(y.shape)}"
        )
    rows = plan.batch_size * seqlen
    flat = y if identity else scatter_rows(y, indices, rows, inverse, padding)
    return flat.reshape((plan.batch_size, seqlen) + tuple(y.shape[1:]))
