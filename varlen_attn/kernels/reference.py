"""``reference``: the pure-PyTorch oracle in :mod:`kernels_ref`, used as the CPU backend.

Readable, float32 (float64 for float64 inputs) accumulation, loops over segments on the host.
Imported lazily so that fast paths never load it.
"""

from __future__ import annotations

import torch

from ._base import Backend, VarlenInputs


class ReferenceBackend(Backend):
    NAME = "reference"
    REQUIRES = ("kernels_ref",)

    def forward(self, inp: VarlenInputs) -> torch.Tensor:
        import kernels_ref

        p = inp.plan
        return kernels_ref.flash_attn_varlen_func(
            inp.q, inp.k, inp.v, p.cu_seqlens_q, p.cu_seqlens_k, p.max_seqlen_q, p.max_seqlen_k,
            dropout_p=inp.dropout_p, softmax_scale=inp.scale, causal=inp.causal,
        )
