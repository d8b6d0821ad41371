"""Attention under ``torch.compile``: custom ops, opaque to dynamo and inductor.

:func:`attention` calls ``torch.ops.varlen_attn.attention_v4``, which plans and routes at run time
through the eager path's code; the graph sees padded tensors only (a fake implementation, no
recompilation when the mask changes). Two other paths: "Under CUDA graphs" (a static plan built in
the graph) and "In the graph" (key padding of an enabled model), below. The backward op reads the
forward's plan and route from this module's registry. docs/design.md ("Under torch.compile").
"""

from __future__ import annotations

import itertools
import math
import sys
import threading
import weakref
from collections import OrderedDict
from typing import Optional

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import _stats, costs, execution
from ._errors import BackendUnavailableError, InputValueError, KernelRefusedError, NotPackableError, VarlenAttnError
from .execution import Options
from .kernels import BACKENDS, VarlenInputs, in_graph_priority, priority, rows_are_short, select
from .masks import outer_factors
from .pack import gather_rows
from .plan import (STATIC_PROBLEMS, VarlenPlan, is_key_padding, key_padding_side, plan_of_token,
                   refuse_nan_inf, static_plan_of, static_plan_tensors_of, unpackable_reason)
from .policy import Policy, float_mask_read_as_bool, mask_info

# The compile suite passes on 2.10, 2.13 and 2.15; on 2.6 and 2.8 whole-model compile recompiled
# for every new mask. Below it, compiling refuses.
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


# The registry: op-output handle -> (plan, route, kept mask, options, convention), while a handle
# lives. Saved-tensor hooks other than checkpoint's (e.g. save_on_cpu) may hand the backward a copy
# of the handle after the original died: such entries are marked ``keep`` and wait (``_waiting``)
# until a backward adopts a copy; at most _KEPT_MAX entries and _KEPT_BYTES of masks, oldest first.


class _Record:
    """An entry and the handles that hold it: its original, then the copies backwards adopted
    (weak references: the entry lives while one of them does, or waits when ``keep``)."""
    __slots__ = ("entry", "keep", "handles")

    def __init__(self, entry, keep: bool, original: Tensor):
        self.entry, self.keep, self.handles = entry, keep, [weakref.ref(original)]

    @property
    def adopted(self) -> bool:
        return len(self.handles) > 1


_ids = itertools.count(1)
_records: dict[int, _Record] = {}
_waiting: "OrderedDict[int, int]" = OrderedDict()  # number -> bytes of its kept mask
_KEPT_MAX = 1024
_KEPT_BYTES = 1 << 30
_lock = threading.RLock()  # also taken by the handles' finalizers, which a collection may run anywhere


def _hold(entry, keep: bool = False) -> Tensor:
    ident = next(_ids)
    t = torch.tensor([ident], dtype=torch.int64)
    with _lock:
        _records[ident] = _Record(entry, keep, t)
    weakref.finalize(t, _release, ident)
    return t


def _release(ident: int) -> None:
    """A handle of entry ``ident`` (its original or an adopted copy) died."""
    with _lock:
        rec = _records.get(ident)
        if rec is None or any(h() is not None for h in rec.handles):
            return
        if not rec.keep or rec.adopted:
            del _records[ident]
        else:  # it waits for a backward; the oldest go beyond _KEPT_MAX entries or _KEPT_BYTES
            mask = rec.entry[2]
            _waiting[ident] = mask.numel() * mask.element_size() if torch.is_tensor(mask) else 0
            while len(_waiting) > _KEPT_MAX or sum(_waiting.values()) > _KEPT_BYTES:
                _records.pop(_waiting.popitem(last=False)[0], None)


def _held(handle: Tensor):
    """The entry under ``handle`` (the original or a copy), while it lives or waits; else None.
    A backward's lookup: it adopts a copy (see above)."""
    ident = int(handle.item())
    with _lock:
        rec = _records.get(ident)
        if rec is None:
            return None
        if rec.keep and not any(h() is handle for h in rec.handles):
            rec.handles.append(weakref.ref(handle))
            _waiting.pop(ident, None)
            weakref.finalize(handle, _release, ident)
        return rec.entry


_CHECKPOINT_HOOKS = ("_checkpoint_hook.", "_recomputation_hook.")


