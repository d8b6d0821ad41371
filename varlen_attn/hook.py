"""Which SDPA calls varlen_attn answers: those made while an enabled model (or a wrapped
processor) is running on the calling thread.

:func:`install` replaces ``torch.nn.functional.scaled_dot_product_attention`` once per process
with :func:`_sdpa`. It answers a call with varlen_attn only when this thread is inside an enabled
forward or attention module (:class:`~varlen_attn.execution.active`, a thread-local stack kept in
:mod:`varlen_attn.execution`, below the custom op that reads it too); every other call goes, as it
was, to the function it replaced (torch's, or a patch another library made before). No other
torch function runs Python of ours, and a call's route depends on its arguments and the policy
only.

Under ``torch.compile`` the same code is traced: dynamo reads the thread-local stack while
tracing and guards on it, so a graph traced inside an enabled forward holds varlen_attn's route
and one traced outside holds stock SDPA.
"""

from __future__ import annotations

import threading

import torch

from . import _stats, costs
from .execution import Entry, call_checks, current, ensure_thread_state
from .functional import sdpa_with_policy
from .kernels import SDPA, TORCH_SDPA


_replaced = [TORCH_SDPA]  # what _sdpa passes calls on to: the function it replaced


def _sdpa(*args, **kwargs):
    entry = current()
    mask = kwargs.get("attn_mask") if len(args) < 4 else args[3]
    # No mask: the function replaced, untouched and not counted (it already is the fastest path);
    # likewise a call auto leaves to stock by cost, which stock checks and runs.
    if entry is None or mask is None:
        return _replaced[0](*args, **kwargs)
    out = _left_to_stock(entry, args, kwargs, mask)
    if out is not None:
        return out
    checks = call_checks(entry.checks, mask, entry.policy)
    return sdpa_with_policy(*args, **kwargs, policy=entry.policy, checks=checks)


def _left_to_stock(entry: Entry, args, kwargs, mask):
    """The output where auto routes this eager call to stock's masked SDPA by cost
    (:mod:`varlen_attn.costs`), else None: decided here, before any check or conversion of ours,
    so that such a call costs a lookup over stock. Only where the mask reaches SDPA as stock reads
    it (bool, or float under ``float_mask="bias"``), or else in place of a mask of the shape of
    the outer product of the forward's model mask (bool, or float 0/1 where the model's is, read
    as bool; :meth:`varlen_attn.execution.Deferred.factors`; recomputed in backward without it,
    the call's own rows: :func:`~varlen_attn.execution.call_checks`), its check kept for the
    forward's read, as in :func:`varlen_attn.execution.attend_outer`: that boolean outer product,
    or where stock's kernel fails on rows (:func:`varlen_attn.costs.cudnn_rows_fail`) its keys'
    mask, the rows then scaled. Every other call takes the full path, which decides the same way."""
    policy = entry.policy
    if policy.backend != "auto" or not isinstance(mask, torch.Tensor) or torch.compiler.is_compiling():
        return None
    n = len(args)
    q = args[0] if n > 0 else kwargs.get("query")
    k = args[1] if n > 1 else kwargs.get("key")
    v = args[2] if n > 2 else kwargs.get("value")
    if ((args[5] if n > 5 else kwargs.get("is_causal", False)) is not False
            or not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor))):
        return None
    qs, ks, vs = q.shape, k.shape, v.shape
    if not len(qs) == len(ks) == len(vs) == 4:
        return None
    layout = costs.layout_of(mask.shape)
    as_bool = mask.is_floating_point() and policy.float_mask != "bias"  # stock would read a bias
    if as_bool and layout != "outer":
        return None
    found = costs.decide(q.device, q.dtype, qs[1], ks[1], qs[3], vs[3], qs[2], ks[2], layout)
    if found.stock and not as_bool:
        _stats.record_route(found.reason, SDPA)
        return _replaced[0](*args, **kwargs)
    if entry.checks is None or layout != "outer" or not qs[2] == ks[2] == mask.shape[-1]:
        return None
    # Weighed as an outer mask and as its keys' mask, a call differs only where stock's kernel
    # fails on rows (both on costs.CURVES; costs.cudnn_rows_fail): there stock gets the keys' mask.
    rows_fail = not found.stock
    if rows_fail:
        found = costs.decide(q.device, q.dtype, qs[1], ks[1], qs[3], vs[3], qs[2], ks[2], "key_padding")
        if not found.stock:
            return None
    checks = call_checks(entry.checks, mask, policy)
    made = checks.factors(mask, qs[0]) if (checks.float01 if as_bool else mask.dtype == torch.bool) else None
    if made is None:  # the full path, with the checks made here (a recomputation's: not made twice)
        return sdpa_with_policy(*args, **kwargs, policy=policy, checks=checks)
    _stats.record_route(found.reason, SDPA)
    outer, keys = made
    bad = mask.ne(outer).any()
    if n > 3:
        args = (*args[:3], keys if rows_fail else outer, *args[4:])
    else:
        kwargs = {**kwargs, "attn_mask": keys if rows_fail else outer}
    out = _replaced[0](*args, **kwargs)
    if rows_fail:
        return out * checks.checked(checks.rows(out.dtype, bhsd=True), bad)
    return checks.checked(out, bad)


_sdpa.__doc__ = TORCH_SDPA.__doc__
_sdpa.__name__ = _sdpa.__qualname__ = "scaled_dot_product_attention"
_install_lock = threading.Lock()


def install() -> None:
    """Route ``F.scaled_dot_product_attention`` through :func:`_sdpa`, once per process."""
    ensure_thread_state()
    functional = torch.nn.functional
    with _install_lock:
        if functional.scaled_dot_product_attention is not _sdpa:
            _replaced[0] = functional.scaled_dot_product_attention
            functional.scaled_dot_product_attention = _sdpa


def installed() -> bool:
    """``F.scaled_dot_product_attention`` is still :func:`_sdpa` (another library may have
    replaced it since, without passing calls on)."""
    return torch.nn.functional.scaled_dot_product_attention is _sdpa
