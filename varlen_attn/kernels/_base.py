"""What every varlen backend declares and answers (xformers fmha's idea: capabilities as data).

A backend computes attention on packed tensors ``q [total_q, Hq, D]``, ``k [total_k, Hkv, D]``,
``v [total_k, Hkv, Dv]`` segment by segment as laid out by a :class:`~varlen_attn.plan.VarlenPlan`,
and returns ``[total_q, Hq, Dv]`` in ``q.dtype``. Causal masking is bottom-right aligned within
each segment (flash-attn's convention; the same as top-left when a segment's query and key
lengths are equal).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from ..plan import VarlenPlan

# torch's own SDPA, for every call varlen_attn makes itself: enable_varlen replaces the attribute
# ``torch.nn.functional.scaled_dot_product_attention`` (varlen_attn.hook), not this function.
TORCH_SDPA = torch._C._nn.scaled_dot_product_attention


@dataclass(frozen=True)
class VarlenInputs:
    """One varlen call: packed tensors, the plan, and the options."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    plan: VarlenPlan
    scale: float
    causal: bool = False
    dropout_p: float = 0.0

    def describe(self) -> str:
        p = self.plan
        return (
            f"q ({p.total_q}, {self.q.shape[-2]}, {self.q.shape[-1]}) {self.q.dtype}, "
            f"k ({p.total_k}, {self.k.shape[-2]}, {self.k.shape[-1]}), "
            f"v ({p.total_k}, {self.v.shape[-2]}, {self.v.shape[-1]}), device {self.q.device}, causal={self.causal}, "
            f"dropout_p={self.dropout_p}, segments={self.plan.num_segments}, "
            f"max_seqlen_q={self.plan.max_seqlen_q}, max_seqlen_k={self.plan.max_seqlen_k}"
        )


# How many times a kernel library refused a call its backend had declared it could run
# (KernelRefusedError): selections cached before the last refusal are made again.
_refusals = [0]


def bump_refusals() -> None:
    _refusals[0] += 1


def refusals() -> int:
    return _refusals[0]


def empty_output(inp: VarlenInputs) -> torch.Tensor:
    """``[0, Hq, Dv]`` output still connected to q, k and v, so their gradients are zeros (as
    SDPA's are for a batch whose every row is masked) rather than missing."""
    tie = inp.q[:0].sum() + inp.k[:0].sum() + inp.v[:0].sum()
    return inp.q.new_zeros(0, inp.q.shape[1], inp.v.shape[-1]) + tie


