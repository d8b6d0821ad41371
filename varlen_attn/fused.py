"""Pack -> kernel -> unpack as one autograd node (for backends with their own backward).

The composed path (``pack_qkv`` -> backend forward under autograd -> ``unpack``) records three
autograd nodes. Here one node does it all, for a backend that exposes its kernel's forward and
backward (``Backend.NATIVE_BACKWARD``):

* forward: gather q, k, v (no autograd), ``forward_lse``, scatter the output;
* backward: gather the output gradient, the kernel's backward, scatter dq, dk, dv (gathers
  through the plan's inverse index, as in :mod:`varlen_attn.pack`).

The kernels and bytes moved are the composed path's; what goes is the Python and autograd
bookkeeping of two extra nodes per layer (host time, which dominates at small shapes):
-0.25 ms per fwd+bwd at Chroma 512 px on an H200 (benchmarks/NOTES.md, change 4).
"""

from __future__ import annotations

import torch

from .kernels import Backend, VarlenInputs
from .pack import gather_packed, scatter_packed
from .plan import VarlenPlan


def packed_forward(impl: Backend, q, k, v, plan: VarlenPlan, scale: float, causal: bool):
    """Padded ``[B, S, H, D]`` q, k, v -> ``(packed inputs, packed out, lse)``; no autograd. An
    ``INTO_ZEROS`` backend writes into zeros: rows it skips (dead elements, past the segments)
    are zeros, as SDPA gives them."""
    inp = VarlenInputs(gather_packed(q, plan, "q"), gather_packed(k, plan, "k"), gather_packed(v, plan, "k"),
                       plan, scale, causal)
    if impl.INTO_ZEROS:  # the lse too: the compiled op returns it, and an op's outputs must not hold stale memory
        out, lse = impl.forward_lse(inp, inp.q.new_zeros(inp.q.shape[:-1] + inp.v.shape[-1:]),
                                    inp.q.new_zeros((inp.q.shape[1], inp.q.shape[0]), dtype=torch.float32))
    else:
        out, lse = impl.forward_lse(inp)
    return inp, out, lse


def packed_backward(impl: Backend, inp: VarlenInputs, out, lse, dout):
    """Packed inputs and output, padded output gradient -> padded ``(dq, dk, dv)``; no autograd."""
    plan, zeros = inp.plan, impl.INTO_ZEROS
    dout = gather_packed(dout, plan, "q")
    if zeros:
        dq, dk, dv = impl.backward(inp, out, lse, dout, tuple(t.new_zeros(t.shape) for t in (inp.q, inp.k, inp.v)))
    else:
        dq, dk, dv = impl.backward(inp, out, lse, dout)
    # Each name rebound to its padded gradient lets the packed one go: the padded dk is made
    # without the packed dq alive, and dv without dq or dk (one packed gradient less per scatter).
    dq = scatter_packed(dq, plan, "q", zeros)
    dk = scatter_packed(dk, plan, "k", zeros)
    dv = scatter_packed(dv, plan, "k", zeros)
    return dq, dk, dv


class FusedAttention(torch.autograd.Function):
    """Padded q, k, v -> padded output, one autograd node. First-order gradients only.

    Saves the packed q, k, v, output and lse (as the composed path does): re-gathering them in
    backward instead measured 0.13 ms slower at Chroma 1024 px with no lower peak memory
    (benchmarks/NOTES.md). The compiled op (varlen_attn.op) re-gathers, as its saved
    tensors must have shapes known at trace time."""

    @staticmethod
    def forward(ctx, q, k, v, plan, impl, scale, causal):
        inp, out, lse = packed_forward(impl, q, k, v, plan, scale, causal)
        ctx.save_for_backward(inp.q, inp.k, inp.v, out, lse)
        ctx.plan, ctx.impl, ctx.scale, ctx.causal = plan, impl, scale, causal
        return scatter_packed(out, plan, "q", impl.INTO_ZEROS)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        qp, kp, vp, out, lse = ctx.saved_tensors
        inp = VarlenInputs(qp, kp, vp, ctx.plan, ctx.scale, ctx.causal)
        return (*packed_backward(ctx.impl, inp, out, lse, dout), None, None, None, None)
