"""Bad input: one exception family, the argument named, expected and received stated."""

from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import varlen_attn as va

q = torch.randn(2, 4, 6, 8)
k = torch.randn(2, 4, 6, 8)
v = torch.randn(2, 4, 6, 8)
sdpa = va.scaled_dot_product_attention


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: sdpa(q.numpy(), k, v), TypeError, "query must be a torch.Tensor"),
        (lambda: sdpa(q[0], k, v), ValueError, r"query must be 4-D \[B, H, S, D\], got shape \(4, 6, 8\)"),
        (lambda: sdpa(q.int(), k.int(), v.int()), TypeError, "query must be floating point"),
        (lambda: sdpa(q, k.double(), v), TypeError, "must share a dtype"),
        (lambda: sdpa(q, k[:1], v[:1]), ValueError, "share the batch size, got 2, 1"),
        (lambda: sdpa(q, k, v[:, :, :5]), ValueError, "value must match key"),
        (lambda: sdpa(q, k[..., :4], v), ValueError, "head dim must equal"),
        (lambda: sdpa(q, k[:, :3], v[:, :3], enable_gqa=True), ValueError, "multiple of key heads"),
        (lambda: sdpa(q, k[:, :2], v[:, :2]), ValueError, "enable_gqa=True"),
        (lambda: sdpa(q, k, v, torch.ones(2, 1, 1, 5, dtype=torch.bool)), ValueError, "does not broadcast"),
        (lambda: sdpa(q, k, v, torch.ones(3, 1, 1, 6, dtype=torch.bool)), ValueError, "dim 0 is 3, expected 2 or 1"),
        (lambda: sdpa(q, k, v, torch.ones(2, 6, dtype=torch.int64)), TypeError, "attn_mask must be bool"),
        (lambda: sdpa(q, k, v, torch.tensor([0.0, float("nan"), 0, 0, 0, 0])), ValueError, "must not contain NaN"),
        (lambda: sdpa(q, k, v, torch.tensor([0.0, float("inf"), 0, 0, 0, 0])), ValueError, r"must not contain \+inf"),
        (lambda: sdpa(q, k, v, dropout_p=1.5), ValueError, r"dropout_p must be in \[0, 1\], got 1\.5"),
        (lambda: sdpa(q, k, v, scale="x"), TypeError, "scale must be a float"),
        (lambda: sdpa(q, k, v, backend="fa9"), ValueError, "backend must be 'auto'"),
        (lambda: sdpa(q, k, v, attn_mask=[True] * 6), TypeError, "attn_mask must be a torch.Tensor"),
        (lambda: va.attention(q, k, v, plan="plan"), TypeError, "plan must be a VarlenPlan"),
        (lambda: va.attention(q, k, v, plan=va.plan_from_seqlens([1, 2], seqlen_q=3)), ValueError, "plan was built for B=2, Sq=3"),
        (lambda: va.build_plan(None), ValueError, "needs batch_size and seqlen_q"),
        (lambda: va.build_plan(torch.tensor(True)), ValueError, "attn_mask must have a key dim"),
        (lambda: va.build_plan(torch.ones(2, 0, dtype=torch.bool)), ValueError, r"attn_mask must have a key dim.*shape \(2, 0\)"),
        (lambda: va.build_plan(torch.ones(2, 4, dtype=torch.bool, device="meta")), ValueError, "attn_mask must hold data"),
        (lambda: va.build_plan(torch.ones(2, 4, dtype=torch.bool), batch_size=2.0), TypeError, "batch_size must be an int, got float 2.0"),
        (lambda: va.build_plan(None, batch_size=-1, seqlen_q=3), ValueError, "batch_size must be >= 0, got -1"),
        (lambda: va.build_plan(torch.ones(2, 4, dtype=torch.bool), num_heads=0), ValueError, "num_heads must be >= 1, got 0"),
        (lambda: va.build_plan(torch.ones(2, 4, dtype=torch.bool), seqlen_q=True), TypeError, "seqlen_q must be an int, got bool"),
        (lambda: va.build_plan(torch.ones(2, 4, dtype=torch.bool), strict=1), TypeError, "strict must be a bool, got int 1"),
        (lambda: va.build_plan(torch.ones(2, 4, dtype=torch.bool), cache="no"), TypeError, "cache must be a bool, got str"),
        (lambda: va.build_plan(torch.ones(2, 4), float01_as_bool=None), TypeError, "float01_as_bool must be a bool"),
        (lambda: va.plan_from_seqlens([1, 2], [1]), ValueError, "seqlens_q and seqlens_k must have the same length"),
        (lambda: va.plan_from_seqlens([4], seqlen_q=3), ValueError, "exceeds the padded length"),
        (lambda: va.pack(torch.randn(2, 5, 3), va.plan_from_seqlens([1, 2], seqlen_q=4)), ValueError, r"x must be \[B, S, ...\] with B=2, S=4"),
        (lambda: va.pack(torch.randn(2, 4), va.plan_from_seqlens([1, 2], seqlen_q=4), "v"), ValueError, "which must be 'q'"),
    ],
)
def test_bad_input_raises_named_error(call, exc, match):
    with pytest.raises(va.VarlenAttnError, match=match) as info:
        call()
    assert isinstance(info.value, exc)


