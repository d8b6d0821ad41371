"""Reference implementation of flash-attention 2's ``flash_attn_varlen_func``.

This module is the oracle the project's kernels are checked against, and the
CPU backend. It favours being obviously correct over being fast: it loops over
the packed sequences in Python and computes each one densely.

Layout
    q: ``[total_q, Hq, D]``, k: ``[total_k, Hkv, D]``, v: ``[total_k, Hkv, Dv]``.
    Sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and
    rows ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of k and v. ``Hq`` must be a
    multiple of ``Hkv`` (GQA/MQA): query head ``h`` reads kv head
    ``h // (Hq // Hkv)``. Output: ``[total_q, Hq, Dv]``.

Dtype contract
    q, k and v share one floating dtype (any, not only fp16/bf16 as on the
    GPU). Arithmetic runs in ``torch.promote_types(q.dtype, torch.float32)``
    (float32 for half types, float64 for float64 inputs) and the output is
    cast back to ``q.dtype``. ``softmax_lse`` is always float32, ``[Hq,
    total_q]``, as in flash-attn 2's varlen path.

Equivalent PyTorch, per sequence ``b`` with lengths ``Lq``, ``Lk``::

    out_b = F.scaled_dot_product_attention(
        q_b.transpose(0, 1), k_b.transpose(0, 1), v_b.transpose(0, 1),
        attn_mask=mask_b, scale=softmax_scale, enable_gqa=True,
    ).transpose(0, 1)

where ``mask_b[i, j]`` is True iff ``i + Lk - Lq - left <= j <= i + Lk - Lq +
right`` (bottom-right aligned; ``causal`` forces ``right = 0``; -1 means
unbounded), plus softcap ``scores = softcap * tanh(scores / softcap)`` and the
ALiBi bias ``-slope * |i + Lk - Lq - j|``, both applied to the scaled scores.

Masked rows
    A query row that may see no key (e.g. ``causal`` with ``Lq > Lk``, a
    narrow window, or ``Lk == 0``) outputs zeros, gets zero gradient, and has
    ``softmax_lse == -inf`` (the log of an empty sum).

Known differences from the flash-attn 2 CUDA extension
    * LSE of an empty row: the CUDA kernel writes ``+inf`` (so that its
      backward recomputes ``exp(s - lse) == 0``); this reference returns
      ``-inf``, which is what ``torch.logsumexp`` gives. Outputs agree.
    * One-sided windows: flash-attn 2's host code replaces an unbounded side
      by ``max_seqlen_k`` when the other side is bounded, and treats a bound
      ``>= max_seqlen_k`` as unbounded. That only changes anything for
      sequences with ``Lq > max_seqlen_k + 1``; this reference always applies
      the formula above literally.
    * ALiBi with ``causal``: the CUDA kernel adds ``slope * j``, which differs
      from ``-slope * |i + Lk - Lq - j|`` by a per-row constant. Outputs and
      gradients agree; ``softmax_lse`` differs by that constant. This
      reference uses the symmetric form in both cases.
    * Validation is stricter: negative softcap, window sizes below -1,
      ``max_seqlen_*`` smaller than a real sequence, and malformed
      ``cu_seqlens`` are errors here rather than silent misbehaviour.
    * ``S_dmask`` is always ``None``; dropout draws from torch's CPU/CUDA RNG,
      so masks never match the CUDA kernel's Philox stream bit for bit.
"""

from __future__ import annotations

import numbers
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

__all__ = ["attention_ref", "flash_attn_varlen_func"]

_NEG_INF = float("-inf")


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------


def _shape(t: torch.Tensor) -> Tuple[int, ...]:
    return tuple(t.shape)


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_int(name: str, value: object) -> int:
    # bool is an int subclass; passing True as a length is always a bug.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    return int(value)


def _check_real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} ({value!r})")
    return float(value)


def _check_window_side(name: str, value: object) -> int:
    """One side of ``window_size``: an int (numpy integers and 0-d integer tensors too, as
    flash-attn's tests pass ``torch.randint(0, n, (2,))``), or None = unbounded (-1)."""
    if value is None:  # flash-attn 3 / cute spell "unbounded" as None
        return -1
    if isinstance(value, torch.Tensor):
        if value.ndim != 0 or value.dtype == torch.bool or value.is_floating_point() \
                or value.is_complex():
            raise TypeError(
                f"{name} must be an int, got a tensor of shape {_shape(value)}, dtype {value.dtype}"
            )
        value = int(value.item())
    w = _check_int(name, value)
    if w < -1:
        raise ValueError(f"{name} must be -1 (unbounded) or >= 0, got {w}")
    return w


