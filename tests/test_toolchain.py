"""Where stock runs, varlen_attn runs the same: the trainer toolchain (issue 10's items, as they
land). Autocast: mixed-dtype q/k/v and float masks are cast to the autocast dtype, as the
dispatcher casts them for SDPA. Masks that require grad (a learned bias): masked SDPA runs, with
the reason recorded, so the mask gets its gradient; never a silent None.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, note
from hypothesis import strategies as st

import varlen_attn as va
from _testing import assert_matches, cases, run_with_grads, sdpa_fn
from varlen_attn.functional import GRAD_MASK_REASON

LOW = (torch.bfloat16, torch.float16)


def _under_autocast(fn, dtype):
    """``fn`` inside a CPU autocast region, called with v already in ``dtype`` and q, k in float32:
    the mixed dtypes Qwen-Image and HunyuanVideo hand to SDPA under autocast."""
    def call(q, k, v):
        with torch.autocast("cpu", dtype=dtype):
            return fn(q, k, v.to(dtype))
    return call


@given(case=cases(dtype=torch.float32, max_s=12), dtype=st.sampled_from(LOW),
       entry=st.sampled_from(["bhsd", "bshd"]))
def test_autocast_mixed_dtypes_run_as_stock_sdpa(case, dtype, entry):
    note(repr(case))
    mask = case.mask
    if entry == "bshd" and mask is not None and mask.dim() != 4:
        return  # a 4-D mask means the same in both layouts' conventions; others differ

    def ours(q, k, v):
        if entry == "bhsd":
            return va.scaled_dot_product_attention(q, k, v, mask, enable_gqa=case.gqa)
        out = va.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, enable_gqa=case.gqa)
        return out.transpose(1, 2)

    stock_fn = sdpa_fn(case, torch.float32)
    stock = run_with_grads(_under_autocast(stock_fn, dtype), case, torch.float32)
    got = run_with_grads(_under_autocast(ours, dtype), case, torch.float32)
    assert got[0].dtype == stock[0].dtype == dtype
    assert [g.dtype for g in got[1:]] == [torch.float32] * 3  # the casts are differentiable
    # Both against float64: ours at most 2x stock's own error at ``dtype`` (plus a floor).
    ref = run_with_grads(sdpa_fn(case, torch.float64), case, torch.float64)
    assert_matches([t.to(dtype) for t in got], ref, [t.to(dtype) for t in stock], dtype)


def test_qwen_image_under_autocast_equals_stock():
    """The issue's case: under autocast Qwen-Image reaches SDPA with float32 q, k and a bfloat16
    v. Stock runs; so does the enabled model, as close to a float64 run as stock is."""
    from _models import QF_B, QF_H, QF_W, prefix_keep, qwen_flux_inputs, qwen_model, step
    from _testing import assert_model_close

    def inputs(dtype):
        x = qwen_flux_inputs(dtype=dtype)
        x.pop("pooled_projections")
        return dict(x, encoder_hidden_states_mask=prefix_keep([5, 2, 0]), img_shapes=[(1, QF_H, QF_W)] * QF_B)

    ref = step(qwen_model(), inputs(torch.float64))
    results = []
    for enable in (False, True):
        model = qwen_model(dtype=torch.float32)
        if enable:
            va.enable_varlen(model)
        va.reset_stats()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(step(model, inputs(torch.float32)))
    assert va.stats()["plan_builds"] == 1 and not va.stats()["fallbacks"], va.stats()
    stock, ours = results
    assert ours[0].dtype == stock[0].dtype
    assert_model_close(ours, ref, baseline=stock, what="qwen autocast bf16")


def test_autocast_casts_the_mask_as_stock_does():
    """A finite ``finfo(float32).min`` row: float16 autocast turns it into -inf, so stock returns
    zeros there (not the mean of the values): so must we."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    mask = torch.zeros(1, 1, 4, 4)
    mask[0, 0, 1, :] = torch.finfo(torch.float32).min
    with torch.autocast("cpu", dtype=torch.float16):
        stock = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        ours = va.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert stock[0, :, 1].abs().sum() == 0
    torch.testing.assert_close(ours, stock, rtol=0, atol=2e-3)


# -- masks that require grad --------------------------------------------------------------------

@given(case=cases(kinds=("key_padding", "joint_text_first", "outer", "segments", "cross", "random", "bias01"),
                  reps=("neg_inf", "neg_10000")))
def test_a_mask_that_requires_grad_gets_its_gradient(case):
    note(repr(case))
    if case.mask is None or not case.mask.is_floating_point():
        return
    grads = []
    for fn in (F.scaled_dot_product_attention, va.scaled_dot_product_attention):
        mask = case.mask.clone().requires_grad_()
        q, k, v = (t.clone().requires_grad_() for t in (case.q, case.k, case.v))
        out = fn(q, k, v, attn_mask=mask, enable_gqa=case.gqa)
        w = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(case.seed))
        (out * w).sum().backward()
        grads.append([out.detach(), q.grad, k.grad, v.grad, mask.grad])
    for name, a, b in zip(("out", "dq", "dk", "dv", "dmask"), *grads):
        assert a is not None and b is not None, name
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10, msg=name)


def test_grad_mask_fallback_is_recorded_and_policies_hold():
    q = k = v = torch.randn(2, 2, 6, 8, dtype=torch.float64)
    bias = torch.zeros(2, 1, 1, 6, dtype=torch.float64)
    bias[0, ..., 4:] = float("-inf")
    va.reset_stats()
    va.scaled_dot_product_attention(q, k, v, attn_mask=bias.requires_grad_())
    st_ = va.stats()
    assert st_["backends"] == {"sdpa": 1} and st_["fallbacks"] == {GRAD_MASK_REASON: 1}, st_
    assert st_["plan_builds"] == 0, "no plan (and no sync) for a mask that cannot be packed anyway"
    with pytest.raises(va.NotPackableError, match="requires grad"):
        va.scaled_dot_product_attention(q, k, v, attn_mask=bias, strict=True)
    with pytest.raises(va.BackendUnavailableError, match="requires grad"):
        va.scaled_dot_product_attention(q, k, v, attn_mask=bias, backend="reference")
    va.reset_stats()
    with torch.no_grad():  # no gradient to give: the mask is packed as usual
        va.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert va.stats()["backends"] == {"split_sdpa": 1}, va.stats()


@pytest.mark.usefixtures("fresh_dynamo")
def test_grad_mask_under_compile_gets_its_gradient():
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 6, 8, dtype=torch.float64, generator=g) for _ in range(3))
    compiled = torch.compile(lambda q, k, v, m: va.scaled_dot_product_attention(q, k, v, attn_mask=m),
                             fullgraph=True, backend="aot_eager")
    grads = []
    for fn in (compiled, F.scaled_dot_product_attention):
        mask = torch.zeros(2, 1, 1, 6, dtype=torch.float64)
        mask[1, ..., 3:] = float("-inf")
        mask.requires_grad_()
        out = fn(q, k, v, mask)
        (out * out).sum().backward()
        grads.append([out.detach(), mask.grad])
    assert grads[0][1] is not None
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert not counters["graph_break"], dict(counters["graph_break"])