def _hooks_may_copy() -> bool:
    """Saved-tensor hooks are active, and they are not torch's checkpoint's: what autograd saves
    (the handle) may reach the backward as a copy."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and not getattr(hooks[0], "__qualname__", "").startswith(_CHECKPOINT_HOOKS)


# An entry's mask where no backward can follow (traced without grad): no copy is made.
_NOT_KEPT = "not kept: traced without grad"


def _kept_mask(plan: VarlenPlan | None, r, mask4: Tensor | None, training: bool):
    """What the entry keeps of the mask for the backward on route ``r``: nothing for a varlen
    route; for masked SDPA a copy of a boolean (or float 0/1 read as bool) mask, so a later write
    in place does not reach it (a float bias is saved by autograd instead); without ``training``,
    :data:`_NOT_KEPT`."""
    if r.impl is not None or mask4 is None:
        return None
    if not training:
        return _NOT_KEPT
    if plan is not None and plan.read_as_bool:
        return execution.sdpa_mask(plan, mask4)  # a new tensor
    return mask4.clone() if mask4.dtype == torch.bool else None


# In the ops' names: changed with the backward op's schema, since inductor's on-disk cache keys a
# graph by its forward only (benchmarks/NOTES.md entry 22).
_CONTRACT = "_v4"

# The ops read the plan on the host at run time: tagged, inductor's CUDA graphs capture the rest
# of the graph around them (graph partitions).
_NOT_CAPTURABLE = (torch._C.Tag.cudagraph_unsafe,) if hasattr(torch._C.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op(f"varlen_attn::attention{_CONTRACT}", mutates_args=(), tags=_NOT_CAPTURABLE)
def attention_op(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], token: Optional[Tensor],
                 scale: Optional[float], causal: bool, gqa: bool, backend: str, strict: bool, convention: str,
                 float_mask: str, model: bool, training: bool,
                 deferred: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Padded ``[B, S, H, D]`` q, k, v -> ``(out [B, Sq, Hq, Dv], lse [Hq, B*Sq] float32,
    handle)``; lse holds the kernel's values in its first ``total_q`` columns on fused routes and
    zeros elsewhere. ``training``: traced where a backward may follow (its entry may be kept for
    one). ``deferred``: traced in a forward that collects its checks (:func:`attention`)."""
    with torch._C.DisableTorchFunction():  # a TorchFunctionMode around the graph must not see our own calls
        policy = Policy(backend, strict, float_mask, model)
        plan, r, mask4, opts, checked = _forward_state(q, k, v, mask, token, scale, causal, gqa, policy, convention,
                                                       deferred)
        # After a refusal the route is chosen again, not the plan (no second read, no second count).
        r, (out, lse_buf) = execution.rerouted(
            backend, r, lambda: execution.route(q, k, v, plan, mask4, opts, policy),
            lambda r: _op_forward(q, k, v, plan, r, mask4, opts))
        entry = (plan, r, _kept_mask(plan, r, mask4, training), opts, convention)
        out = out if checked is None else checked(out)
        return out.contiguous(), lse_buf, _hold(entry, training and _hooks_may_copy())


def _op_forward(q, k, v, plan, r, mask4, opts):
    """:func:`attention_op`'s ``(out, lse)`` on route ``r``. The lse output is zero past the
    plan's rows and on routes that make none: an op's outputs must not depend on what the
    allocator left (torch.library.opcheck compares them)."""
    b, sq, h = q.shape[0], q.shape[1], q.shape[2]
    if r.fused:
        out, lse = execution.forward_lse(q, k, v, plan, r, opts)
        return out, torch.nn.functional.pad(lse.float(), (0, b * sq - plan.total_q))
    with torch.no_grad():
        out = execution.run(q, k, v, plan, mask4, r, opts)
    return out, q.new_zeros((h, b * sq), dtype=torch.float32)


def _forward_state(q, k, v, mask, token, scale, causal, gqa, policy: Policy, convention, deferred):
    """``(plan, route, mask4, options, checked)`` of a call of the op: ``checked`` None, or where the
    mask may be the outer product of the model's, its check (:func:`~varlen_attn.execution.outer_in_op`:
    the plan of the product, ``mask4`` its keys')."""
    opts = Options(scale, causal, 0.0, gqa)
    plan = None if token is None else plan_of_token(token)
    if token is not None and plan is None:
        raise InputValueError("the plan passed to attention was freed before the compiled call ran")
    mask4 = execution.mask4_of(mask, q, k, convention)
    found = execution.outer_in_op(q, k, v, mask4, opts, policy, deferred) if token is None else None
    if found is not None:
        plan, r, keys, checked = found
        return plan, r, keys, opts, checked
    plan, r = execution.plan_and_route(q, k, v, mask4, opts, policy, plan)
    return plan, r, mask4, opts, None


@attention_op.register_fake
def _(q, k, v, mask, token, scale, causal, gqa, backend, strict, convention, float_mask, model, training,
      deferred=False):
    if q.device.type == "cuda" and _cuda_graphs_requested():
        raise BackendUnavailableError(
            "CUDA graphs (torch.compile mode='reduce-overhead') were requested, but varlen_attn did not "
            "see it while dynamo traced (a compiler backend wrapped in a way it does not know), so "
            "attention was traced to the op that reads its plan on the host, which a CUDA graph cannot "
            "replay. Compile with mode=None (default) or 'max-autotune-no-cudagraphs'."
        )
    b, sq, hq = q.shape[0], q.shape[1], q.shape[2]
    return (q.new_empty((b, sq, hq, v.shape[-1])), q.new_empty((hq, b * sq), dtype=torch.float32),
            torch.empty(1, dtype=torch.int64))


