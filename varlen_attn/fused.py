"""Pack -> kernel -> unpack as one autograd node (for backends with their own backward).

The composed path (``pack_qkv`` -> backend forward under autograd -> ``unpack``) records three
autograd nodes and keeps the packed q, k, v and output alive from forward to backward, next to
the padded tensors the caller already holds. Here one node does it all, for a backend that
exposes its kernel's forward and backward (``Backend.NATIVE_BACKWARD``):

* forward: gather q, k, v (no autograd), ``forward_lse``, scatter the output; saves the padded
  q, k, v and output (which the caller holds anyway) and the log-sum-exp. The packed copies die
  at the end of the forward.
* backward: gather q, k, v, out and the output gradient again, the kernel's backward, scatter
  dq, dk, dv (gathers through the plan's inverse index, as in :mod:`varlen_attn.pack`).

This trades four gathers in backward for the packed tensors' memory between forward and
backward. ``benchmarks/attention.py`` prints both paths side by side.
"""

from __future__ import annotations

import torch

from .kernels import Backend, VarlenInputs
from .pack import _scatter
from .plan import VarlenPlan


def gather(x: torch.Tensor, plan: VarlenPlan, which: str) -> torch.Tensor:
    """``[B, S, ...]`` -> packed ``[total, ...]``, no autograd."""
    flat = x.flatten(0, 1)
    if which == "q":
        return flat if plan.q_identity else flat.index_select(0, plan.indices_q)
    return flat if plan.k_identity else flat.index_select(0, plan.indices_k)


def scatter(y: torch.Tensor, plan: VarlenPlan, which: str) -> torch.Tensor:
    """Packed ``[total, ...]`` -> ``[B, S, ...]`` with zero padding rows, no autograd."""
    if which == "q":
        s, ident, idx, inv, pad = plan.seqlen_q, plan.q_identity, plan.indices_q, plan.inverse_q, plan.padding_q
    else:
        s, ident, idx, inv, pad = plan.seqlen_k, plan.k_identity, plan.indices_k, plan.inverse_k, plan.padding_k
    flat = y if ident else _scatter(y, idx, plan.batch_size * s, inv, pad)
    return flat.reshape((plan.batch_size, s) + tuple(y.shape[1:]))


def forward(impl: Backend, q, k, v, plan: VarlenPlan, scale: float, causal: bool):
    """Padded ``[B, S, H, D]`` in, ``(padded out, lse [Hq, total_q] or None)`` out; no autograd."""
    inp = VarlenInputs(gather(q, plan, "q"), gather(k, plan, "k"), gather(v, plan, "k"), plan, scale, causal)
    out, lse = impl.forward_lse(inp)
    return scatter(out, plan, "q"), lse


def backward(impl: Backend, dout, q, k, v, out, lse, plan: VarlenPlan, scale: float, causal: bool):
    """Padded gradients ``(dq, dk, dv)`` from the padded output gradient; no autograd."""
    inp = VarlenInputs(gather(q, plan, "q"), gather(k, plan, "k"), gather(v, plan, "k"), plan, scale, causal)
    dq, dk, dv = impl.backward(inp, gather(out, plan, "q"), lse, gather(dout, plan, "q"))
    del inp
    return scatter(dq, plan, "q"), scatter(dk, plan, "k"), scatter(dv, plan, "k")


class FusedAttention(torch.autograd.Function):
    """Padded q, k, v -> padded output, one autograd node. First-order gradients only."""

    @staticmethod
    def forward(ctx, q, k, v, plan, impl, scale, causal):
        out, lse = forward(impl, q, k, v, plan, scale, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.impl, ctx.scale, ctx.causal = plan, impl, scale, causal
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward(ctx.impl, dout, q, k, v, out, lse, ctx.plan, ctx.scale, ctx.causal)
        return dq, dk, dv, None, None, None, None
