"""``torch``: PyTorch's own ``torch.nn.attention.varlen.varlen_attn`` (built-in FA2 kernels).

No install. torch 2.10/2.11 take ``is_causal=``, 2.13 ``window_size=(-1, 0)`` and ``enable_gqa=``
(read from the signature). The backend calls the aten ops behind it directly (``NATIVE_BACKWARD``,
as FA4); the public function is the fallback where those ops are missing.
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
    """The aten ops behind ``varlen_attn`` (``_flash_attention_forward`` and ``_backward``, the
    kernels its ``torch_attn::_varlen_attn`` custom ops call), or None where this torch lacks the
    public API or the ops take no ``scale``. Not through the Python custom ops: tens of
    microseconds of host time per call (benchmarks/NOTES.md, entry 19)."""
    try:
        importlib.import_module("torch.nn.attention.varlen")
        fwd = torch.ops.aten._flash_attention_forward.default
        bwd = torch.ops.aten._flash_attention_backward.default
    except (ImportError, AttributeError, RuntimeError):
        return None
    names = [frozenset(a.name for a in op._schema.arguments) for op in (fwd, bwd)]
    if not all("scale" in n for n in names):
        return None
    return fwd, bwd


# device -> (rng_state, unused): the backward's dropout arguments, read only with dropout (which
# this backend does not run); one pair per device instead of two allocations per call.
_no_dropout: dict = {}


def _dropout_args(device: torch.device):
    args = _no_dropout.get(device)
    if args is None:
        args = (torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(0, device=device))
        # Kept only when made on the default stream outside a capture: made in a CUDA graph trees'
        # warm-up it stopped them ("Detected 1 tensor(s) in the cudagraph pool not tracked as
        # outputs", H200, torch 2.11; benchmarks/NOTES.md entry 27).
        if device.type != "cuda" or (not torch.cuda.is_current_stream_capturing()
                                     and torch.cuda.current_stream(device) == torch.cuda.default_stream(device)):
            _no_dropout[device] = args
    return args


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
        """The kernel's own forward and backward are reachable: one autograd node per layer,
        and no recomputed forward in the compiled backward."""
        return _entry_points() is not None

    # The aten forward is an op dynamo traces and autograd differentiates (into the aten
    # backward): reachable exactly when NATIVE_BACKWARD's entry points are.
    TRACEABLE = NATIVE_BACKWARD

    def traced_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale):
        # The op named directly (dynamo traces an op, not _entry_points' import); TRACEABLE said it exists.
        return torch.ops.aten._flash_attention_forward.default(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, False, False, scale=scale)[0]

    def forward_lse(self, inp: VarlenInputs):
        fwd, _ = _entry_points()
        p = inp.plan
        # Grouped-query attention needs no flag: the kernel takes fewer key heads as they are.
        out, lse = fwd(*_contiguous(inp.q, inp.k, inp.v), p.cu_seqlens_q, p.cu_seqlens_k, p.max_seqlen_q,
                       p.max_seqlen_k, 0.0, inp.causal, False, scale=inp.scale)[:2]
        return out, lse

    def backward(self, inp: VarlenInputs, out, lse, dout):
        _, bwd = _entry_points()
        p = inp.plan
        return tuple(bwd(*_contiguous(dout, inp.q, inp.k, inp.v, out), lse, p.cu_seqlens_q, p.cu_seqlens_k,
                         p.max_seqlen_q, p.max_seqlen_k, 0.0, inp.causal, *_dropout_args(inp.q.device),
                         scale=inp.scale))

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