def _cuda_graphs_requested() -> bool:
    """Inductor's config asks for CUDA graphs (mode="reduce-overhead"): its global setting, and
    while AOTAutograd runs the fake implementations also the compile's options, patched in."""
    config = sys.modules.get("torch._inductor.config")
    return bool(config is not None and config.triton.cudagraphs)


@torch.library.custom_op(f"varlen_attn::attention_backward{_CONTRACT}", mutates_args=(), tags=_NOT_CAPTURABLE)
def attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          handle: Tensor, bias: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """The forward's gradients, on its plan and route, from the registry entry under ``handle``
    (or a copy of it). ``bias``: the call's mask where it is a float one; any other mask is read
    from the entry (:func:`_kept_mask`)."""
    with torch._C.DisableTorchFunction():
        entry = _held(handle)
        if entry is None:
            raise VarlenAttnError(
                "the backward of a compiled varlen_attn call found no entry of its forward. Under "
                "saved-tensor hooks that copy what autograd saves, the entries of calls whose handle "
                f"the hooks copied wait for their backward, at most {_KEPT_MAX} calls and "
                f"{_KEPT_BYTES >> 20} MiB of kept masks, the oldest dropped first: run each forward's "
                "backward before that many more attention calls; and a second backward through a "
                "retained graph finds the entry while the copy of the handle the first backward got "
                "lives, which hooks whose unpack makes a new tensor each time do not keep")
        plan, r, mask4, opts, convention = entry
        if mask4 is _NOT_KEPT:
            raise VarlenAttnError("the backward of a compiled varlen_attn call traced without grad "
                                  "(no mask was kept for one): compile the call with grad enabled")
        if r.fused:
            return _contiguous(execution.backward_native(dout, q, k, v, out, lse[:, : plan.total_q].contiguous(),
                                                         plan, r, opts))
        if r.impl is None and mask4 is None and bias is not None:
            mask4 = execution.mask4_of(bias, q, k, convention)
        return _recomputed_grads(dout, q, k, v, plan, mask4, r, opts)


def _recomputed_grads(dout, q, k, v, plan, mask4, r, opts):
    """Gradients of a route without a backward entry point (or SDPA): its forward recomputed
    under autograd."""
    qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
    with _autograd_dispatch(), torch.enable_grad(), _stats.quiet():
        o = execution.run(qd, kd, vd, plan, mask4, r, opts)
        grads = torch.autograd.grad(o, (qd, kd, vd), dout, allow_unused=True)
    return _contiguous(tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v))))


def _contiguous(grads):
    """The backward ops' gradients, contiguous: what their fake implementations promise
    (``_contiguous_like``), whatever the strides of q, k, v (the drop-in's are transposed views)."""
    return tuple(g.contiguous() for g in grads)


def _contiguous_like(*tensors):
    return tuple(t.new_empty(t.shape) for t in tensors)


@attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, handle, bias):
    return _contiguous_like(q, k, v)


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
    q, k, v, mask = inputs[:4]
    out, lse, handle = output
    # A boolean mask is not saved (a write in place after the call, which SDPA allows, would stop
    # the backward); a float mask is, as SDPA saves a float bias.
    bias = mask if mask is not None and mask.is_floating_point() else None
    ctx.save_for_backward(q, k, v, out, lse, handle, bias)
    ctx.rest = len(inputs) - 3  # mask ... training


def _backward(ctx, dout, _dlse, _dhandle):
    q, k, v, out, lse, handle, bias = ctx.saved_tensors
    dq, dk, dv = attention_backward_op(dout.contiguous(), q, k, v, out, lse, handle, bias)
    return dq, dk, dv, *(None,) * ctx.rest


attention_op.register_autograd(_backward, setup_context=_setup_context)


