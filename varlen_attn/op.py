"""Attention under ``torch.compile``: one custom op, opaque to dynamo and inductor.

Under compilation the functional entries (and through them ``enable_varlen``'s SDPA hook) call
:func:`attention`, which calls ``torch.ops.varlen_attn.attention``. Everything data-dependent
happens inside the op, at run time, through the same code as the eager path: the plan
(:func:`varlen_attn.scope.resolve_plan`, or a prebuilt plan named by its ``token``), the route
and its execution (:mod:`varlen_attn.execution`). The graph sees only padded tensors in and
out, with fixed shapes, so:

* no graph break: the op has a fake implementation (shapes only);
* no recompilation when the mask changes: a prebuilt plan reaches the op as its CPU ``token``
  tensor (a tensor input, never specialized on), and no length, total or packability is read
  while tracing; the whole policy (:class:`~varlen_attn.scope.Policy`) travels as constant
  arguments.

Autograd: ``varlen_attn::attention_backward``. The forward's plan and route are kept in this
module's registry under a handle the op returns (saved for backward), so the backward neither
re-plans nor re-routes. A route with a native backward (FA4) runs it on re-gathered tensors (the
log-sum-exp travels in a fixed-size ``[Hq, B*Sq]`` buffer: packed shapes are unknown at trace
time); other routes recompute the forward under autograd inside the backward op (one extra
forward). Dropout is refused under compilation (a recomputed forward would draw another mask).
"""

from __future__ import annotations

import itertools
import sys
import threading
import weakref
from typing import Optional

import torch
from torch import Tensor

from . import _stats, execution
from ._errors import BackendUnavailableError, InputValueError
from .execution import Options
from .plan import VarlenPlan, plan_of_token
from .scope import Policy, current_scope, resolve_plan, traced_signature

# torch.compile is supported from this torch on: the whole compile suite passes on 2.10, 2.13
# and 2.15; on 2.6 and 2.8 whole-model compile recompiled for every new mask, on 2.5 regional
# compile failed. Below it, compiling refuses clearly instead of running something else.
COMPILE_MIN_TORCH = "2.10"
COMPILE_SUPPORTED = torch.torch_version.TorchVersion(torch.__version__) >= COMPILE_MIN_TORCH


def refuse_unsupported_compile() -> None:
    """Raise when traced by a torch older than :data:`COMPILE_MIN_TORCH` (called while tracing)."""
    if not COMPILE_SUPPORTED:
        _refuse_compile()


def _compiler_disabled(fn, reason: str):
    try:
        return torch.compiler.disable(fn, reason=reason)
    except TypeError:  # torch < 2.8: no reason argument
        return torch.compiler.disable(fn)


def _raise_compile_unsupported() -> None:
    raise BackendUnavailableError(
        f"torch.compile of varlen_attn needs torch >= {COMPILE_MIN_TORCH}, got torch "
        f"{torch.__version__}: run it eagerly (no torch.compile around it) or upgrade torch"
    )


# Run outside the trace, so the error reaches the caller as it is: a raise inside the trace would
# make dynamo fall back to eager there and run on. With fullgraph=True dynamo reports the reason.
_refuse_compile = _compiler_disabled(_raise_compile_unsupported,
                                     f"varlen_attn refuses torch.compile below torch {COMPILE_MIN_TORCH}")


# The one registry: op-output handle -> (plan, route, mask4, options) of a forward, while the
# handle tensor (saved for backward) lives.
_ids = itertools.count(1)
_calls: dict[int, tuple] = {}
_lock = threading.Lock()


def _hold(entry: tuple) -> Tensor:
    ident = next(_ids)
    t = torch.tensor([ident], dtype=torch.int64)
    with _lock:
        _calls[ident] = entry
    weakref.finalize(t, _release, ident)
    return t


def _release(ident: int) -> None:
    with _lock:
        _calls.pop(ident, None)


def _held(handle: Tensor) -> tuple:
    with _lock:
        return _calls[int(handle.item())]