def test_explicit_backend_never_falls_back_silently():
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    with pytest.raises(va.BackendUnavailableError, match="needs a packable mask"):
        sdpa(q, k, v, causal, backend="split_sdpa")
    with pytest.raises(va.BackendUnavailableError, match="top-left"):
        sdpa(q[:, :, :3], k, v, is_causal=True, backend="reference")


def test_not_packable_plan_without_mask_is_an_error():
    plan = va.build_plan(torch.ones(6, 6, dtype=torch.bool).tril()[None, None], convention="torch")
    assert not plan.packable
    with pytest.raises(va.InputValueError, match="pass attn_mask"):
        va.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), plan=va.build_plan(
            torch.ones(6, 6, dtype=torch.bool).tril()[None].expand(2, 6, 6)))


_OPTION_VALUES = {
    # what torch's argument parser takes for SDPA's float parameters, what it refuses, and some
    # values in between (numpy scalars, 0-d tensors, bools)
    "dropout_p": [0.0, 0, np.float32(0.0), np.float64(0.0), np.False_, np.array(0.0), Fraction(0), torch.tensor(0.0), torch.tensor(0),
                  None, "0", 1.5, -0.1, 1.0, np.float32(1.0), torch.zeros(1), torch.tensor(0.0, requires_grad=True)],
    "scale": [0.5, 1, np.float32(0.5), np.int64(2), np.True_, np.array(0.5), Fraction(1, 2), torch.tensor(0.5), None, "x", torch.ones(1),
              torch.tensor(0.5, requires_grad=True), torch.tensor(1j)],
    "is_causal": [False, True, np.bool_(False), None, 0, 1, 1.0, "yes", torch.tensor(True)],
    "enable_gqa": [False, True, np.bool_(True), None, 0, 1, "no"],
}


@pytest.mark.parametrize("name, value", [(n, v) for n, vs in _OPTION_VALUES.items() for v in vs],
                         ids=lambda x: type(x).__name__ if not isinstance(x, str) or len(x) > 12 else x)
@pytest.mark.parametrize("masked", [False, True], ids=["no mask", "mask"])
def test_option_types_run_or_refuse_as_stock(name, value, masked):
    """SDPA's float and bool options: where stock's argument parser takes a value, the drop-in
    and ``va.attention`` run with stock's result; where it refuses one, they refuse it (a
    ``TypeError`` or ``ValueError`` naming the argument), with a mask too (the checks used to
    run only on the path stock's own SDPA call reached)."""
    torch.manual_seed(0)
    qd, kd, vd = (t.double() for t in (q, k, v))
    keep = torch.rand(2, 1, 1, 6) > 0.3
    keep[..., 0] = True
    mask = keep if masked else None
    kwargs = {name: value}
    try:
        ref = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, **kwargs)
    except (TypeError, ValueError, RuntimeError):
        ref = None
    for label, call in (
            ("drop-in", lambda: sdpa(qd, kd, vd, attn_mask=mask, **kwargs)),
            ("attention", lambda: va.attention(qd.transpose(1, 2), kd.transpose(1, 2), vd.transpose(1, 2),
                                               None if mask is None else mask[:, 0, 0], **kwargs).transpose(1, 2))):
        if ref is None:
            with pytest.raises((TypeError, ValueError), match=name):
                call()
        else:
            torch.testing.assert_close(call(), ref, msg=lambda m: f"{label}, {name}={value!r}: {m}")
