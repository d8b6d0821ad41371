"""``torch``: PyTorch's own ``torch.nn.attention.varlen.varlen_attn`` (built-in FA2 kernels).

No install. Its signature changed: torch 2.10/2.11 take ``is_causal=``; 2.13 takes
``window_size=(-1, 0)`` for causal and ``enable_gqa=``. Both are read from the signature.
"""

from __future__ import annotations

import importlib
import inspect
from functools import lru_cache

import torch

from ._base import Backend, VarlenInputs


@lru_cache(maxsize=1)
def _api():
    fn = importlib.import_module("torch.nn.attention.varlen").varlen_attn
    return fn, frozenset(inspect.signature(fn).parameters)


class TorchVarlenBackend(Backend):
    NAME = "torch"
    REQUIRES = ("torch.nn.attention.varlen",)
    SUPPORTED_DEVICES = frozenset({"cuda"})
    SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16})
    MIN_COMPUTE_CAPABILITY = (8, 0)
    MAX_HEAD_DIM = 256
    SUPPORTS_DROPOUT = False
    SUPPORTS_DIFFERENT_V_DIM = False

    def is_installed(self) -> bool:
        try:
            _api()
            return True
        except (ImportError, AttributeError):
            return False

    def not_supported_reasons(self, inp: VarlenInputs) -> list[str]:
        reasons = super().not_supported_reasons(inp)
        if not inp.scale > 0:  # also NaN
            reasons.append(f"scale {inp.scale} is not > 0 (torch >= 2.15's varlen_attn refuses it; SDPA does not)")
        if self.installed():
            params = _api()[1]
            if inp.q.shape[1] != inp.k.shape[1] and "enable_gqa" not in params:
                reasons.append(f"grouped-query attention needs torch >= 2.13 (have {torch.__version__})")
            if inp.causal and not ({"is_causal", "window_size"} & params):
                reasons.append("this torch's varlen_attn has no causal option")
        return reasons

    def forward(self, inp: VarlenInputs) -> torch.Tensor:
        fn, params = _api()
        p = inp.plan
        kw = {"scale": inp.scale}
        if inp.causal:
            kw.update({"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)})
        if inp.q.shape[1] != inp.k.shape[1]:
            kw["enable_gqa"] = True
        q, k, v = (t if t.is_contiguous() else t.contiguous() for t in (inp.q, inp.k, inp.v))
        return fn(q, k, v, p.cu_seqlens_q, p.cu_seqlens_k, p.max_seqlen_q, p.max_seqlen_k, **kw)
