"""``reference``: the pure-PyTorch oracle in :mod:`varlen_attn_ref`, used as the CPU backend.

Readable, float32 (float64 for float64 inputs) accumulation, loops over segments on the host.
Imported lazily so that fast paths never load it.
"""

from __future__ import annotations

import torch

from ._base import Backend, VarlenInputs


class ReferenceBackend(Backend):
    NAME = "reference"
    REQUIRES = ("varlen_attn_ref",)
    # Static plans on the CPU only: their lengths are read from cu_seqlens on the host.
    STATIC_PLANS = True
    STATIC_PLANS_DEVICES = frozenset({"cpu"})

    # The dense form of the oracle (varlen_attn_ref.varlen_attention_dense) traces: how the CPU
    # tests run the in-graph route. Quadratic in the rows, never picked by auto for it.
    TRACEABLE = True

    def traced_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale):
        import varlen_attn_ref

        return varlen_attn_ref.varlen_attention_dense(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)

    def forward(self, inp: VarlenInputs) -> torch.Tensor:
        import varlen_attn_ref

        p = inp.plan
        q, k, v = inp.q, inp.k, inp.v
        if p.static:  # the oracle takes exactly the valid rows; the padding rows come back as zeros
            total_q, total_k = int(p.cu_seqlens_q[-1]), int(p.cu_seqlens_k[-1])
            q, k, v = q[:total_q], k[:total_k], v[:total_k]
        out = varlen_attn_ref.flash_attn_varlen_func(
            q, k, v, p.cu_seqlens_q, p.cu_seqlens_k, p.max_seqlen_q, p.max_seqlen_k,
            dropout_p=inp.dropout_p, softmax_scale=inp.scale, causal=inp.causal,
        )
        if p.static:
            out = torch.cat([out, out.new_zeros((inp.q.shape[0] - out.shape[0],) + tuple(out.shape[1:]))])
        return out