def _check_window(window_size: object) -> Tuple[int, int]:
    """``(left, right)`` from a tuple or list of two sides, or a 1-D tensor of two integers."""
    if isinstance(window_size, torch.Tensor):
        if window_size.ndim != 1 or window_size.shape[0] != 2:
            raise ValueError(
                "window_size must be a pair (left, right), got a tensor of shape "
                f"{_shape(window_size)}"
            )
        sides = window_size.unbind(0)
    elif isinstance(window_size, (str, bytes)) or not isinstance(window_size, Sequence) \
            or len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    else:
        sides = window_size
    return (_check_window_side("window_size[0]", sides[0]),
            _check_window_side("window_size[1]", sides[1]))


def _check_cu_seqlens(name: str, cu: object, total: int, total_name: str,
                      device: torch.device) -> list:
    cu = _check_tensor(name, cu)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.ndim != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be a 1-D tensor of shape [batch + 1], got shape {_shape(cu)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on the same device as q ({device}), got {cu.device}")
    # One host sync per call: this is a reference, clarity beats speed.
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {values[0]}")
    for b in range(len(values) - 1):
        if values[b + 1] < values[b]:
            raise ValueError(
                f"{name} must be non-decreasing, got {name}[{b}] = {values[b]} > "
                f"{name}[{b + 1}] = {values[b + 1]}"
            )
    if values[-1] != total:
        raise ValueError(
            f"{name}[-1] must equal {total_name} = {total}, got {values[-1]}"
        )
    return values


def _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              dropout_p, softmax_scale, causal, window_size, softcap,
              alibi_slopes, return_attn_probs):
    """Check every argument; return host copies of the cu_seqlens and the window."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
        if t.ndim != 3:
            raise ValueError(
                f"{name} must be 3-D [total_tokens, num_heads, head_dim], got shape {_shape(t)}"
            )
    if not q.is_floating_point():
        raise TypeError(f"q must have a floating-point dtype, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have the same dtype as q ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on the same device as q ({q.device}), got {t.device}")

    total_q, num_heads_q, head_dim = _shape(q)
    total_k, num_heads_k, head_dim_k = _shape(k)
    if head_dim < 1:
        raise ValueError(f"q head_dim must be >= 1, got shape {_shape(q)}")
    if head_dim_k != head_dim:
        raise ValueError(
            f"k head_dim must equal q head_dim ({head_dim}), got k shape {_shape(k)}"
        )
    if v.shape[0] != total_k or v.shape[1] != num_heads_k:
        raise ValueError(
            f"v must have shape [{total_k}, {num_heads_k}, Dv] to match k, got {_shape(v)}"
        )
    if num_heads_k < 1 or num_heads_q % num_heads_k != 0:
        raise ValueError(
            "number of query heads must be a multiple of the number of key/value heads, "
            f"got q heads = {num_heads_q}, k heads = {num_heads_k}"
        )

    cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, "q.shape[0]", q.device)
    cu_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, "k.shape[0]", q.device)
    if len(cu_q) != len(cu_k):
        raise ValueError(
            "cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), "
            f"got {len(cu_q)} and {len(cu_k)}"
        )
    batch = len(cu_q) - 1

    # The CUDA kernel sizes its grid from max_seqlen_*; a longer sequence would
    # be silently truncated or read out of bounds, so refuse it here.
    for name, declared, cu in (("max_seqlen_q", max_seqlen_q, cu_q),
                               ("max_seqlen_k", max_seqlen_k, cu_k)):
        declared = _check_int(name, declared)
        actual = max((cu[b + 1] - cu[b] for b in range(batch)), default=0)
        if declared < actual:
            raise ValueError(
                f"{name} must be >= the longest sequence ({actual}), got {declared}"
            )

    dropout_p = _check_real("dropout_p", dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if softmax_scale is not None:
        _check_real("softmax_scale", softmax_scale)
    softcap = _check_real("softcap", softcap)
    if softcap < 0.0:
        raise ValueError(f"softcap must be >= 0 (0 disables it), got {softcap}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(return_attn_probs, bool):
        raise TypeError(
            f"return_attn_probs must be a bool, got {type(return_attn_probs).__name__}"
        )

    left, right = _check_window(window_size)

    if alibi_slopes is not None:
        _check_tensor("alibi_slopes", alibi_slopes)
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
        if _shape(alibi_slopes) not in ((num_heads_q,), (batch, num_heads_q)):
            raise ValueError(
                f"alibi_slopes must have shape [{num_heads_q}] or [{batch}, {num_heads_q}], "
                f"got {_shape(alibi_slopes)}"
            )
        if alibi_slopes.device != q.device:
            raise ValueError(
                f"alibi_slopes must be on the same device as q ({q.device}), got {alibi_slopes.device}"
            )

    return cu_q, cu_k, (left, right), dropout_p, softcap


# --------------------------------------------------------------------------
# Core
# --------------------------------------------------------------------------


def _allowed_keys(len_q: int, len_k: int, causal: bool, window: Tuple[int, int],
                  device: torch.device) -> torch.Tensor:
    """Bool ``[len_q, len_k]``: may query ``i`` attend to key ``j``."""
    left, right = window
    if causal:
        right = 0  # flash-attn 2 overrides the right window under causal
    i = torch.arange(len_q, device=device).unsqueeze(1)
    j = torch.arange(len_k, device=device).unsqueeze(0)
    # Bottom-right alignment: the last query sits on the last key, so that
    # decoding (len_q < len_k) sees the whole prefix.
    diag = i + (len_k - len_q)
    allowed = torch.ones(len_q, len_k, dtype=torch.bool, device=device)
    if right >= 0:
        allowed &= j <= diag + right
    if left >= 0:
        allowed &= j >= diag - left
    return allowed


def _attend_one(q_b, k_b, v_b, *, scale, softcap, allowed, slopes, dropout_p, acc_dtype):
    """Dense attention for one sequence.

    q_b ``[Lq, Hq, D]``, k_b ``[Lk, Hkv, D]``, v_b ``[Lk, Hkv, Dv]`` in the
    input dtype. Returns ``out [Lq, Hq, Dv]`` and ``lse [Hq, Lq]``, both in
    ``acc_dtype``.
    """
    len_q, num_heads_q, _ = q_b.shape
    len_k, num_heads_k, _ = k_b.shape
    group = num_heads_q // num_heads_k

    qh = q_b.to(acc_dtype).transpose(0, 1)  # [Hq, Lq, D]
    kh = k_b.to(acc_dtype).transpose(0, 1)  # [Hkv, Lk, D]
    vh = v_b.to(acc_dtype).transpose(0, 1)  # [Hkv, Lk, Dv]
    if group > 1:
        # repeat_interleave puts kv head g at rows g*group .. g*group+group-1,
        # i.e. query head h reads kv head h // group.
        kh = kh.repeat_interleave(group, dim=0)
        vh = vh.repeat_interleave(group, dim=0)

    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # [Hq, Lq, Lk]
    if softcap > 0.0:
        scores = softcap * torch.tanh(scores / softcap)
    if slopes is not None:
        i = torch.arange(len_q, device=q_b.device).unsqueeze(1)
        j = torch.arange(len_k, device=q_b.device).unsqueeze(0)
        distance = (i + (len_k - len_q) - j).abs().to(acc_dtype)  # [Lq, Lk]
        scores = scores - slopes.to(acc_dtype).view(-1, 1, 1) * distance

    scores = scores.masked_fill(~allowed, _NEG_INF)
    # LSE is a by-product (flash returns it without a gradient path).
    lse = torch.logsumexp(scores.detach(), dim=-1)  # [Hq, Lq]; -inf on empty rows

    # softmax over an all -inf row is NaN, and NaN would leak into gradients
    # even after being zeroed. Give empty rows a finite dummy row, then zero
    # every disallowed probability: those rows output 0 and, because
    # masked_fill's backward drops the filled positions, receive no gradient.
    empty_row = ~allowed.any(dim=-1, keepdim=True)  # [Lq, 1]
    scores = scores.masked_fill(empty_row, 0.0)
    probs = torch.softmax(scores, dim=-1).masked_fill(~allowed, 0.0)

    if dropout_p > 0.0:
        # Dropout acts on the normalised probabilities and rescales by
        # 1 / (1 - p), exactly where flash-attn 2 applies it; the LSE is
        # computed before dropout, as in flash.
        probs = F.dropout(probs, p=dropout_p, training=True)

    out = torch.matmul(probs, vh)  # [Hq, Lq, Dv]
    return out.transpose(0, 1), lse


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Union[Tuple[int, int], Sequence[int], torch.Tensor] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
    """Variable-length multi-head attention with flash-attn 2's signature.

    Args:
        q: ``[total_q, Hq, D]`` packed queries.
        k: ``[total_k, Hkv, D]`` packed keys; ``Hq % Hkv == 0``.
        v: ``[total_k, Hkv, Dv]`` packed values (``Dv`` may differ from ``D``).
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]`` prefix sums of the
            sequence lengths, starting at 0 and ending at ``total_q`` /
            ``total_k``. Lengths may be zero.
        max_seqlen_q, max_seqlen_k: upper bounds on the sequence lengths.
        dropout_p: dropout probability on the attention probabilities.
        softmax_scale: defaults to ``D ** -0.5``.
        causal: bottom-right aligned causal mask (same as ``window_size[1] = 0``).
        window_size: ``(left, right)`` local window, -1 = unbounded. A tuple or list of
            two ints (numpy integers and 0-d integer tensors count as ints), or a 1-D integer
            tensor of two elements, as flash-attn's tests pass (``torch.randint(0, n, (2,))``;
            a tensor is read on the host). ``None`` for a side means unbounded, as in
            flash-attn 3 / cute; flash-attn 2 itself wants -1.
        softcap: if > 0, ``scores = softcap * tanh(scores / softcap)``.
        alibi_slopes: float32 ``[Hq]`` or ``[batch, Hq]``.
        deterministic: accepted for API compatibility and ignored. In flash-attn
            2 it selects a backward pass without atomic adds on dq; here the
            backward is plain autograd over dense per-sequence ops, which has no
            split reductions to order.
        return_attn_probs: also return ``softmax_lse`` and ``S_dmask``.

    Returns:
        ``out`` ``[total_q, Hq, Dv]`` in ``q.dtype``; with
        ``return_attn_probs=True``, ``(out, softmax_lse, None)`` where
        ``softmax_lse`` is float32 ``[Hq, total_q]`` (natural log, of the scaled,
        softcapped, biased, masked scores; ``-inf`` for rows with no key) and
        carries no gradient.
    """
    del deterministic  # see docstring
    cu_q, cu_k, window, dropout_p, softcap = _validate(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        return_attn_probs,
    )
    total_q, num_heads_q, head_dim = q.shape
    head_dim_v = v.shape[-1]
    scale = head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)
    acc_dtype = torch.promote_types(q.dtype, torch.float32)

    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        q_b = q[cu_q[b]:cu_q[b + 1]]
        k_b = k[cu_k[b]:cu_k[b + 1]]
        v_b = v[cu_k[b]:cu_k[b + 1]]
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes[b] if alibi_slopes.ndim == 2 else alibi_slopes
        allowed = _allowed_keys(q_b.shape[0], k_b.shape[0], causal, window, q.device)
        out_b, lse_b = _attend_one(
            q_b, k_b, v_b, scale=scale, softcap=softcap, allowed=allowed,
            slopes=slopes, dropout_p=dropout_p, acc_dtype=acc_dtype,
        )
        outs.append(out_b)
        lses.append(lse_b)

    if outs:
        # torch.cat (rather than writes into a preallocated buffer) keeps the
        # graph differentiable; segments tile q exactly because cu_seqlens_q
        # was checked to start at 0, be monotone and end at total_q.
        out = torch.cat(outs, dim=0).to(q.dtype)
        lse = torch.cat(lses, dim=1).float()
    else:  # batch == 0, hence total_q == 0
        out = q.new_zeros(0, num_heads_q, head_dim_v)
        lse = torch.zeros(num_heads_q, 0, dtype=torch.float32, device=q.device)

    if return_attn_probs:
        return out, lse, None
    return out


# --------------------------------------------------------------------------
# Dense reference (torch SDPA layout)
# --------------------------------------------------------------------------


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    causal: bool = False,
    scale: Optional[float] = None,
    upcast: bool = True,
) -> torch.Tensor:
    """Dense attention over ``[B, H, S, D]`` tensors, with an explicit softmax.

    Mirrors ``torch.nn.functional.scaled_dot_product_attention`` (torch >= 2.5):

    * q ``[B, Hq, Sq, D]``, k ``[B, Hkv, Sk, D]``, v ``[B, Hkv, Sk, Dv]``;
      ``Hq != Hkv`` behaves like ``enable_gqa=True``.
    * ``mask`` broadcastable to ``[B, Hq, Sq, Sk]``: bool True = keep, float =
      added to the scaled scores.
    * ``causal`` is TOP-LEFT aligned like SDPA (``j <= i``), unlike
      :func:`flash_attn_varlen_func`'s bottom-right alignment; the two agree
      when ``Sq == Sk``. Pass an explicit bool mask for bottom-right. ``causal``
      and ``mask`` may be combined (SDPA refuses that; here they intersect).
    * Rows with no finite score output zeros and get zero gradient.
    * ``upcast=True`` computes in ``promote_types(dtype, float32)``; False keeps
      the input dtype throughout (useful to model a low-precision kernel).
      The result is returned in ``q.dtype``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
        if t.ndim != 4:
            raise ValueError(f"{name} must be 4-D [B, H, S, D], got shape {_shape(t)}")
    num_heads_q, num_heads_k = q.shape[1], k.shape[1]
    if num_heads_k < 1 or num_heads_q % num_heads_k != 0:
        raise ValueError(
            "number of query heads must be a multiple of the number of key/value heads, "
            f"got q heads = {num_heads_q}, k heads = {num_heads_k}"
        )
    compute_dtype = torch.promote_types(q.dtype, torch.float32) if upcast else q.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)

    qc, kc, vc = (t.to(compute_dtype) for t in (q, k, v))
    group = num_heads_q // num_heads_k
    if group > 1:
        kc = kc.repeat_interleave(group, dim=1)
        vc = vc.repeat_interleave(group, dim=1)

    scores = torch.matmul(qc, kc.transpose(-1, -2)) * scale  # [B, Hq, Sq, Sk]
    len_q, len_k = scores.shape[-2:]
    if causal:
        keep = torch.ones(len_q, len_k, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, _NEG_INF)
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, _NEG_INF)
        else:
            scores = scores + mask.to(compute_dtype)

    # Same empty-row handling as _attend_one: finite dummy row, then zero
    # the probabilities that were never allowed.
    allowed = scores.detach() > _NEG_INF
    empty_row = ~allowed.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(empty_row, 0.0)
    probs = torch.softmax(scores, dim=-1).masked_fill(~allowed, 0.0)
    return torch.matmul(probs, vc).to(q.dtype)


