"""Pack -> kernel -> unpack as one autograd node (for backends with their own backward).

The composed path (``pack_qkv`` -> backend forward under autograd -> ``unpack``) records three
autograd nodes. Here one node does it all, for a backend that exposes its kernel's forward and
backward (``Backend.NATIVE_BACKWARD``):

* forward: gather q, k, v (no autograd), ``forward_lse``, scatter the output;
* backward: gather the output gradient, the kernel's backward, scatter dq, dk, dv (gathers
  through the plan's inverse index, as in :mod:`varlen_attn.pack`).

The kernels and bytes moved are the composed path's; what goes is the Python and autograd
bookkeeping of two extra nodes per layer (host time, which dominates at small shapes).
``benchmarks/attention.py`` prints both paths side by side.
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
    """Padded q, k, v -> padded output, one autograd node. First-order gradients only.

    Saves the packed q, k, v, output and lse (as the composed path does): re-gathering them in
    backward instead measured 0.13 ms slower at Chroma 1024 px with no lower peak memory
    (benchmarks/NOTES.md). The compiled op (varlen_attn.compiled) re-gathers, as its saved
    tensors must have shapes known at trace time."""

    @staticmethod
    def forward(ctx, q, k, v, plan, impl, scale, causal):
        inp = VarlenInputs(gather(q, plan, "q"), gather(k, plan, "k"), gather(v, plan, "k"), plan, scale, causal)
        out, lse = impl.forward_lse(inp)
        ctx.save_for_backward(inp.q, inp.k, inp.v, out, lse)
        ctx.plan, ctx.impl, ctx.scale, ctx.causal = plan, impl, scale, causal
        return scatter(out, plan, "q")

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        qp, kp, vp, out, lse = ctx.saved_tensors
        plan = ctx.plan
        inp = VarlenInputs(qp, kp, vp, plan, ctx.scale, ctx.causal)
        dq, dk, dv = ctx.impl.backward(inp, out, lse, gather(dout, plan, "q"))
        return scatter(dq, plan, "q"), scatter(dk, plan, "k"), scatter(dv, plan, "k"), None, None, None, None