def attention(q, k, v, mask: Tensor | None, *, plan: VarlenPlan | None, convention: str, opts: Options,
              policy: Policy, deferred: bool = False) -> Tensor:
    """The traced path: padded ``[B, S, H, D]`` tensors to the op, or, for a key-padding mask
    of an enabled model or an outer product left to stock as its keys' mask, attention in the
    graph itself (below). Reads nothing data-dependent. ``deferred``: the model's forward
    collects its checks (:class:`~varlen_attn.execution.Deferred`; dynamo guards on that)."""
    if opts.dropout_p:
        raise InputValueError(
            f"dropout_p must be 0 under torch.compile (a recomputed backward would draw a "
            f"different dropout mask), got {opts.dropout_p}"
        )
    if mask is not None and plan is None:
        mask4 = execution.mask4_of(mask, q, k, convention)
        if _stock_by_cost(q, k, mask4, opts, policy):
            return execution.run(q, k, v, None, mask4, execution.stock_route(mask4, policy), opts)
    if q.device.type in CAPTURED_DEVICES and _cuda_graphs_traced():
        return _static_attention(q, k, v, mask, plan=plan, convention=convention, opts=opts, policy=policy)
    if policy.in_graph and mask is not None and plan is None and not opts.causal and policy.backend != "sdpa":
        mask4 = execution.mask4_of(mask, q, k, convention)
        if deferred and _outer_keys_to_stock(q, k, mask4, opts, policy):
            return _outer_as_keys(q, k, v, mask4, opts)
        if is_key_padding(mask4):
            scale = execution.kernel_scale(q, opts)
            short = policy.backend == "auto" and rows_are_short(k.shape[1])
            chosen = _traceable_backend(policy.backend, q.dtype, q.device.type, q.device.index, q.shape[2],
                                        k.shape[2], q.shape[-1], v.shape[-1], scale, short)
            if chosen:
                return _in_graph_attention(q, k, v, mask4, chosen, scale)
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    out, _, _ = attention_op(q, k, v, mask, None if plan is None else plan.token,
                             None if opts.scale is None else float(opts.scale), bool(opts.causal),
                             bool(opts.gqa), policy.backend, policy.strict, convention, policy.float_mask,
                             policy.model, training, deferred)
    return out


def _stock_by_cost(q, k, mask4, opts: Options, policy: Policy) -> bool:
    """auto leaves this traced call to stock's masked SDPA: its lengths are provably below the
    crossover (:func:`varlen_attn.costs.kernel_crossover`) of the kernel the graph would pack
    with. A symbolic length that cannot be proven packs; no guard is added."""
    if not execution.cost_applies(policy, opts.causal, mask4.is_floating_point()):
        return False
    # Read without a guard: a mask's row count may be a symbol (an outer product's Sq).
    one_row = statically_known_true(mask4.shape[2] == 1)
    in_graph = (policy.in_graph and one_row and mask4.dtype == torch.bool
                and statically_known_true(mask4.shape[1] == 1))  # is_key_padding, read so
    bound = _cost_bound(q.dtype, q.device.type, q.device.index, "key_padding" if one_row else "outer", in_graph,
                        in_graph and rows_are_short(k.shape[1]))
    return statically_known_true(q.shape[1] * k.shape[1] < bound)


def _crossover(dtype, device_type: str, device_index, layout: str, in_graph: bool, short_rows: bool):
    """The :class:`~varlen_attn.costs.Crossover` of such calls, or None without a cost table. The
    kernel is the one auto would take for head dim 128 (in the graph's order for the in-graph
    route): heads and head dims are not read, since dynamo may trace them as symbols too."""
    device = torch.device(device_type, device_index)
    if costs.table_for(device, dtype) is None:
        return None
    order = in_graph_priority(device, short_rows) if in_graph else priority(device)
    kernel = costs.packed_kernel(device, dtype, 1, 1, 128, 128, order)
    return costs.kernel_crossover(device, dtype, kernel, layout, costs.stock_kernel(device, dtype))


@torch._dynamo.assume_constant_result  # run once while tracing; the graph holds its answer
def _cost_bound(dtype, device_type: str, device_index, layout: str, in_graph: bool, short_rows: bool) -> int:
    """Sq x Sk below which such a call goes to stock: its :func:`_crossover` squared."""
    c = _crossover(dtype, device_type, device_index, layout, in_graph, short_rows)
    if c is None:
        return 0
    return min(math.ceil(c.tokens * c.tokens), 1 << 62) if math.isfinite(c.tokens) else 1 << 62


# --- Under CUDA graphs -------------------------------------------------------------------------
# A replayed graph cannot read a plan on the host: attention is traced to a plan built in the graph
# (plan.static_plan_tensors_of, no host read, shapes fixed by B, Sq, Sk) and ``static_attention``.

# Devices whose graphs CUDA graphs capture. Tests add "cpu" to run this path there.
CAPTURED_DEVICES = frozenset({"cuda"})


@torch._dynamo.assume_constant_result  # run once while tracing; the graph holds its answer
def _cuda_graphs_traced() -> bool:
    """The graph dynamo is tracing will be compiled with CUDA graphs: the compile's inductor
    options (``mode="reduce-overhead"``) or inductor's global config say so."""
    tx = _tracer()
    backend = None if tx is None else tx.output.compiler_fn
    seen = 0
    while backend is not None and seen < 12:  # wrappers: dynamo's debug wrapper, DDP's optimizer
        options = getattr(backend, "config", None)
        if isinstance(options, dict) and "triton.cudagraphs" in options:
            return bool(options["triton.cudagraphs"])  # the compile's own options win
        backend = next((w for w in (getattr(backend, a, None) for a in _WRAPPED) if w is not None), None)
        seen += 1
    return _cuda_graphs_requested()  # no option of this compile says: inductor's global config