# Both ops read the plan on the host at run time (and may build it): a CUDA graph replaying them
# would replay the last batch's plan. Tagged, inductor's CUDA graphs (mode="reduce-overhead")
# capture the rest of the graph around them (graph partitions) instead.
_NOT_CAPTURABLE = (torch._C.Tag.cudagraph_unsafe,) if hasattr(torch._C.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("varlen_attn::attention", mutates_args=(), tags=_NOT_CAPTURABLE)
def attention_op(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], token: Optional[Tensor],
                 roots: list[Tensor], derivation: str, scale: Optional[float], causal: bool, gqa: bool,
                 backend: str, strict: bool, convention: str, float_mask: str,
                 model: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Padded ``[B, S, H, D]`` q, k, v -> ``(out [B, Sq, Hq, Dv], lse [Hq, B*Sq] float32,
    handle)``; lse is filled (its first ``total_q`` columns) only for fused routes."""
    with torch._C.DisableTorchFunction():  # enable_varlen's hook must not see our own calls
        b, sq, h, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[1]
        policy = Policy(backend, strict, float_mask, model)
        opts = Options(scale, causal, 0.0, gqa)
        plan = None
        if token is not None:
            plan = plan_of_token(token)
            if plan is None:
                raise InputValueError("the plan passed to attention was freed before the compiled call ran")
        plan = resolve_plan(mask, batch=b, heads=h, seqlen_q=sq, seqlen_k=sk, device=q.device,
                            convention=convention, policy=policy, plan=plan, scope=current_scope(),
                            roots=roots, derivation=derivation)
        mask4 = execution.mask4_of(mask, q, k, convention)
        r = execution.route(q, k, v, plan, mask4, opts, policy)
        lse_buf = q.new_empty((h, b * sq), dtype=torch.float32)
        if r.fused:
            out, lse = execution.forward_lse(q, k, v, plan, r, opts)
            lse_buf[:, : plan.total_q] = lse
        else:
            with torch.no_grad():
                out = execution.run(q, k, v, plan, mask4, r, opts)
        return out.contiguous(), lse_buf, _hold((plan, r, mask4, opts))


@attention_op.register_fake
def _(q, k, v, mask, token, roots, derivation, scale, causal, gqa, backend, strict, convention, float_mask,
      model):
    if q.device.type == "cuda" and _cuda_graphs_requested():
        raise BackendUnavailableError(
            "varlen_attn does not run under CUDA graphs yet (torch.compile mode='reduce-overhead'): "
            "with the attention op outside the captured partitions the gradients came out wrong "
            "(tests/test_gpu_models.py). Compile with mode=None (default) or "
            "'max-autotune-no-cudagraphs'."
        )
    b, sq, hq = q.shape[0], q.shape[1], q.shape[2]
    return (q.new_empty((b, sq, hq, v.shape[-1])), q.new_empty((hq, b * sq), dtype=torch.float32),
            torch.empty(1, dtype=torch.int64))


def _cuda_graphs_requested() -> bool:
    """Inductor is compiling this graph with CUDA graphs (mode="reduce-overhead"): its options
    are patched in while AOTAutograd runs the fake implementations."""
    config = sys.modules.get("torch._inductor.config")
    return bool(config is not None and config.triton.cudagraphs)


@torch.library.custom_op("varlen_attn::attention_backward", mutates_args=(), tags=_NOT_CAPTURABLE)
def attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          handle: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    with torch._C.DisableTorchFunction():
        plan, r, mask4, opts = _held(handle)
        if r.fused:
            return execution.backward_native(dout, q, k, v, out, lse[:, : plan.total_q].contiguous(),
                                             plan, r, opts)
        # Recompute the forward under autograd (routes without a backward entry point, SDPA).
        qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
        with _autograd_dispatch(), torch.enable_grad(), _stats.quiet():
            o = execution.run(qd, kd, vd, plan, mask4, r, opts)
            grads = torch.autograd.grad(o, (qd, kd, vd), dout, allow_unused=True)
        return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v)))


@attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, handle):
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
    q, k, v = inputs[:3]
    out, lse, handle = output
    ctx.save_for_backward(q, k, v, out, lse, handle)
    ctx.roots = len(inputs[5])


def _backward(ctx, dout, _dlse, _dhandle):
    q, k, v, out, lse, handle = ctx.saved_tensors
    dq, dk, dv = attention_backward_op(dout.contiguous(), q, k, v, out, lse, handle)
    return dq, dk, dv, None, None, [None] * ctx.roots, *(None,) * 9


attention_op.register_autograd(_backward, setup_context=_setup_context)


def attention(q, k, v, mask: Tensor | None, *, plan: VarlenPlan | None, convention: str, opts: Options,
              policy: Policy) -> Tensor:
    """The traced path: padded ``[B, S, H, D]`` tensors to the op. Reads nothing data-dependent."""
    if opts.dropout_p:
        raise InputValueError(
            f"dropout_p must be 0 under torch.compile (a recomputed backward would draw a "
            f"different dropout mask), got {opts.dropout_p}"
        )
    roots, derivation = traced_signature(mask)
    out, _, _ = attention_op(q, k, v, mask, None if plan is None else plan.token, roots, derivation,
                             None if opts.scale is None else float(opts.scale), bool(opts.causal),
                             bool(opts.gqa), policy.backend, policy.strict, convention, policy.float_mask,
                             policy.model)
    return out
