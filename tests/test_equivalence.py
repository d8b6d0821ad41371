"""varlen_attn equals masked SDPA: outputs and q/k/v gradients, on every mask kind."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, note
from hypothesis import strategies as st

import varlen_attn as va
from _testing import (PACKABLE_KINDS, STATIC_KINDS, UNPACKABLE_KINDS, assert_matches, cases, effective_keep,
                      is_segment_pattern, one_segment, run_with_grads, sdpa_fn, static_attention)

BACKENDS = ["auto", "reference", "split_sdpa"]


def packable(case) -> bool:
    keep = effective_keep(case)
    return keep is None or is_segment_pattern(keep)


@given(case=cases(), backend=st.sampled_from(BACKENDS))
def test_dropin_equals_sdpa_float64(case, backend):
    note(repr(case))
    ref = run_with_grads(sdpa_fn(case, torch.float64, exact=True), case, torch.float64)
    baseline = run_with_grads(sdpa_fn(case, torch.float64), case, torch.float64)
    got = run_with_grads(
        lambda q, k, v: va.scaled_dot_product_attention(q, k, v, case.mask, enable_gqa=case.gqa,
                                                        backend=backend if packable(case) else None, strict=packable(case)),
        case, torch.float64)
    assert_matches(got, ref, baseline, torch.float64)


@given(case=cases(dtype=torch.float32, max_s=16), backend=st.sampled_from(BACKENDS),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_dropin_low_precision_within_sdpa_error(case, backend, dtype):
    """Against float64, our error is at most 2x SDPA's own error at the same precision."""
    note(repr(case))
    if case.mask is not None and case.mask.is_floating_point():
        case.mask = case.mask.to(dtype)
    ref = run_with_grads(sdpa_fn(case, torch.float64, exact=True), case, torch.float64)
    baseline = run_with_grads(sdpa_fn(case, dtype), case, dtype)
    got = run_with_grads(
        lambda q, k, v: va.scaled_dot_product_attention(q, k, v, case.mask, enable_gqa=case.gqa,
                                                        backend=backend if packable(case) else None, strict=packable(case)),
        case, dtype)
    assert all(g.dtype == dtype for g in got)
    assert_matches(got, ref, baseline, dtype)


@given(case=cases(), backend=st.sampled_from(BACKENDS))
def test_bshd_entry_with_model_layout_masks(case, backend):
    """attention() on [B, S, H, D] with batch-first masks ([B, Sk] is key padding)."""
    note(repr(case))
    ref = run_with_grads(sdpa_fn(case, torch.float64, exact=True), case, torch.float64)
    baseline = run_with_grads(sdpa_fn(case, torch.float64), case, torch.float64)

    def fn(q, k, v):
        out = va.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), case.model_mask,
                           enable_gqa=case.gqa, backend=backend if packable(case) else None, strict=packable(case))
        return out.transpose(1, 2)

    assert_matches(run_with_grads(fn, case, torch.float64), ref, baseline, torch.float64)


@given(case=cases(kinds=UNPACKABLE_KINDS))
def test_unpackable_masks_go_to_sdpa_with_reason(case):
    note(repr(case))
    va.reset_stats()
    ref = run_with_grads(sdpa_fn(case, torch.float64, exact=True), case, torch.float64)
    baseline = run_with_grads(sdpa_fn(case, torch.float64), case, torch.float64)
    got = run_with_grads(
        lambda q, k, v: va.scaled_dot_product_attention(q, k, v, case.mask, enable_gqa=case.gqa),
        case, torch.float64)
    assert_matches(got, ref, baseline, torch.float64)
    b, hq, sq, _ = case.q.shape
    plan = va.build_plan(case.mask, batch_size=b, seqlen_q=sq, num_heads=hq, convention="torch")
    if not plan.packable:  # a random mask can be a segment pattern by chance
        assert sum(va.stats()["fallbacks"].values()) >= 1
        assert plan.reason in va.stats()["fallbacks"]
        with pytest.raises(va.NotPackableError):
            va.scaled_dot_product_attention(case.q, case.k, case.v, case.mask, enable_gqa=case.gqa, strict=True)
        with pytest.raises(va.BackendUnavailableError, match="packable"):
            va.scaled_dot_product_attention(case.q, case.k, case.v, case.mask, enable_gqa=case.gqa,
                                            backend="reference")


@given(case=cases(kinds=("segments", "key_padding", "outer", "none"), reps=("bool", "neg_inf")),
       backend=st.sampled_from(BACKENDS))