def _tracer():
    """The translator of the frame dynamo is tracing, or None (not tracing, another torch)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001
        return None


# Where a compiler wrapper keeps what it wraps: functools-style, dynamo's WrapBackendDebug,
# DDPOptimizer (a bound method whose object holds the backend), the original backend.
_WRAPPED = ("__wrapped__", "compiler_fn", "__self__", "backend_compile_fn", "_torchdynamo_orig_backend")


def _raise(error: Exception):
    raise error


# Raised outside the trace, so the error reaches the caller as it is (a raise inside the trace
# makes dynamo break the graph and run on eagerly, see _refuse_compile).
_raise_outside_trace = _compiler_disabled(_raise, "varlen_attn refuses this call under CUDA graphs")


def _static_attention(q, k, v, mask, *, plan, convention: str, opts: Options, policy: Policy) -> Tensor:
    """The traced path under CUDA graphs (see above)."""
    if opts.causal:
        _raise_outside_trace(BackendUnavailableError(
            "causal attention does not run under CUDA graphs with varlen_attn yet "
            "(torch.compile mode='reduce-overhead'): compile with mode=None or 'max-autotune-no-cudagraphs'"
        ))
    if mask is None:
        if plan is not None:
            _raise_outside_trace(InputValueError(
                "under CUDA graphs (torch.compile mode='reduce-overhead') pass attn_mask, not only "
                "plan: a plan holds host values a replayed graph cannot update"
            ))
        mask = torch.ones((q.shape[0], k.shape[1]), dtype=torch.bool, device=q.device)
        convention = "model"
    if policy.backend == "sdpa":
        mask4 = execution.mask4_of(mask, q, k, convention)
        if mask4.is_floating_point() and policy.float_mask == "error":
            _raise_outside_trace(BackendUnavailableError(
                f"float_mask='error' cannot check a float mask (dtype {mask.dtype}, shape {tuple(mask.shape)}) "
                f"for 0/1 values under CUDA graphs with backend='sdpa' (that needs a host read): choose "
                f"float_mask='bool' or 'bias', or another backend"))
        # A float 0/1 mask read as boolean: converted on the device, as eager converts it.
        return execution.run(q, k, v, None, mask4, execution.stock_route(mask4, policy), opts)
    return static_attention(q, k, v, mask, convention=convention, opts=opts, policy=policy)[0]


def static_attention(q, k, v, mask: Tensor, *, convention: str, opts: Options,
                     policy: Policy) -> tuple[Tensor, Tensor]:
    """Padded ``[B, S, H, D]`` q, k, v and a padding mask -> ``(out, lse [Hq, B*Sq])``, with no
    host read while a CUDA graph captures it: the plan from the mask (tensor ops, traced into the
    graph), then the op on it. ``opts.causal`` and ``opts.dropout_p`` are not read."""
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    plan_tensors, problems = static_plan_tensors_of(execution.mask4_of(mask, q, k, convention), batch=b,
                                                    seqlen_q=sq, seqlen_k=sk,
                                                    float01_as_bool=policy.float_mask != "bias")
    # The mask's shape goes as ints, formatted at run time: under dynamic shapes they are symbols.
    return static_attention_op(q, k, v, plan_tensors, problems, str(mask.dtype), list(mask.shape),
                               None if opts.scale is None else float(opts.scale), bool(opts.gqa), policy.backend,
                               policy.strict, policy.float_mask, policy.model)


def _checked(problems: Tensor, float_mask: str, mask_dtype: str, mask_shape: list[int]) -> None:
    """Stop where a static plan would be wrong: a host read (a clear error) outside capture, a
    device assert recorded into the graph during capture (a replay with such a mask stops the
    process rather than computing a wrong result)."""
    fatal = problems if float_mask == "error" else problems[:-1]
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        torch._assert_async(fatal.sum() == 0, "varlen_attn: the mask is not a padding mask (one "
                            "segment per batch element), which CUDA graphs need")
        return
    _stats.record_host_sync()
    found = dict(zip(STATIC_PROBLEMS, problems.tolist()))
    refuse_nan_inf(found, mask_dtype, mask_shape)
    reason = unpackable_reason(found)
    if reason is not None:
        raise BackendUnavailableError(
            f"under CUDA graphs (torch.compile mode='reduce-overhead') varlen_attn needs a padding "
            f"mask, one segment per batch element; got a mask ({mask_info(mask_dtype, mask_shape)}): "
            f"{reason}. Compile with mode=None or 'max-autotune-no-cudagraphs' (then it runs "
            f"on masked SDPA with the reason recorded), or disable varlen_attn"
        )
    if found["float01"]:
        float_mask_read_as_bool(float_mask, mask_info(mask_dtype, mask_shape))


def _static_route(q, k, v, plan_tensors, scale, gqa, backend, strict, float_mask, model):
    """``(plan, route, opts)`` of the static op's forward and backward, from the plan's tensors."""
    plan = static_plan_of(plan_tensors, batch=q.shape[0], seqlen_q=q.shape[1], seqlen_k=k.shape[1])
    opts = Options(scale, False, 0.0, gqa)
    return plan, execution.route(q, k, v, plan, None, opts, Policy(backend, strict, float_mask, model)), opts


@torch.library.custom_op("varlen_attn::static_attention", mutates_args=())
def static_attention_op(q: Tensor, k: Tensor, v: Tensor, plan_tensors: Tensor, problems: Tensor, mask_dtype: str,
                        mask_shape: list[int], scale: Optional[float], gqa: bool, backend: str, strict: bool,
                        float_mask: str, model: bool) -> tuple[Tensor, Tensor]:
    """Padded q, k, v and a static plan (:func:`varlen_attn.plan.static_plan_tensors_of`, with
    its ``problems``) -> ``(out, lse [Hq, B*Sq])``; no host read during capture. The mask's
    dtype and shape name it in errors."""
    with torch._C.DisableTorchFunction():
        _checked(problems, float_mask, mask_dtype, mask_shape)

        def state():  # after a refusal the backward op, routing again from the same arguments, agrees
            return _static_route(q, k, v, plan_tensors, scale, gqa, backend, strict, float_mask, model)

        _, (out, lse) = execution.rerouted(backend, state(), state, lambda s: _static_forward(q, k, v, *s))
        return out.contiguous(), lse


def _static_forward(q, k, v, plan, r, opts):
    """:func:`static_attention_op`'s ``(out, lse)`` on route ``r``."""
    if r.fused:
        out, lse = execution.forward_lse(q, k, v, plan, r, opts)
        # Rows past cu_seqlens[-1] hold what the kernel left there: zeroed, as above.
        past = torch.arange(lse.shape[-1], device=lse.device) >= plan.cu_seqlens_q[-1]
        return out, lse.masked_fill(past, 0)
    with torch.no_grad():
        out = execution.run(q, k, v, plan, None, r, opts)
    return out, q.new_zeros((q.shape[2], plan.total_q), dtype=torch.float32)