def same_segment(rows_q: int, rows_k: int, cu_seqlens_q, cu_seqlens_k):
    """``[rows_q, rows_k]`` bool: packed query row ``i`` and key row ``j`` lie in the same
    sequence. Rows past ``cu_seqlens[-1]`` lie in none (they see, and are seen by, nothing)."""
    device = cu_seqlens_q.device
    ids_q, ids_k = torch.arange(rows_q, device=device), torch.arange(rows_k, device=device)
    seg_q = torch.where(ids_q < cu_seqlens_q[-1], torch.bucketize(ids_q, cu_seqlens_q[1:].long(), right=True), -1)
    seg_k = torch.where(ids_k < cu_seqlens_k[-1], torch.bucketize(ids_k, cu_seqlens_k[1:].long(), right=True), -2)
    return seg_q[:, None] == seg_k[None, :]


def varlen_attention_dense(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale):
    """The same attention (no causal, window, softcap or ALiBi) as one dense computation over
    every packed row, for code that must be traced (``torch.compile``) rather than loop on the
    host: row ``i`` of q sees row ``j`` of k exactly when both lie in the same sequence. Rows past
    ``cu_seqlens_q[-1]`` / ``cu_seqlens_k[-1]`` belong to no sequence (they may hold anything):
    their output is zeros and they are never read as keys. Quadratic in the rows: a test oracle."""
    see = same_segment(q.shape[0], k.shape[0], cu_seqlens_q, cu_seqlens_k)
    work = torch.promote_types(q.dtype, torch.float32)
    qt, kt, vt = (t.to(work).transpose(0, 1) for t in (q, k, v))
    kt = kt.repeat_interleave(q.shape[1] // k.shape[1], dim=0)
    vt = vt.repeat_interleave(q.shape[1] // v.shape[1], dim=0)
    scores = (qt @ kt.transpose(1, 2)) * softmax_scale
    sees = see.any(dim=1)[:, None]  # rows that see some key; the others output zeros, with no NaN
    scores = torch.where(sees, scores.masked_fill(~see, float("-inf")), 0.0)
    probs = torch.where(sees, torch.softmax(scores, dim=-1), 0.0)
    return (probs @ vt).transpose(0, 1).to(q.dtype)
