"""Attention under ``torch.compile``: one custom op, opaque to dynamo and inductor.

Under compilation the functional entries and ``enable_varlen``'s SDPA hook call
``torch.ops.varlen_attn.attention`` instead of the eager path. Everything data-dependent
happens inside the op, at run time, where the eager machinery runs unchanged: the plan (from a
prebuilt plan's handle, the current ``enable_varlen`` forward, or the mask-object cache),
packing, the kernel, the fallback to masked SDPA. The graph sees only padded tensors in,
padded tensors out, with fixed shapes, so:

* no graph break: the op has a fake implementation (shapes only);
* no recompilation when the mask changes: the plan reaches the op as a CPU ``int64`` handle
  tensor (a tensor input, never specialized on its value), and no length, total or
  packability is read while tracing.

Autograd: ``varlen_attn::attention_backward``. A backend with its own backward
(``NATIVE_BACKWARD``, FA4) runs it on re-packed tensors (the log-sum-exp travels in a
fixed-size ``[Hq, B*Sq]`` buffer); other backends and the SDPA fallback recompute the forward
under autograd inside the backward op (one extra forward). Dropout is refused under
compilation (a recomputed forward would draw a different mask).
"""

import itertools
import threading
import weakref
from typing import Optional

import torch
from torch import Tensor

from . import _stats, fused
from ._errors import InputValueError
from .kernels import VarlenInputs, requested_backend
from .masks import canonical_mask
from .pack import gather_packed, scatter_packed
from .plan import VarlenPlan, build_plan, full_plan, plan_by_handle

_ids = itertools.count(1)
_live: dict[int, VarlenPlan] = {}  # op-output handle -> plan, while the handle tensor lives
_lock = threading.Lock()


def _hold(plan: VarlenPlan) -> Tensor:
    """A fresh CPU handle keeping ``plan`` alive for as long as the tensor lives (it is saved
    for backward, so the backward finds the forward's plan whatever the caller dropped)."""
    ident = next(_ids)
    t = torch.tensor([ident], dtype=torch.int64)
    with _lock:
        _live[ident] = plan
    weakref.finalize(t, _release, ident)
    return t


def _release(ident: int) -> None:
    with _lock:
        _live.pop(ident, None)


def _held(handle: Tensor) -> VarlenPlan:
    with _lock:
        return _live[int(handle.item())]


def _resolve(q, k, mask, handle, convention, float_mask) -> "VarlenPlan":
    """The plan for this call, at run time."""
    b, sq, h, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[1]
    if handle is not None:
        plan = plan_by_handle(int(handle.item()))
        if plan is None:
            raise InputValueError("the plan passed to attention was freed before the compiled call ran")
        return plan
    if mask is None:
        return full_plan(b, sq, sk, q.device)
    from .integration import current_context  # import here: integration imports functional

    ctx = current_context()
    if ctx is not None and convention == "torch":
        return ctx.plan_for(mask, b, h, sq, sk)
    return build_plan(mask, batch_size=b, seqlen_q=sq, seqlen_k=sk, num_heads=h, convention=convention,
                      float01_as_bool=float_mask != "bias")


def _mask4(q, k, mask, convention):
    if mask is None:
        return None
    return canonical_mask(mask, batch_size=q.shape[0], num_heads=q.shape[2], seqlen_q=q.shape[1],
                          seqlen_k=k.shape[1], convention=convention)


def _route(q, k, v, plan, mask4, scale, causal, gqa, backend, strict):
    from . import functional

    return functional._route(q, k, v, plan, mask4, dropout_p=0.0, causal=causal, scale=scale, gqa=gqa,
                             backend=requested_backend(backend or None), strict=strict)