class Backend:
    """Base class. Subclasses set the capability attributes and implement :meth:`forward`."""

    NAME: str = ""
    REQUIRES: tuple[str, ...] = ()  # importable module names the backend needs
    SUPPORTED_DEVICES: frozenset[str] = frozenset({"cpu", "cuda"})
    SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset(
        {torch.float16, torch.bfloat16, torch.float32, torch.float64}
    )
    MIN_COMPUTE_CAPABILITY: tuple[int, int] | None = None
    MAX_HEAD_DIM: int | None = None
    SUPPORTS_GQA: bool = True
    SUPPORTS_CAUSAL: bool = True
    SUPPORTS_DROPOUT: bool = True
    SUPPORTS_DIFFERENT_V_DIM: bool = True
    # True when the kernel reads segment lengths from ``cu_seqlens`` on the device only and never
    # reads packed rows past ``cu_seqlens[-1]``: it can run a static plan (VarlenPlan.static).
    STATIC_PLANS: bool = False
    # Where static plans run, where not on every device (None): a backend that reads their lengths
    # on the host can, on the CPU only (there a read is no sync; on a GPU it would be one a call).
    STATIC_PLANS_DEVICES: frozenset[str] | None = None
    # True when forward_lse/backward call the kernel's own forward and backward entry points
    # (then pack + kernel + unpack run as one autograd node, varlen_attn.fused).
    NATIVE_BACKWARD: bool = False
    # True when forward_lse and backward write into the zeros they are handed (``out``, ``lse``,
    # ``grads``), leaving rows past ``cu_seqlens[-1]`` and dead elements' queries as they were: the
    # fused path then unpacks by gathers alone (Qwen-Image 1024 px, H200: 4.75 -> 4.18 ms, kernel
    # alone 3.82; benchmarks/NOTES.md entry 53).
    INTO_ZEROS: bool = False
    # True when traced_forward can be traced by torch.compile and differentiated by autograd
    # (the whole call then runs inside the graph: varlen_attn.op, "In the graph").
    TRACEABLE: bool = False

    def runs_static(self, device_type: str) -> bool:
        """The backend can run a static plan (:attr:`VarlenPlan.static`) on this device type."""
        return self.STATIC_PLANS and (self.STATIC_PLANS_DEVICES is None or device_type in self.STATIC_PLANS_DEVICES)

    def is_installed(self) -> bool:
        return all(importlib.util.find_spec(m) is not None for m in self.REQUIRES)

    def installed(self) -> bool:
        """``is_installed()``, asked once per process (selection runs in every call)."""
        cached = self.__dict__.get("_installed")
        if cached is None:
            cached = self.__dict__["_installed"] = bool(self.is_installed())
        return cached

    def not_supported_reasons(self, inp: VarlenInputs) -> list[str]:
        reasons = []
        if not self.installed():
            reasons.append(f"not installed (needs {', '.join(self.REQUIRES)})")
        dev = inp.q.device
        if dev.type not in self.SUPPORTED_DEVICES:
            reasons.append(f"device {dev.type} not in {sorted(self.SUPPORTED_DEVICES)}")
        elif dev.type == "cuda" and self.MIN_COMPUTE_CAPABILITY is not None:
            cc = torch.cuda.get_device_capability(dev)
            if cc < self.MIN_COMPUTE_CAPABILITY:
                reasons.append(f"compute capability {cc} < {self.MIN_COMPUTE_CAPABILITY}")
        if inp.q.dtype not in self.SUPPORTED_DTYPES:
            names = sorted(str(d) for d in self.SUPPORTED_DTYPES)
            reasons.append(f"dtype {inp.q.dtype} not in {names}")
        d = max(inp.q.shape[-1], inp.v.shape[-1])
        if self.MAX_HEAD_DIM is not None and d > self.MAX_HEAD_DIM:
            reasons.append(f"head dim {d} > {self.MAX_HEAD_DIM}")
        if not self.SUPPORTS_GQA and inp.q.shape[1] != inp.k.shape[1]:
            reasons.append("grouped-query attention (Hq != Hkv) not supported")
        if not self.SUPPORTS_CAUSAL and inp.causal:
            reasons.append("causal not supported")
        if not self.SUPPORTS_DROPOUT and inp.dropout_p > 0:
            reasons.append("dropout not supported")
        if not self.SUPPORTS_DIFFERENT_V_DIM and inp.q.shape[-1] != inp.v.shape[-1]:
            reasons.append("value head dim different from query head dim not supported")
        if inp.plan.static and not self.STATIC_PLANS:
            reasons.append("needs segment lengths on the host (a plan for CUDA graphs has them on the device only)")
        elif inp.plan.static and not self.runs_static(dev.type):
            reasons.append(f"reads a static plan's lengths on the host ({', '.join(sorted(self.STATIC_PLANS_DEVICES))} only)")
        return reasons

    def forward(self, inp: VarlenInputs) -> torch.Tensor:
        """Packed attention with autograd through the kernel."""
        raise NotImplementedError

    def forward_lse(self, inp: VarlenInputs, out: torch.Tensor | None = None,
                    lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse [Hq, total_q] float32)`` without autograd: the kernel's own forward.
        Only for ``NATIVE_BACKWARD`` backends (varlen_attn.fused); ``out``, ``lse``: zeros to
        write into, only for ``INTO_ZEROS`` backends."""
        raise NotImplementedError(f"backend {self.NAME!r} has no forward/backward entry points")

    def backward(self, inp: VarlenInputs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                 grads: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` on packed tensors: the kernel's own backward. Only for
        ``NATIVE_BACKWARD`` backends (others: autograd through :meth:`forward`). ``grads``: zeros
        to write into, only for ``INTO_ZEROS`` backends."""
        raise NotImplementedError(f"backend {self.NAME!r} has no forward/backward entry points")

    def traced_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                       scale: float) -> torch.Tensor:
        """Packed attention on rows in the static layout (one segment per batch element, then
        rows past ``cu_seqlens[-1]`` that no segment reads; their output and gradients may hold
        anything), with autograd, in ops ``torch.compile`` traces. Only for ``TRACEABLE``
        backends."""
        raise NotImplementedError(f"backend {self.NAME!r} cannot be traced")

    def __repr__(self) -> str:
        return f"<varlen backend {self.NAME!r}>"
