"""flash-attention varlen kernels: FA2 (``flash_attn``), FA3 (``flash_attn_interface``) and
FA4 (``flash-attn-4``, imported as ``flash_attn.cute``). Each module is imported at the first
call, never at ``import varlen_attn``: none is a required dependency.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from ._base import Backend, VarlenInputs

_HALF = frozenset({torch.float16, torch.bfloat16})


class _FlashBackend(Backend):
    MODULE = ""
    SUPPORTED_DEVICES = frozenset({"cuda"})
    SUPPORTED_DTYPES = _HALF
    MAX_HEAD_DIM = 256
    SUPPORTS_DIFFERENT_V_DIM = False
    REQUIRES_CONTIGUOUS_LAST_DIM = True
    STATIC_PLANS = True

    def _fn(self):
        return importlib.import_module(self.MODULE).flash_attn_varlen_func

    def is_installed(self) -> bool:
        try:  # find_spec on a submodule imports its parent; a broken parent means absent
            return importlib.util.find_spec(self.MODULE) is not None
        except (ImportError, ValueError):
            return False

    def forward(self, inp: VarlenInputs) -> torch.Tensor:
        # Only FA2 takes dropout; the others refuse it in not_supported_reasons.
        extra = {"dropout_p": inp.dropout_p} if self.SUPPORTS_DROPOUT else {}
        out = self._fn()(*_last_dim_contiguous(inp.q, inp.k, inp.v), **_varlen_kwargs(inp), **extra)
        # FA3 before 3.0 stable and FA4 return (out, lse).
        return out[0] if isinstance(out, tuple) else out


def _last_dim_contiguous(*ts):
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in ts)


def _varlen_kwargs(inp: VarlenInputs) -> dict:
    """Keywords, not positions: FA3/FA4 put seqused_q/k between cu_seqlens and max_seqlen."""
    p = inp.plan
    return dict(cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k, max_seqlen_q=p.max_seqlen_q,
                max_seqlen_k=p.max_seqlen_k, softmax_scale=inp.scale, causal=inp.causal)


class FlashAttn2Backend(_FlashBackend):
    NAME = "flash_attn"
    # Not plain "flash_attn": flash-attn-4 installs that package name too, without FA2's kernels.
    MODULE = "flash_attn.flash_attn_interface"
    REQUIRES = (MODULE,)
    MIN_COMPUTE_CAPABILITY = (8, 0)


class FlashAttn3Backend(_FlashBackend):
    NAME = "flash_attn_3"
    MODULE = "flash_attn_interface"
    REQUIRES = ("flash_attn_interface",)
    MIN_COMPUTE_CAPABILITY = (9, 0)
    SUPPORTS_DROPOUT = False


class FlashAttn4Backend(_FlashBackend):
    NAME = "flash_attn_4"
    MODULE = "flash_attn.cute"
    REQUIRES = ("flash_attn.cute",)
    MIN_COMPUTE_CAPABILITY = (9, 0)
    SUPPORTS_DROPOUT = False
    HEAD_DIM_MULTIPLE = 8
    # Measured on an H200 with flash-attn-4 4.0.0b36: at head dim 16 dq is wrong (relative
    # error ~1 against float64; out, dk, dv fine); 32 and up matched split_sdpa's error.
    MIN_HEAD_DIM = 32

    def not_supported_reasons(self, inp: VarlenInputs) -> list[str]:
        reasons = super().not_supported_reasons(inp)
        if inp.q.shape[-1] % self.HEAD_DIM_MULTIPLE:
            reasons.append(f"head dim {inp.q.shape[-1]} not a multiple of {self.HEAD_DIM_MULTIPLE}")
        if inp.q.shape[-1] < self.MIN_HEAD_DIM:
            reasons.append(f"head dim {inp.q.shape[-1]} < {self.MIN_HEAD_DIM} (wrong dq measured at 16)")
        # FA4 betas mishandled zero-length sequences; plans never hold one, but guard anyway.
        if 0 in inp.plan.seqlens_q or 0 in inp.plan.seqlens_k:
            reasons.append("zero-length segment in the plan")
        return reasons

    # FA4's own forward and backward entry points (what its autograd Function calls), so the
    # fused path (varlen_attn.fused) can run pack + kernel + unpack as one autograd node.
    NATIVE_BACKWARD = True

    def _interface(self):
        return importlib.import_module("flash_attn.cute.interface")

    def forward_lse(self, inp: VarlenInputs):
        res = self._interface()._flash_attn_fwd(*_last_dim_contiguous(inp.q, inp.k, inp.v),
                                                **_varlen_kwargs(inp), return_lse=True)
        return res[0], res[1]

    def backward(self, inp: VarlenInputs, out, lse, dout):
        return tuple(self._interface()._flash_attn_bwd(
            *_last_dim_contiguous(inp.q, inp.k, inp.v, out, dout), lse, **_varlen_kwargs(inp))[:3])
