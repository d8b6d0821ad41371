"""The functional entries: masked attention computed by packing valid tokens.

* :func:`scaled_dot_product_attention`: a drop-in for ``torch.nn.functional``'s, layout
  ``[B, H, S, D]``, the mask broadcast exactly as SDPA broadcasts it.
* :func:`attention`: layout ``[B, S, H, D]`` (flash-attn's and diffusers' dispatch layout),
  masks read batch first (``[B, Sk]`` is key padding), and a prebuilt plan may be passed.

Both: packable mask -> plan (cached per mask object) -> pack -> varlen kernel -> unpack;
otherwise masked SDPA, with the reason recorded in :func:`varlen_attn.stats`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from . import _stats
from ._errors import BackendUnavailableError, InputTypeError, InputValueError, NotPackableError, describe
from .kernels import SDPA, VarlenInputs, requested_backend, select
from .kernels._base import empty_output
from .compiled import compiled_attend
from .fused import FusedAttention
from .masks import canonical_mask
from .pack import pack_qkv, unpack
from .plan import VarlenPlan, build_plan, full_plan


# Backends with their own backward run pack + kernel + unpack as one autograd node
# (varlen_attn.fused); False composes pack_qkv, the backend's autograd forward and unpack (the
# first version). Selectable for the side-by-side benchmark; results are identical.
FUSED = True


def _check_qkv(query, key, value, enable_gqa: bool, layout: str):
    """Validate and return ``(B, Sq, Sk, Hq, Hkv)``; ``layout`` is ``"bhsd"`` or ``"bshd"``."""
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
    return b, sq, sk, hq, hk


def _check_options(dropout_p, scale):
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise InputValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise InputTypeError(f"scale must be a float or None, got {describe(scale)}")


def _causal_mask(mask4: torch.Tensor | None, sq: int, sk: int, device) -> torch.Tensor:
    """``mask4`` restricted to bottom-right-aligned causal positions (bool, broadcastable)."""
    tri = torch.ones(sq, sk, dtype=torch.bool, device=device).tril(sk - sq)
    if mask4 is None:
        return tri
    if mask4.dtype == torch.bool:
        return mask4 & tri
    return mask4.masked_fill(~tri, float("-inf"))


def _masked_sdpa(q, k, v, mask4, dropout_p, causal, scale, gqa, reason):
    """The fallback on padded ``[B, S, H, D]`` tensors, with ``reason`` recorded if given."""
    if reason is not None:
        _stats.record_fallback(reason)
    _stats.record_backend(SDPA)
    sq, sk = q.shape[1], k.shape[1]
    if causal and (mask4 is not None or sq != sk):
        mask4, causal = _causal_mask(mask4, sq, sk, q.device), False
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask4,
        dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=gqa,
    )
    return out.transpose(1, 2)


def _sdpa_mask(plan: VarlenPlan, mask4: torch.Tensor | None) -> torch.Tensor | None:
    """The mask as SDPA must see it. Converted only on the SDPA paths: the packed path never
    reads the mask, so a float 0/1 mask read as boolean costs nothing per packed layer."""
    return mask4 != 0 if plan.read_as_bool and mask4 is not None else mask4


def _route(q, k, v, plan, mask4, *, dropout_p, causal, scale, gqa, backend, strict):
    """Where a call goes: ``(impl, None, probe)`` for a varlen backend, ``(None, reason, None)``
    for masked SDPA (``reason`` None when SDPA was asked for). Raises where the caller's choice
    cannot be honoured. ``probe`` holds per-token views (selection reads heads, head dim,
    dtype and device only), the plan and the options."""
    name = backend
    reason = None
    if not plan.packable:
        reason = plan.reason
    elif causal and not (plan.self_aligned or (plan.q_identity and plan.k_identity)):
        reason = "causal with queries and keys in different segment positions"
    if reason is not None:
        if strict:
            raise NotPackableError(reason)
        if name not in ("auto", SDPA):
            raise BackendUnavailableError(f"backend {name!r} needs a packable mask: {reason}")
        if mask4 is None and not plan.packable:
            raise InputValueError(f"plan is not packable ({reason}); pass attn_mask so SDPA can run")
        return None, (reason if name == "auto" else None), None
    if name == SDPA:
        return None, None, None
    if q.device != plan.device:
        raise InputValueError(f"plan was built on {plan.device}, query is on {q.device}")
    probe = VarlenInputs(
        q=q.select(1, 0), k=k.select(1, 0), v=v.select(1, 0), plan=plan,
        scale=q.shape[-1] ** -0.5 if scale is None else float(scale),
        causal=causal, dropout_p=float(dropout_p),
    )
    return select(probe, name), None, probe


def _fusable(impl, plan, dropout_p) -> bool:
    return FUSED and impl.NATIVE_BACKWARD and plan.total_q > 0 and not dropout_p


def _attend(q, k, v, plan, mask4, *, dropout_p, causal, scale, gqa, backend, strict):
    """Core on ``[B, S, H, D]`` tensors: the varlen path, or masked SDPA with the reason.
    ``backend`` is already resolved by the caller (``requested_backend``)."""
    route = _route(q, k, v, plan, mask4, dropout_p=dropout_p, causal=causal, scale=scale, gqa=gqa,
                   backend=backend, strict=strict)
    return _execute(q, k, v, plan, mask4, route, dropout_p=dropout_p, causal=causal, scale=scale, gqa=gqa)


def _execute(q, k, v, plan, mask4, route, *, dropout_p, causal, scale, gqa):
    """Run what :func:`_route` decided."""
    impl, reason, probe = route
    if impl is None:
        return _masked_sdpa(q, k, v, _sdpa_mask(plan, mask4), dropout_p, causal, scale, gqa, reason)
    _stats.record_backend(impl.NAME)
    if _fusable(impl, plan, dropout_p):
        return FusedAttention.apply(q, k, v, plan, impl, probe.scale, causal)
    qp, kp, vp = pack_qkv(q, k, v, plan)
    inp = dataclasses.replace(probe, q=qp, k=kp, v=vp)
    # Every query masked (caption dropout on a whole batch): nothing for a kernel to do.
    out = empty_output(inp) if plan.total_q == 0 else impl.forward(inp)
    return unpack(out, plan, "q")


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
    b, sq, sk, hq, _ = _check_qkv(query, key, value, enable_gqa, "bhsd")
    _check_options(dropout_p, scale)
    if attn_mask is not None and is_causal:
        raise InputValueError("attn_mask and is_causal=True cannot both be set (as in SDPA), got both")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if torch.compiler.is_compiling() and (attn_mask is not None or plan is not None or
                                          backend not in (None, "auto", SDPA)):
        out = compiled_attend(q, k, v, attn_mask, plan=plan, convention="torch", dropout_p=dropout_p,
                              causal=is_causal, scale=scale, gqa=enable_gqa, backend=backend, strict=strict)
        return out.transpose(1, 2)
    name = requested_backend(backend)
    if attn_mask is None:
        if name in ("auto", SDPA) and not strict:
            _stats.record_backend(SDPA)
            return F.scaled_dot_product_attention(
                query, key, value, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa,
            )
        if is_causal and sq != sk:
            raise BackendUnavailableError(
                f"backend {name!r}: SDPA's is_causal is top-left aligned, varlen kernels align "
                f"bottom-right; they differ when Sq != Sk (got Sq={sq}, Sk={sk})"
            )
        plan, mask4 = full_plan(b, sq, sk, query.device), None
    else:
        if plan is None:
            plan = build_plan(attn_mask, batch_size=b, seqlen_q=sq, seqlen_k=sk, num_heads=hq,
                              convention="torch")
        mask4 = canonical_mask(attn_mask, batch_size=b, num_heads=hq, seqlen_q=sq, seqlen_k=sk,
                               convention="torch")
    out = _attend(q, k, v, plan, mask4, dropout_p=dropout_p, causal=is_causal, scale=scale,
                  gqa=enable_gqa, backend=name, strict=strict)
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
    b, sq, sk, hq, _ = _check_qkv(query, key, value, enable_gqa, "bshd")
    _check_options(dropout_p, scale)
    if plan is not None and not isinstance(plan, VarlenPlan):
        raise InputTypeError(f"plan must be a VarlenPlan or None, got {describe(plan)}")
    if plan is not None and (plan.batch_size, plan.seqlen_q, plan.seqlen_k) != (b, sq, sk):
        raise InputValueError(
            f"plan was built for B={plan.batch_size}, Sq={plan.seqlen_q}, Sk={plan.seqlen_k}, "
            f"got query {tuple(query.shape)} and key {tuple(key.shape)} ([B, S, H, D])"
        )
    if torch.compiler.is_compiling() and (attn_mask is not None or plan is not None or
                                          backend not in (None, "auto", SDPA)):
        return compiled_attend(query, key, value, attn_mask, plan=plan, convention="model",
                               dropout_p=dropout_p, causal=is_causal, scale=scale, gqa=enable_gqa,
                               backend=backend, strict=strict)
    name = requested_backend(backend)
    mask4 = None
    if attn_mask is not None:
        mask4 = canonical_mask(attn_mask, batch_size=b, num_heads=hq, seqlen_q=sq, seqlen_k=sk)
    if plan is None:
        if attn_mask is None and name in ("auto", SDPA) and not strict:
            return _masked_sdpa(query, key, value, None, dropout_p, is_causal, scale, enable_gqa, None)
        plan = (full_plan(b, sq, sk, query.device) if attn_mask is None else
                build_plan(attn_mask, batch_size=b, seqlen_q=sq, seqlen_k=sk, num_heads=hq))
    return _attend(query, key, value, plan, mask4, dropout_p=dropout_p, causal=is_causal,
                   scale=scale, gqa=enable_gqa, backend=name, strict=strict)

