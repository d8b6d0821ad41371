"""``torch``: PyTorch's own ``torch.nn.attention.varlen.varlen_attn`` (built-in FA2 kernels).

No install. Its signature changed: torch 2.10/2.11 take ``is_causal=``; 2.13 takes
``window_size=(-1, 0)`` for causal and ``enable_gqa=``. Both are read from the signature.
Where the ops behind it take a ``scale`` (torch >= 2.11), the backend calls their forward and
backward directly (``NATIVE_BACKWARD``, as FA4): pack, kernel and unpack in one autograd node.
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


@lru_cache(maxsize=1)
def _entry_points():
    """The forward and backward ops behind ``varlen_attn`` (``torch_attn::_varlen_attn`` and
    ``_varlen_attn_backward``) with their argument names, or None where this torch lacks them or
    they take no ``scale`` (torch 2.10's). Their later arguments changed between releases, so
    they are passed by name, from the schema."""
    try:
        importlib.import_module("torch.nn.attention.varlen")
        fwd = torch.ops.torch_attn._varlen_attn.default
        bwd = torch.ops.torch_attn._varlen_attn_backward.default
    except (ImportError, AttributeError, RuntimeError):
        return None
    names = [frozenset(a.name for a in op._schema.arguments) for op in (fwd, bwd)]
    if not all("scale" in n and "is_causal" in n for n in names):
        return None
    return fwd, bwd, names[0]


class TorchVarlenBackend(Backend):
    NAME = "torch"
    REQUIRES = ("torch.nn.attention.varlen",)
    SUPPORTED_DEVICES = frozenset({"cuda"})
    SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16})
    MIN_COMPUTE_CAPABILITY = (8, 0)
    MAX_HEAD_DIM = 256
    SUPPORTS_DROPOUT = False
    SUPPORTS_DIFFERENT_V_DIM = False
    STATIC_PLANS = True

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

    @property
    def NATIVE_BACKWARD(self) -> bool:  # noqa: N802 - the capability's name in every backend
        """The kernel's own forward and backward are reachable (torch >= 2.11): one autograd
        node per layer, and no recomputed forward in the compiled backward."""
        return _entry_points() is not None

    def forward_lse(self, inp: VarlenInputs):
        fwd, _, names = _entry_points()
        p = inp.plan
        kw = {"enable_gqa": True} if inp.q.shape[1] != inp.k.shape[1] and "enable_gqa" in names else {}
        out, lse, _ = fwd(*_contiguous(inp.q, inp.k, inp.v), p.cu_seqlens_q, p.cu_seqlens_k, p.max_seqlen_q,
                          p.max_seqlen_k, is_causal=inp.causal, scale=inp.scale, **kw)
        return out, lse

    def backward(self, inp: VarlenInputs, out, lse, dout):
        _, bwd, _ = _entry_points()
        p = inp.plan
        # The random-number state only matters with dropout, which this backend does not run.
        rng = torch.empty((2,), dtype=torch.uint64, device=inp.q.device)
        return tuple(bwd(*_contiguous(dout, inp.q, inp.k, inp.v, out), lse, p.cu_seqlens_q, p.cu_seqlens_k,
                         p.max_seqlen_q, p.max_seqlen_k, inp.causal, rng, scale=inp.scale))

    def forward(self, inp: VarlenInputs) -> torch.Tensor:
        fn, params = _api()
        p = inp.plan
        kw = {"scale": inp.scale}
        if inp.causal:
            kw.update({"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)})
        if inp.q.shape[1] != inp.k.shape[1]:
            kw["enable_gqa"] = True
        q, k, v = _contiguous(inp.q, inp.k, inp.v)
        return fn(q, k, v, p.cu_seqlens_q, p.cu_seqlens_k, p.max_seqlen_q, p.max_seqlen_k, **kw)


def _contiguous(*tensors):
    return tuple(t if t.is_contiguous() else t.contiguous() for t in tensors)
