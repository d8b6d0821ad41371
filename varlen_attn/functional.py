"""The functional entries: masked attention computed by packing valid tokens.

* :func:`scaled_dot_product_attention`: a drop-in for ``torch.nn.functional``'s, layout
  ``[B, H, S, D]``, the mask broadcast exactly as SDPA broadcasts it.
* :func:`attention`: layout ``[B, S, H, D]`` (flash-attn's and diffusers' dispatch layout),
  masks read batch first (``[B, Sk]`` is key padding), and a prebuilt plan may be passed.

Both validate their inputs, then :func:`dispatch`: the one place where the eager and the
traced (``torch.compile``) paths part. Eager: the plan and the route, then run
(:mod:`varlen_attn.execution`). Traced: the custom op (:mod:`varlen_attn.op`), which does the
same at run time.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import execution, op
from ._errors import BackendUnavailableError, InputTypeError, InputValueError, as_real, check_bool, describe
from .execution import Options
from .kernels import TORCH_SDPA
from .plan import VarlenPlan
from .policy import Policy


def _autocast(query, key, value, attn_mask):
    """Inside an autocast region the dispatcher runs SDPA in the autocast dtype, casting every
    floating input that autocast may cast, an additive mask included (so a finite
    ``finfo(float32).min`` becomes ``-inf`` in float16); float64 it never casts. Qwen-Image and
    HunyuanVideo reach SDPA there with float32 q, k and a bfloat16 v. Do the same, before the
    dtype checks, so the results are stock's (a float64 model under autocast stays float64)."""
    if not isinstance(query, torch.Tensor):
        return query, key, value, attn_mask
    device = query.device.type
    if device not in ("cpu", "cuda") or not torch.is_autocast_enabled(device):
        return query, key, value, attn_mask
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in (query, key, value, attn_mask))