def test_causal_within_segments(case, backend):
    """attention(is_causal=True) equals SDPA with mask & lower-triangular, packed or not."""
    note(repr(case))
    sq, sk = case.q.shape[2], case.k.shape[2]
    tri = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    if case.mask is None:
        full = tri
    elif case.mask.dtype == torch.bool:
        full = case.mask & tri
    else:
        full = case.mask.masked_fill(~tri, float("-inf"))

    def ref_fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=full, enable_gqa=case.gqa)

    def fn(q, k, v):
        out = va.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), case.model_mask,
                           is_causal=True, enable_gqa=case.gqa,
                           backend=None if backend == "auto" else backend)
        return out.transpose(1, 2)

    ref = run_with_grads(ref_fn, case, torch.float64)
    try:
        got = run_with_grads(fn, case, torch.float64)
    except va.BackendUnavailableError:
        # Only an explicit backend may refuse, and only when the causal mask cannot be packed.
        assert backend != "auto" and case.kind in ("key_padding", "outer")
        return
    assert_matches(got, ref, ref, torch.float64)


@pytest.mark.parametrize("kind", PACKABLE_KINDS)
def test_every_packable_kind_is_packed(kind):
    """Each packable kind really takes the varlen path (no fallback) in at least one draw."""
    va.reset_stats()

    @given(case=cases(kinds=(kind,), reps=("bool", "neg_inf")))
    def run(case):
        va.scaled_dot_product_attention(case.q, case.k, case.v, case.mask, enable_gqa=case.gqa,
                                        backend="reference", strict=True)

    run()
    assert va.stats()["backends"].get("reference", 0) > 0
    assert va.stats()["fallbacks"] == {}


@given(case=cases(kinds=("cross", "segments", "key_padding", "outer"), reps=("bool", "neg_inf")))
def test_dropin_causal_with_a_plan_aligns_top_left_as_sdpa(case):
    """The drop-in with ``plan=`` and ``is_causal=True`` means what SDPA means: ``mask & tril``
    aligned top-left, also when Sq != Sk (where a plan's own causal segments would align
    bottom-right); without a mask that case is refused, naming ``plan``."""
    note(repr(case))
    b, hq, sq, _ = case.q.shape
    sk = case.k.shape[2]
    tri = torch.ones(sq, sk, dtype=torch.bool).tril()  # SDPA's is_causal: top-left
    keep = effective_keep(case)
    full = tri if keep is None else keep & tri

    def ref_fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=full, enable_gqa=case.gqa)

    plan = va.build_plan(case.mask, batch_size=b, seqlen_q=sq, seqlen_k=sk, num_heads=hq, convention="torch")

    def fn(q, k, v):
        return va.scaled_dot_product_attention(q, k, v, case.mask, is_causal=True, plan=plan,
                                               enable_gqa=case.gqa)

    ref = run_with_grads(ref_fn, case, torch.float64)
    assert_matches(run_with_grads(fn, case, torch.float64), ref, ref, torch.float64)
    if sq != sk:
        with pytest.raises(va.InputValueError, match="plan"):
            va.scaled_dot_product_attention(case.q, case.k, case.v, is_causal=True, plan=plan, enable_gqa=case.gqa)


def _static_op(case, backend="reference", model_layout=False):
    def fn(q, k, v):
        mask = case.model_mask if model_layout else case.mask
        out, _ = static_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, backend=backend,
                                  convention="model" if model_layout else "torch", gqa=case.gqa)
        return out.transpose(1, 2)
    return fn


@given(case=cases(kinds=STATIC_KINDS + ("segments",)), model_layout=st.booleans())
def test_static_plans_equal_sdpa_float64(case, model_layout):
    """The plan built with no host read (what CUDA graphs replay; varlen_attn.op, "Under CUDA
    graphs"): packed tensors of all B*S rows, padding after the segments, bounds for max_seqlen.
    Output and q/k/v gradients equal masked SDPA on every single-segment padding mask; a mask
    with more than one segment in an element is refused, never computed wrong."""
    note(repr(case))
    if case.mask is None or (model_layout and case.model_mask is None):
        return
    fn = _static_op(case, model_layout=model_layout)
    if not one_segment(effective_keep(case)):
        with pytest.raises(va.BackendUnavailableError, match="one segment per batch element"):
            run_with_grads(fn, case, torch.float64)
        return
    ref = run_with_grads(sdpa_fn(case, torch.float64, exact=True), case, torch.float64)
    baseline = run_with_grads(sdpa_fn(case, torch.float64), case, torch.float64)
    assert_matches(run_with_grads(fn, case, torch.float64), ref, baseline, torch.float64)
