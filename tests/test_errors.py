"""Bad input: one exception family, the argument named, expected and received stated."""

import pytest
import torch

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
        (lambda: sdpa(q, k, v, dropout_p=1.5), ValueError, r"dropout_p must be a float in \[0, 1\)"),
        (lambda: sdpa(q, k, v, scale="x"), TypeError, "scale must be a float"),
        (lambda: sdpa(q, k, v, backend="fa9"), ValueError, "backend must be 'auto'"),
        (lambda: sdpa(q, k, v, attn_mask=[True] * 6), TypeError, "attn_mask must be a torch.Tensor"),
        (lambda: va.attention(q, k, v, plan="plan"), TypeError, "plan must be a VarlenPlan"),
        (lambda: va.attention(q, k, v, plan=va.plan_from_seqlens([1, 2], seqlen_q=3)), ValueError, "plan was built for B=2, Sq=3"),
        (lambda: va.build_plan(None), ValueError, "needs batch_size and seqlen_q"),
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