@torch.library.custom_op("varlen_attn::attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], handle: Optional[Tensor],
                 scale: Optional[float], causal: bool, gqa: bool, backend: str, strict: bool,
                 convention: str, float_mask: str) -> tuple[Tensor, Tensor, Tensor]:
    """Padded ``[B, S, H, D]`` q, k, v -> ``(out [B, Sq, Hq, Dv], lse [Hq, B*Sq] float32,
    plan handle)``; lse is filled (its first ``total_q`` columns) only for backends with their
    own backward, and read only by them."""
    from . import functional

    with torch._C.DisableTorchFunction():  # enable_varlen's mode must not see our own calls
        plan = _resolve(q, k, mask, handle, convention, float_mask)
        mask4 = _mask4(q, k, mask, convention)
        route = _route(q, k, v, plan, mask4, scale, causal, gqa, backend, strict)
        impl, _, probe = route
        lse_buf = q.new_empty((q.shape[2], q.shape[0] * q.shape[1]), dtype=torch.float32)
        if impl is not None and functional._fusable(impl, plan, 0.0):
            _stats.record_backend(impl.NAME)
            _, out, lse = fused.packed_forward(impl, q, k, v, plan, probe.scale, causal)
            out = scatter_packed(out, plan, "q")
            lse_buf[:, : plan.total_q] = lse
        else:
            with torch.no_grad():
                out = functional._execute(q, k, v, plan, mask4, route, dropout_p=0.0, causal=causal,
                                          scale=scale, gqa=gqa)
        return out.contiguous(), lse_buf, _hold(plan)


@attention_op.register_fake
def _(q, k, v, mask, handle, scale, causal, gqa, backend, strict, convention, float_mask):
    b, sq, hq = q.shape[0], q.shape[1], q.shape[2]
    return (q.new_empty((b, sq, hq, v.shape[-1])), q.new_empty((hq, b * sq), dtype=torch.float32),
            torch.empty(1, dtype=torch.int64))


@torch.library.custom_op("varlen_attn::attention_backward", mutates_args=())
def attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          mask: Optional[Tensor], handle: Tensor, scale: Optional[float], causal: bool,
                          gqa: bool, backend: str, strict: bool, convention: str,
                          float_mask: str) -> tuple[Tensor, Tensor, Tensor]:
    from . import functional

    with torch._C.DisableTorchFunction():
        plan = _held(handle)
        mask4 = _mask4(q, k, mask, convention)
        route = _route(q, k, v, plan, mask4, scale, causal, gqa, backend, strict)
        impl, _, probe = route
        if impl is not None and functional._fusable(impl, plan, 0.0):
            packed = [gather_packed(t, plan, w) for t, w in ((q, "q"), (k, "k"), (v, "k"), (out, "q"))]
            inp = VarlenInputs(*packed[:3], plan, probe.scale, causal)
            return fused.packed_backward(impl, inp, packed[3], lse[:, : plan.total_q].contiguous(), dout)
        # Recompute the forward under autograd (backends without a backward entry point, SDPA).
        qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
        with _autograd_dispatch(), torch.enable_grad(), _stats.quiet():
            o = functional._execute(qd, kd, vd, plan, mask4, route, dropout_p=0.0, causal=causal, scale=scale,
                                    gqa=gqa)
            grads = torch.autograd.grad(o, (qd, kd, vd), dout, allow_unused=True)
        return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v)))


@attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, mask, handle, scale, causal, gqa, backend, strict, convention, float_mask):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_AUTOGRAD_KEYS = tuple(k for name, k in torch._C.DispatchKey.__members__.items()
                      if "Autograd" in name or name == "ADInplaceOrView")


def _autograd_dispatch():
    """Re-admit the autograd dispatch keys that a custom op's implementation runs without, so
    the recomputed forward records a graph to differentiate."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def _setup_context(ctx, inputs, output):
    q, k, v, mask, _handle, *opts = inputs
    out, lse, held = output
    ctx.save_for_backward(q, k, v, out, lse, mask, held)
    ctx.opts = opts


def _backward(ctx, dout, _dlse, _dhandle):
    q, k, v, out, lse, mask, held = ctx.saved_tensors
    dq, dk, dv = attention_backward_op(dout.contiguous(), q, k, v, out, lse, mask, held, *ctx.opts)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


def compiled_attend(q, k, v, attn_mask, *, plan, convention, dropout_p, causal, scale, gqa, backend,
                    strict, float_mask="bias") -> Tensor:
    """The traced path: ``[B, S, H, D]`` tensors to the op. Reads nothing data-dependent."""
    if dropout_p:
        raise InputValueError(
            f"dropout_p must be 0 under torch.compile (a recomputed backward would draw a "
            f"different dropout mask), got {dropout_p}"
        )
    handle = None if plan is None else plan.handle
    out, _, _ = attention_op(q, k, v, attn_mask, handle, None if scale is None else float(scale),
                             bool(causal), bool(gqa), backend or "", bool(strict), convention, float_mask)
    return out
