"""``split_sdpa``: one dense ``F.scaled_dot_product_attention`` call per packed segment.

Needs nothing beyond torch. Each call is unmasked, so SDPA can take its fastest kernel
(cuDNN or flash on Hopper). Segment lengths come from the plan's host copies: no sync.
"""

from __future__ import annotations

import torch

from ._base import TORCH_SDPA, Backend, VarlenInputs, empty_output


class SplitSdpaBackend(Backend):
    NAME = "split_sdpa"
    # Static plans on the CPU only: their lengths are read from cu_seqlens on the host.
    STATIC_PLANS = True
    STATIC_PLANS_DEVICES = frozenset({"cpu"})

    def forward(self, inp: VarlenInputs) -> torch.Tensor:
        p = inp.plan
        gqa = inp.q.shape[1] != inp.k.shape[1]
        outs = []
        if p.static:  # the rows past cu_seqlens[-1] are padding: one more split each, not attended
            lens_q, lens_k = _lengths(p.cu_seqlens_q), _lengths(p.cu_seqlens_k)
        else:
            lens_q, lens_k = list(p.seqlens_q), list(p.seqlens_k)
        # torch.split, not one slice per segment: split's backward is one cat, while each
        # slice's backward zero-fills a full-size gradient (benchmarks/NOTES.md, change 1).
        rest_q, rest_k = inp.q.shape[0] - sum(lens_q), inp.k.shape[0] - sum(lens_k)
        qs = torch.split(inp.q, lens_q + [rest_q] if rest_q else lens_q)
        ks = torch.split(inp.k, lens_k + [rest_k] if rest_k else lens_k)
        vs = torch.split(inp.v, lens_k + [rest_k] if rest_k else lens_k)
        for q, k, v in zip(qs[:len(lens_q)], ks, vs):
            lq, lk = q.shape[0], k.shape[0]
            # [L, H, D] -> [1, H, L, D], SDPA's layout.
            q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
            if lk == 0:
                outs.append(q.new_zeros(lq, q.shape[1], v.shape[-1]))
                continue
            mask, is_causal = None, False
            if inp.causal and lq == lk:
                is_causal = True
            elif inp.causal:
                # flash-attn aligns causal masks bottom-right; SDPA's is_causal is top-left.
                # Rows left with no key come out as zeros (SDPA >= 2.5), as in flash-attn.
                mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
            o = TORCH_SDPA(
                q, k, v, attn_mask=mask, dropout_p=inp.dropout_p, is_causal=is_causal,
                scale=inp.scale, enable_gqa=gqa,
            )
            outs.append(o[0].transpose(0, 1))
        if rest_q:
            outs.append(inp.q.new_zeros(rest_q, inp.q.shape[1], inp.v.shape[-1]))
        if not outs:
            return empty_output(inp)
        return torch.cat(outs, dim=0)


def _lengths(cu: torch.Tensor) -> list[int]:
    return cu.diff().tolist()