@static_attention_op.register_fake
def _(q, k, v, plan_tensors, problems, mask_dtype, mask_shape, scale, gqa, backend, strict, float_mask, model):
    b, sq, hq = q.shape[0], q.shape[1], q.shape[2]
    return q.new_empty((b, sq, hq, v.shape[-1])), q.new_empty((hq, b * sq), dtype=torch.float32)


@torch.library.custom_op("varlen_attn::static_attention_backward", mutates_args=())
def static_attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                 plan_tensors: Tensor, scale: Optional[float], gqa: bool, backend: str,
                                 strict: bool, float_mask: str, model: bool) -> tuple[Tensor, Tensor, Tensor]:
    with torch._C.DisableTorchFunction():
        plan, r, opts = _static_route(q, k, v, plan_tensors, scale, gqa, backend, strict, float_mask, model)
        if r.fused:
            return _contiguous(execution.backward_native(dout, q, k, v, out, lse, plan, r, opts))
        return _recomputed_grads(dout, q, k, v, plan, None, r, opts)


@static_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, plan_tensors, scale, gqa, backend, strict, float_mask, model):
    return _contiguous_like(q, k, v)


def _static_setup_context(ctx, inputs, output):
    q, k, v, plan_tensors, _problems, _mask_dtype, _mask_shape, *backward_args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, plan_tensors)
    ctx.args = backward_args  # scale, gqa, backend, strict, float_mask, model: the backward op's tail
    ctx.inputs = len(inputs)


def _static_backward(ctx, dout, _dlse):
    q, k, v, out, lse, plan_tensors = ctx.saved_tensors
    dq, dk, dv = static_attention_backward_op(dout.contiguous(), q, k, v, out, lse, plan_tensors, *ctx.args)
    return dq, dk, dv, *(None,) * (ctx.inputs - 3)


static_attention_op.register_autograd(_static_backward, setup_context=_static_setup_context)


# --- In the graph -------------------------------------------------------------------------------
# An enabled model's boolean key-padding mask (``Policy.in_graph``) needs no host read: the plan
# comes from a small op (key_padding_plan_op), keys and values are gathered in the graph, and the
# kernel is traced (``TRACEABLE``) or runs in the opaque native_kernel op (FA4).