def _check_qkv(query, key, value, enable_gqa: bool, layout: str, attn_mask=None, plan=None):
    """Validate the inputs as SDPA does, in its order, and return ``(B, Sq, Sk)``; ``layout`` is
    ``"bhsd"`` or ``"bshd"``."""
    dims = "[B, H, S, D]" if layout == "bhsd" else "[B, S, H, D]"
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {describe(t)}")
        if t.dim() != 4:
            raise InputValueError(f"{name} must be 4-D {dims}, got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise InputTypeError(f"{name} must be floating point, got dtype {t.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise InputTypeError(
            f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise InputValueError(
            f"query, key and value must be on one device, got {query.device}, {key.device}, {value.device}"
        )
    h_ax, s_ax = (1, 2) if layout == "bhsd" else (2, 1)
    b, hq, sq = query.shape[0], query.shape[h_ax], query.shape[s_ax]
    hk, sk = key.shape[h_ax], key.shape[s_ax]
    if key.shape[0] != b or value.shape[0] != b:
        raise InputValueError(
            f"query, key and value must share the batch size, got {b}, {key.shape[0]}, {value.shape[0]}"
        )
    if value.shape[s_ax] != sk or value.shape[h_ax] != hk:
        raise InputValueError(
            f"value must match key in sequence length and heads {dims}, got key "
            f"{tuple(key.shape)} and value {tuple(value.shape)}"
        )
    if key.shape[-1] != query.shape[-1]:
        raise InputValueError(
            f"key's head dim must equal query's, got query {tuple(query.shape)}, key {tuple(key.shape)}"
        )
    if hq != hk and not (enable_gqa and hk > 0 and hq % hk == 0):
        raise InputValueError(
            f"query has {hq} heads and key/value {hk}: they must be equal, or enable_gqa=True "
            f"with query heads a multiple of key heads"
        )
    # SDPA's rule for a float mask: float32 or the query's dtype (it refuses a float64 mask with
    # float32 queries, or a bfloat16 one with float16 queries).
    if (isinstance(attn_mask, torch.Tensor) and attn_mask.is_floating_point()
            and attn_mask.dtype not in (torch.float32, query.dtype)):
        raise InputTypeError(
            f"attn_mask must be bool, float32 or the query's dtype ({query.dtype}), as for "
            f"F.scaled_dot_product_attention, got dtype {attn_mask.dtype}")
    if plan is not None and not isinstance(plan, VarlenPlan):
        raise InputTypeError(f"plan must be a VarlenPlan or None, got {describe(plan)}")
    if plan is not None and (plan.batch_size, plan.seqlen_q, plan.seqlen_k) != (b, sq, sk):
        raise InputValueError(
            f"plan was built for B={plan.batch_size}, Sq={plan.seqlen_q}, Sk={plan.seqlen_k}, "
            f"got query {tuple(query.shape)} and key {tuple(key.shape)}"
        )
    return b, sq, sk


def _check_options(dropout_p, scale, is_causal, enable_gqa):
    """Validate SDPA's options as its argument parser does; returns ``(dropout_p, scale,
    is_causal, enable_gqa)`` as float, float or None, bool, bool."""
    dropout_p = as_real("dropout_p", dropout_p)
    if not 0.0 <= dropout_p <= 1.0:
        raise InputValueError(f"dropout_p must be in [0, 1], got {dropout_p!r}")
    return (dropout_p, None if scale is None else as_real("scale", scale, "a float, a 0-d tensor or None"),
            check_bool("is_causal", is_causal), check_bool("enable_gqa", enable_gqa))


def _sdpa_takes_mask_with_causal() -> bool:
    """Whether this torch's SDPA accepts ``attn_mask`` together with ``is_causal=True`` (2.13
    does and applies ``mask & tril``, top-left aligned; older releases refuse)."""
    x = torch.zeros(1, 1, 2, 8)
    try:
        TORCH_SDPA(x, x, x, attn_mask=torch.ones(2, 2, dtype=torch.bool), is_causal=True)
    except (RuntimeError, ValueError):
        return False
    return True


MASK_WITH_CAUSAL = _sdpa_takes_mask_with_causal()


GRAD_MASK_REASON = ("attn_mask requires grad (a learned bias): masked SDPA runs, so the mask "
                    "gets its gradient")


TRANSFORM_REASON = ("inside a torch.func transform (grad, vmap, jvp, ...) or forward-mode AD: masked "
                    "SDPA runs, as stock (varlen kernels have no batching or forward-mode rule)")


def _transformed(*tensors) -> bool:
    """Inside a torch.func transform (this thread's interpreter stack), or ``tensors`` carry
    forward-mode AD tangents (the dual level is process-wide: another thread's level must not
    reroute this thread's calls): the packed path's autograd Functions and kernels have no vmap
    or jvp rule, and a plan's host read cannot be batched."""
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return True
    if torch.autograd.forward_ad._current_level < 0:
        return False
    unpack = torch.autograd.forward_ad.unpack_dual
    return any(t is not None and unpack(t).tangent is not None for t in tensors)


def dispatch(q, k, v, mask, *, convention: str, plan: VarlenPlan | None, opts: Options,
             policy: Policy, checks=None) -> torch.Tensor:
    """Validated ``[B, S, H, D]`` q, k, v -> output: the eager path, or the custom op when traced.
    ``checks``: where an enabled model's forward collects its device checks
    (:func:`varlen_attn.execution.attend_outer`)."""
    mask4 = execution.mask4_of(mask, q, k, convention)  # a view; also validates the mask's shape
    if (q.is_meta or q.numel() == 0 or k.numel() == 0 or (opts.scale is not None and not math.isfinite(opts.scale))
            or opts.dropout_p == 1.0):
        # No data (meta tensors: shape propagation for init-on-meta tooling), no tokens, a
        # non-finite scale, or every weight dropped: nothing to pack; SDPA gives the shapes, the
        # empty or zero results, the NaNs.
        return execution.masked_sdpa(q, k, v, mask4, opts)
    if mask4 is not None and mask.requires_grad and torch.is_grad_enabled():
        # Packing reads the mask only for its pattern: it would get no gradient. Decided before
        # the eager/traced split (``requires_grad`` is known while tracing), so both agree.
        return execution.run(q, k, v, None, mask4, execution.unpackable(policy, GRAD_MASK_REASON, mask4), opts)
    compiling = torch.compiler.is_compiling()
    if compiling:
        op.refuse_unsupported_compile()
    if mask is None and plan is None and policy.unmasked_is_sdpa:
        return execution.masked_sdpa(q, k, v, None, opts)  # no mask: SDPA (inside the graph when traced)
    if compiling:
        return op.attention(q, k, v, mask, plan=plan, convention=convention, opts=opts, policy=policy,
                            deferred=checks is not None)
    if _transformed(q, k, v, mask):  # eager only: dynamo traces under a functorch interpreter of its own
        r = execution.unpackable(policy, TRANSFORM_REASON, mask4)
        if mask4.is_floating_point() and policy.float_mask == "error":
            raise InputTypeError(
                "float_mask='error' reads a float mask's values on the host, which a torch.func transform "
                "cannot batch: pass a bool mask (True = keep), or choose float_mask='bool' or 'bias'")
        # Stock's route with the fallback's reason: a float 0/1 mask read as boolean is converted on the device.
        return execution.run(q, k, v, None, mask4, dataclasses.replace(execution.stock_route(mask4, policy),
                                                                       reason=r.reason), opts)
    if plan is None and execution.factorable(mask4, opts, policy, checks, q.shape[0]):
        return execution.attend_outer(q, k, v, mask4, opts, policy, checks)
    return execution.attend(q, k, v, mask4, opts, policy, plan)


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    backend: str | None = None,
    strict: bool = False,
    plan: VarlenPlan | None = None,
) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` that packs valid tokens.

    Args:
        query: ``[B, Hq, Sq, D]``; key: ``[B, Hkv, Sk, D]``; value: ``[B, Hkv, Sk, Dv]``, one
            floating dtype and device.
        attn_mask: None, bool (True = keep) or additive float, broadcastable to
            ``[B, Hq, Sq, Sk]`` exactly as for SDPA.
        backend: ``"auto"`` (default; or ``$VARLEN_ATTN_BACKEND``), ``"sdpa"``, or a varlen
            backend name; an explicit varlen backend runs or raises, never falls back.
        strict: raise :class:`NotPackableError` when the mask cannot be packed.
        plan: the plan of ``attn_mask`` if the caller already has it (skips the cache lookup).

    Returns:
        ``[B, Hq, Sq, Dv]`` in ``query.dtype``. Query rows with no valid key are zeros; a row
        whose keys all carry the same finite additive value attends to all of them (as SDPA).

    Equivalent PyTorch: ``F.scaled_dot_product_attention(query, key, value, attn_mask, ...)``.
    """
    return sdpa_with_policy(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                            policy=Policy.of(backend, strict), plan=plan)


_NO_DROPOUT = object()  # sdpa_with_policy's default dropout_p (0.0); not a float: see there


def sdpa_with_policy(query, key, value, attn_mask=None, dropout_p=_NO_DROPOUT, is_causal=False, scale=None,
                     enable_gqa=False, *, policy: Policy, plan: VarlenPlan | None = None,
                     checks=None) -> torch.Tensor:
    """:func:`scaled_dot_product_attention` with a ready :class:`~varlen_attn.policy.Policy`
    (what ``enable_varlen``'s SDPA calls, varlen_attn.hook). ``dropout_p``'s
    default stands for 0.0 and is no float: a float default read in traced code is an input of
    the graph when dynamo traces with ``dynamic=True``, and one read in a checkpointed body, then
    in a second, stopped dynamo ("lift_tracked_freevar_to_input should not be called on root
    SubgraphTracer"). An explicit None is refused, as SDPA refuses it. ``checks``: :func:`dispatch`."""
    if dropout_p is _NO_DROPOUT:
        dropout_p = 0.0
    dropout_p, scale, is_causal, enable_gqa = _check_options(dropout_p, scale, is_causal, enable_gqa)
    query, key, value, attn_mask = _autocast(query, key, value, attn_mask)
    _, sq, sk = _check_qkv(query, key, value, enable_gqa, "bhsd", attn_mask, plan)
    if is_causal and sq != sk and plan is not None:
        # SDPA's causal part is top-left aligned; a plan packs bottom-right-aligned causal segments.
        if attn_mask is None:
            raise InputValueError(
                f"plan with is_causal=True needs Sq == Sk (SDPA aligns is_causal top-left, a plan's "
                f"causal segments align bottom-right), got Sq={sq}, Sk={sk}: pass attn_mask instead "
                f"of plan, or use varlen_attn.attention (bottom-right)")
        plan = None  # the plan is attn_mask's alone; the mask below adds the causal part
    if attn_mask is not None and is_causal:
        if not MASK_WITH_CAUSAL:
            raise InputValueError(
                f"attn_mask and is_causal=True cannot both be set with torch {torch.__version__} "
                f"(its SDPA refuses them too), got both")
        if sq != sk:
            # SDPA: mask & tril, top-left aligned. Equal Sq and Sk keep the causal option, which
            # packs causal attention within self-aligned segments; top-left is bottom-right then.
            attn_mask = execution.causal_mask(attn_mask, sq, sk, query.device, top_left=True)
            is_causal = False
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if is_causal and sq != sk and attn_mask is None and plan is None:
        # SDPA's is_causal is top-left aligned; varlen kernels align bottom-right.
        if not policy.unmasked_is_sdpa:
            raise BackendUnavailableError(
                f"backend {policy.backend!r}: SDPA's is_causal is top-left aligned, varlen kernels "
                f"align bottom-right; they differ when Sq != Sk (got Sq={sq}, Sk={sk})"
            )
        tri = execution.causal_mask(None, sq, sk, query.device, top_left=True)
        out = execution.masked_sdpa(q, k, v, tri, Options(scale, False, dropout_p, enable_gqa))
        return out.transpose(1, 2)
    out = dispatch(q, k, v, attn_mask, convention="torch", plan=plan,
                   opts=Options(scale, is_causal, dropout_p, enable_gqa), policy=policy, checks=checks)
    return out.transpose(1, 2)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    plan: VarlenPlan | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    backend: str | None = None,
    strict: bool = False,
) -> torch.Tensor:
    """Masked attention on ``[B, S, H, D]`` tensors (flash-attn / diffusers layout).

    Args:
        query: ``[B, Sq, Hq, D]``; key: ``[B, Sk, Hkv, D]``; value: ``[B, Sk, Hkv, Dv]``.
        attn_mask: any layout of :func:`build_plan` (batch first: ``[B, Sk]`` is key padding,
            ``[B, 1, Sq, Sk]`` a full mask, ``[B*H, 1, Sk]`` diffusers' prepared mask).
        plan: a prebuilt :class:`VarlenPlan` (skips even the cache lookup); ``attn_mask`` is
            then only used if the plan is not packable.
        is_causal: bottom-right-aligned causal masking combined with the mask; packed when
            every segment's queries and keys are the same positions (self-attention).
        backend, strict: as in :func:`scaled_dot_product_attention`.

    Returns:
        ``[B, Sq, Hq, Dv]``; query rows with no valid key are zeros.

    Equivalent PyTorch: ``F.scaled_dot_product_attention(q.transpose(1, 2), ...,
    attn_mask=<mask as [B, 1, 1|Sq, Sk]>).transpose(1, 2)``.
    """
    dropout_p, scale, is_causal, enable_gqa = _check_options(dropout_p, scale, is_causal, enable_gqa)
    query, key, value, attn_mask = _autocast(query, key, value, attn_mask)
    _check_qkv(query, key, value, enable_gqa, "bshd", attn_mask, plan)
    return dispatch(query, key, value, attn_mask, convention="model", plan=plan,
                    opts=Options(scale, is_causal, dropout_p, enable_gqa), policy=Policy.of(backend, strict))
