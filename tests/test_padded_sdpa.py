"""The ``padded_sdpa`` backend: SDPA on the padded tensors with the plan's key-padding bias.

It runs wherever SDPA runs, so here it is checked as everywhere: outputs and q/k/v gradients
against masked SDPA in float64 and within SDPA's own error at low precision, on every packable
mask kind; a plan with more than one segment in a batch element is refused by name (and auto
passes it over); static plans (CUDA graphs' path) and the compiled custom op run it too."""

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import varlen_attn as va
from _testing import (STATIC_KINDS, assert_matches, cases, effective_keep, is_segment_pattern, one_segment,
                      run_with_grads, sdpa_fn, static_attention)
from varlen_attn.kernels import padded_sdpa

NAME = "padded_sdpa"


def packable(case) -> bool:
    keep = effective_keep(case)
    return keep is not None and is_segment_pattern(keep)


def ours(case):
    return lambda q, k, v: va.scaled_dot_product_attention(q, k, v, case.mask, enable_gqa=case.gqa, backend=NAME,
                                                           strict=True)


@given(case=cases(max_s=64))
def test_equals_sdpa_float64_or_refuses_by_name(case):
    note(repr(case))
    if not packable(case):
        return
    if not one_segment(effective_keep(case)):
        with pytest.raises(va.BackendUnavailableError, match="more than one segment"):
            run_with_grads(ours(case), case, torch.float64)
        return
    ref = run_with_grads(sdpa_fn(case, torch.float64, exact=True), case, torch.float64)
    baseline = run_with_grads(sdpa_fn(case, torch.float64), case, torch.float64)
    assert_matches(run_with_grads(ours(case), case, torch.float64), ref, baseline, torch.float64)


@given(case=cases(dtype=torch.float32, max_s=16), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_low_precision_within_sdpa_error(case, dtype):
    note(repr(case))
    if not packable(case) or not one_segment(effective_keep(case)):
        return
    if case.mask.is_floating_point():
        case.mask = case.mask.to(dtype)
    ref = run_with_grads(sdpa_fn(case, torch.float64, exact=True), case, torch.float64)
    baseline = run_with_grads(sdpa_fn(case, dtype), case, dtype)
    got = run_with_grads(ours(case), case, dtype)
    assert all(g.dtype == dtype for g in got)
    assert_matches(got, ref, baseline, dtype)


def test_auto_passes_over_it_for_several_segments(monkeypatch):
    """With padded_sdpa first in auto's order, a one-segment mask runs on it and a block-diagonal
    one on the next backend, never on masked SDPA or wrong."""
    monkeypatch.setitem(va.kernels.PRIORITY, "cpu", (NAME, "reference"))
    q = k = v = torch.randn(2, 2, 6, 8, dtype=torch.float64)
    keep = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    blocks = torch.zeros(2, 6, 6, dtype=torch.bool)
    blocks[:, :3, :3] = blocks[:, 3:, 3:] = True  # two documents in each element
    for mask, ran in ((keep[:, None, None, :] & keep[:, None, :, None], NAME), (blocks[:, None], "reference")):
        va.reset_stats()
        out = va.scaled_dot_product_attention(q, k, v, mask)
        assert va.stats()["backends"] == {ran: 1}
        torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                                   rtol=0, atol=1e-12)


@given(case=cases(kinds=STATIC_KINDS))
def test_static_plans_equal_sdpa_float64(case):
    """The plan CUDA graphs replay (built with no host read) runs this backend as it is."""
    note(repr(case))
    if case.mask is None or not one_segment(effective_keep(case)):
        return

    def fn(q, k, v):
        out, _ = static_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), case.mask, backend=NAME,
                                  gqa=case.gqa)
        return out.transpose(1, 2)

    ref = run_with_grads(sdpa_fn(case, torch.float64, exact=True), case, torch.float64)
    baseline = run_with_grads(sdpa_fn(case, torch.float64), case, torch.float64)
    assert_matches(run_with_grads(fn, case, torch.float64), ref, baseline, torch.float64)


def test_compiled_caller_equals_eager():
    """Under torch.compile the backend runs inside varlen_attn's custom op (forward, and the
    forward recomputed under autograd in its backward)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 10, 16, generator=g, requires_grad=True) for _ in range(3))
    keep = torch.tensor([[1] * 7 + [0] * 3, [1] * 2 + [0] * 8], dtype=torch.bool)
    mask = keep[:, None, :, None] & keep[:, None, None, :]

    def fn(q_, k_, v_):
        return va.scaled_dot_product_attention(q_, k_, v_, mask, backend=NAME, strict=True)

    va.reset_stats()
    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert va.stats()["backends"] == {NAME: 1}
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip((out, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_key_bias_is_aligned_and_made_once_per_plan_and_dtype():
    keep = torch.tensor([[1] * 5 + [0] * 15, [0] * 20], dtype=torch.bool)  # Sk = 20, not a multiple of 16
    plan = va.build_plan(keep, convention="model")
    bias = padded_sdpa.key_bias(plan, torch.float32)
    assert bias.shape == (2, 1, 1, 20) and bias.stride(-2) % 16 == 0 and bias.stride(-1) == 1
    assert torch.equal(bias[0, 0, 0] == 0, keep[0]) and bool((bias[1] == 0).all())  # no key kept: all zeros
    first = padded_sdpa._masks_of(plan, torch.float32)
    assert padded_sdpa._masks_of(plan, torch.float32) is first
    assert padded_sdpa._masks_of(plan, torch.float64)[0].dtype == torch.float64