@torch._dynamo.assume_constant_result  # run once while tracing; the graph holds its answer
def _traceable_backend(backend: str, dtype, device_type: str, device_index, hq: int, hk: int, d: int, dv: int,
                       scale: float, short_rows: bool) -> str:
    """The backend ``backend`` selects for inputs of this kind in a compiled graph (auto: in
    :func:`varlen_attn.kernels.in_graph_priority`'s order) when the in-graph route can call its
    kernel, else ""."""
    device = torch.device(device_type, device_index)
    q = torch.empty((1, hq, d), dtype=dtype, device=device)
    k, v = q.new_empty((1, hk, d)), q.new_empty((1, hk, dv))
    probe = VarlenPlan(batch_size=1, seqlen_q=1, seqlen_k=1, packable=True, device=device, static=True)
    try:
        impl = select(VarlenInputs(q, k, v, probe, scale), backend, in_graph_priority(device, short_rows))
    except BackendUnavailableError:
        return ""  # the general route says why, where it matters
    return impl.NAME if impl.TRACEABLE or (impl.NATIVE_BACKWARD and impl.STATIC_PLANS) else ""


@torch._dynamo.assume_constant_result  # a capability (torch's reads its entry points), not traced
def _kernel_traces(name: str) -> bool:
    return bool(BACKENDS[name].TRACEABLE)


def _traced_kernel(name: str):
    """How the in-graph route calls backend ``name``'s kernel on packed rows in the static layout:
    traced itself where it traces (``TRACEABLE``: ``torch``'s aten forward), else, for a kernel
    with its own forward and backward entry points (``NATIVE_BACKWARD``: FA4, whose Python
    interface dynamo cannot trace), through the opaque op :func:`native_kernel_op` below."""
    if _kernel_traces(name):
        return BACKENDS[name].traced_forward
    return lambda q, k, v, cu_q, cu_k, max_q, max_k, scale: native_kernel_op(q, k, v, cu_q, cu_k, max_q, max_k,
                                                                             scale, name)[0]


@torch.library.custom_op("varlen_attn::key_padding_plan", mutates_args=())
def key_padding_plan_op(valid: Tensor, batch: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A key-padding mask's rows ``valid [B|1, Sk]`` (bool) -> ``(dead [B], order [B*Sk] int64,
    cu_seqlens [B+1] int32, padding [B*Sk] bool)`` (:func:`varlen_attn.plan.key_padding_side`).
    An op, not traced ops: inductor's Triton codegen failed on its row-wise cumsum at 1536 keys
    (torch 2.11, H200: "list indices must be integers or slices, not NoneType" in a SplitScan)."""
    with torch._C.DisableTorchFunction():
        dead, (order, _, cu, padding) = key_padding_side(valid[:, None, None, :], batch=batch, seqlen_k=valid.shape[-1])
        return dead, order, cu, padding


@key_padding_plan_op.register_fake
def _(valid, batch):
    rows = batch * valid.shape[-1]
    return (valid.new_empty((batch,)), valid.new_empty((rows,), dtype=torch.int64),
            valid.new_empty((batch + 1,), dtype=torch.int32), valid.new_empty((rows,)))


def _in_graph_attention(q, k, v, mask4: Tensor, chosen: str, scale: float) -> Tensor:
    """The in-graph route (see above): padded ``[B, S, H, D]`` in and out, a key-padding mask."""
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    dead, order, cu_k, padding = key_padding_plan_op(mask4[:, 0, 0], b)
    # Rows past the last segment hold what the kernel leaves there: the gathers' backward fills
    # their padded positions with zeros.
    kp, vp = (gather_rows(t.flatten(0, 1), order, None, padding) for t in (k, v))
    cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device)
    out = _traced_kernel(chosen)(q.flatten(0, 1), kp, vp, cu_q, cu_k, sq, sk, scale)
    out = out.view(b, sq, q.shape[2], v.shape[-1])
    return out.masked_fill(dead.view(b, 1, 1, 1), 0)


# An enabled model's boolean mask with rows whose keys' mask auto leaves to stock (stock's kernel,
# cuDNN's, fails on rows: costs.cudnn_rows_fail), as execution.attend_outer runs it eagerly: SDPA
# on the keys' mask in the graph, the rows scaled, the check that the mask is their outer product
# made in the graph and kept by a small op for the forward's read (a recomputation's: NaN where it
# fails). Through the general op instead, its backward ran the forward again (no SDPA backward
# entry point there): 57 cuDNN forwards a step more at Chroma 1024 px, about what the compiled
# Chroma step lost to stock without flash-attn (0.89x; benchmarks/NOTES.md entry 60).


def _outer_keys_to_stock(q, k, mask4: Tensor, opts: Options, policy: Policy) -> bool:
    """auto leaves this traced call, a boolean mask with rows the same in every head, to stock's
    SDPA on its keys' mask: lengths provably below the key-padding crossover (as eagerly,
    :func:`varlen_attn.execution._keys_route`)."""
    if not (policy.model and mask4.dtype == torch.bool and execution.cost_applies(policy, opts.causal, False)
            and statically_known_true(mask4.shape[1] == 1) and statically_known_true(mask4.shape[2] > 1)):
        return False
    bound = _cost_bound(q.dtype, q.device.type, q.device.index, "key_padding", False, False)
    return statically_known_true(q.shape[1] * k.shape[1] < bound)


def _outer_as_keys(q, k, v, mask4: Tensor, opts: Options) -> Tensor:
    """The route above: padded ``[B, S, H, D]`` in and out."""
    keep_q, keep_k, bad = outer_factors(mask4)
    poison = outer_check_op(bad, _keys_reason(q.dtype, q.device.type, q.device.index))
    # On the factor, not added to the output: a failed unread check makes the gradients NaN too.
    rows = keep_q[:, :, None, None].to(q.dtype)
    return execution.masked_sdpa(q, k, v, keep_k[:, None, None, :], opts) * (rows + poison.to(q.dtype))


@torch._dynamo.assume_constant_result  # run once while tracing; the graph holds its answer
def _keys_reason(dtype, device_type: str, device_index) -> str:
    return _crossover(dtype, device_type, device_index, "key_padding", False, False).below.reason


@torch.library.custom_op("varlen_attn::outer_check", mutates_args=(), tags=_NOT_CAPTURABLE)
def outer_check_op(bad: Tensor, reason: str) -> Tensor:
    """``bad`` (the mask is not the outer product its rows and keys make) as this thread's entry
    checks it: kept for the forward's read, 0 returned; in a recomputation not read, NaN where
    ``bad``; elsewhere read now, and raised. The call's route counted."""
    _stats.record_route(reason, execution.SDPA)
    checks = execution.op_checks(True)  # only graphs traced with a forward's checks hold this op
    if checks is not None:  # a copy of ``bad``: inductor may reuse the buffer of a graph's value
        return checks.checked(bad.new_zeros((), dtype=torch.float32), bad.clone())
    _stats.record_host_sync()
    if bad.item():
        raise NotPackableError("an attention mask with rows is not the outer product of its rows and keys, in a "
                               "compiled call with no checks of its model's forward to keep the flag")
    return bad.new_zeros((), dtype=torch.float32)


@outer_check_op.register_fake
def _(bad, reason):
    return bad.new_empty((), dtype=torch.float32)


# An untraceable kernel with its own backward (NATIVE_BACKWARD: FA4) as an opaque op of the
# in-graph route: packed rows in the static layout, ``(out, lse)`` out, no host read.


def _static_inputs(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float) -> VarlenInputs:
    plan = VarlenPlan(batch_size=cu_q.shape[0] - 1, seqlen_q=max_q, seqlen_k=max_k, packable=True, device=q.device,
                      cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                      total_q=q.shape[0], total_k=k.shape[0], static=True)
    return VarlenInputs(q, k, v, plan, scale)


@torch.library.custom_op("varlen_attn::native_kernel", mutates_args=())
def native_kernel_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, scale: float, backend: str) -> tuple[Tensor, Tensor]:
    """Packed ``q [Tq, Hq, D]``, ``k, v [Tk, Hkv, D]`` -> ``(out [Tq, Hq, Dv], lse [Hq, Tq] float32)``
    by backend ``backend``'s own forward."""
    with torch._C.DisableTorchFunction():
        try:
            out, lse = BACKENDS[backend].forward_lse(_static_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                                    max_seqlen_q, max_seqlen_k, scale))
        except KernelRefusedError as e:
            # The kernel was chosen when the graph was traced, from its declared support.
            raise KernelRefusedError(
                f"{backend!r} refused a call it was traced into a compiled graph for: {e}. Enable with "
                f"in_graph=False (the custom op, which chooses again), or pick another backend") from e
        _stats.record_backend(backend)
        return out.contiguous(), lse.float().contiguous()


@native_kernel_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, backend):
    return q.new_empty((*q.shape[:2], v.shape[-1])), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("varlen_attn::native_kernel_backward", mutates_args=())
def native_kernel_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                              cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                              scale: float, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`native_kernel_op` by the backend's own backward."""
    with torch._C.DisableTorchFunction():
        inp = _static_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)
        return _contiguous(BACKENDS[backend].backward(inp, out, lse, dout))


@native_kernel_backward_op.register_fake
def _(dout, q, k, v, out, lse, *layout_and_constants):
    return _contiguous_like(q, k, v)


def _native_kernel_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *constants = inputs
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k)
    ctx.constants = constants  # max_seqlen_q, max_seqlen_k, scale, backend


def _native_kernel_backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = native_kernel_backward_op(dout.contiguous(), q, k, v, out, lse, cu_q, cu_k, *ctx.constants)
    return dq, dk, dv, None, None, None, None, None, None


native_kernel_op.register_autograd(_native_kernel_backward, setup_context=_native_kernel_setup)
