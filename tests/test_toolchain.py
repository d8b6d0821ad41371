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
from varlen_attn.functional import GRAD_MASK_REASON, MASK_WITH_CAUSAL

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


_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _through_attention(q, k, v, attn_mask):
    out = va.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask)
    return out.transpose(1, 2)


@pytest.mark.parametrize("entry", [va.scaled_dot_product_attention, _through_attention], ids=["drop-in", "attention"])
@pytest.mark.parametrize("bias", ["padding", "random"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16, torch.float16], ids=["no autocast", "bf16 autocast",
                                                                                 "fp16 autocast"])
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.bool])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_dtypes_and_autocast_run_or_refuse_as_stock(dtype, mask_dtype, autocast, bias, entry):
    """Every pairing of q, k, v and mask dtypes, with and without autocast, through both entries,
    a padding bias (packed) and a random one (masked SDPA): varlen_attn runs where stock SDPA
    runs, with stock's output dtype and values, and refuses where it refuses (a float mask must be
    float32 or the query's dtype), whatever the mask's values. Autocast leaves float64 alone, as
    the dispatcher does: a float64 model under autocast stays float64 (before, it was cast down,
    silently)."""
    import contextlib

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))
    keep = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)[:, None, None, :]
    if mask_dtype == torch.bool:
        mask = keep
    elif bias == "padding":
        mask = torch.zeros(keep.shape, dtype=mask_dtype).masked_fill(~keep, -1e4)
    else:
        mask = torch.randn(keep.shape, generator=g, dtype=torch.float64).to(mask_dtype)
    outcomes = []
    for fn in (F.scaled_dot_product_attention, entry):
        region = torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()
        try:
            with region:
                outcomes.append(fn(q, k, v, attn_mask=mask))
        except (RuntimeError, TypeError) as e:
            outcomes.append(type(e))
    stock, ours = outcomes
    if not isinstance(stock, torch.Tensor):
        assert ours is va.InputTypeError, (stock, ours)
        return
    assert isinstance(ours, torch.Tensor), ours
    assert ours.dtype == stock.dtype
    tol = _TOL[stock.dtype]
    torch.testing.assert_close(ours, stock, rtol=tol, atol=tol)


def test_qwen_image_under_autocast_equals_stock():
    """The issue's case: under autocast Qwen-Image reaches SDPA with float32 q, k and a bfloat16
    v. Stock runs; so does the enabled model, as close to a float64 run as stock is."""
    from _models import QF_B, QF_H, QF_W, QWEN_ATTN_LAYERS, prefix_keep, qwen_flux_inputs, qwen_model, step
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
    # One plan per attention call (the enabled run's stats), from Qwen's boolean key-padding
    # joint mask: no host read.
    st_ = va.stats()
    assert st_["plan_builds"] == QWEN_ATTN_LAYERS and st_["host_syncs"] == 0 and not st_["fallbacks"], st_
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


# -- edge shapes and arguments SDPA accepts ----------------------------------------------------

@given(case=cases(kinds=("key_padding", "joint_text_first", "outer", "segments", "cross", "random"),
                  reps=("bool", "neg_inf", "neg_10000")))
def test_mask_with_is_causal_as_this_torch_does(case):
    """torch 2.13's SDPA takes a mask with is_causal=True on some kernels (no grad) and applies
    ``mask & tril``, top-left aligned; its math kernel (with grad) and older releases refuse.
    Where the running torch takes it at all, so do we, with stock's result: checked against
    stock itself without grad, and with grad against the explicit ``mask & tril``."""
    note(repr(case))
    if case.mask is None:
        return
    if not MASK_WITH_CAUSAL:
        with pytest.raises(va.InputValueError, match="cannot both be set"):
            va.scaled_dot_product_attention(case.q, case.k, case.v, case.mask, is_causal=True, enable_gqa=case.gqa)
        return
    sq, sk = case.q.shape[2], case.k.shape[2]
    tril = torch.ones(sq, sk, dtype=torch.bool).tril()
    mask = case.mask
    combined = mask & tril if mask.dtype == torch.bool else torch.where(tril, mask, float("-inf")).to(mask.dtype)
    with torch.no_grad():
        ours = va.scaled_dot_product_attention(case.q, case.k, case.v, mask, is_causal=True, enable_gqa=case.gqa)
        try:  # where stock's chosen kernel takes the pair (its math kernel refuses it)
            stock = F.scaled_dot_product_attention(case.q, case.k, case.v, attn_mask=mask, is_causal=True,
                                                   enable_gqa=case.gqa)
        except RuntimeError as e:
            assert "should not be set when is_causal" in str(e)
        else:
            torch.testing.assert_close(ours, stock, rtol=0, atol=1e-10)
    want = run_with_grads(lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=combined, enable_gqa=case.gqa), case, torch.float64)
    got = run_with_grads(lambda q, k, v: va.scaled_dot_product_attention(
        q, k, v, mask, is_causal=True, enable_gqa=case.gqa), case, torch.float64)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=name)


def test_causal_with_a_self_aligned_mask_still_packs():
    keep = torch.tensor([[1, 1, 1, 0, 0, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    mask = keep[:, None, :, None] & keep[:, None, None, :]
    q, k, v = (torch.randn(2, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    va.reset_stats()
    if not MASK_WITH_CAUSAL:  # this torch's SDPA refuses the pair (2.15 again does): so do we
        with pytest.raises(va.InputValueError, match="is_causal"):
            va.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
        return
    got = va.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    with torch.no_grad():
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert va.stats()["backends"] == {"split_sdpa": 1}, va.stats()


@pytest.mark.parametrize("shape", [(2, 1, 1, 1), (2, 2, 1, 1), (2, 1, 5, 1), (1, 5, 1), (5, 1)])
def test_masks_broadcast_over_keys(shape):
    """Masks with a last dim of 1 broadcast over the keys, as SDPA broadcasts them."""
    g = torch.Generator().manual_seed(sum(shape))
    q, k, v = (torch.randn(2, 2, 5, 8, dtype=torch.float64, generator=g) for _ in range(3))
    # -inf, not -10000: a row where every key carries -10000 is stock's rounding of score - 1e4
    # (~1e-12 here), which the property tests bound with their data-derived tolerance.
    for mask in (torch.rand(shape, generator=g) > 0.4,
                 torch.where(torch.rand(shape, generator=g) > 0.4, 0.0, float("-inf"))):
        want = run_with_grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                              _Case(q, k, v), torch.float64)
        got = run_with_grads(lambda q, k, v: va.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                             _Case(q, k, v), torch.float64)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=f"{shape} {mask.dtype} {name}")


class _Case:
    def __init__(self, q, k, v, seed=0):
        self.q, self.k, self.v, self.seed = q, k, v, seed


@pytest.mark.parametrize("sq, sk", [(5, 0), (0, 5), (0, 0)])
def test_zero_length_sequences(sq, sk):
    q = torch.randn(2, 2, sq, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, sk, 8, dtype=torch.float64, requires_grad=True)
    for mask in (None, torch.ones(2, 1, 1, sk, dtype=torch.bool), torch.zeros(2, 1, sq, sk)):
        want = F.scaled_dot_product_attention(q, k, k, attn_mask=mask)
        got = va.scaled_dot_product_attention(q, k, k, attn_mask=mask, backend="split_sdpa")
        assert got.shape == want.shape and torch.equal(got, want)
        got.sum().backward()  # gradients exist (zeros), as for stock
        assert q.grad is not None and torch.equal(q.grad, torch.zeros_like(q))


def test_meta_tensors_propagate_shapes():
    """Init-on-meta tooling runs a forward on meta tensors for shapes: no data, nothing to pack."""
    q = torch.empty(2, 3, 5, 8, device="meta")
    k = v = torch.empty(2, 3, 7, 16, device="meta")[..., :8]
    mask = torch.empty(2, 1, 1, 7, dtype=torch.bool, device="meta")
    for entry in (lambda: va.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                  lambda: va.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask[:, 0, 0])):
        out = entry()
        assert out.is_meta and out.shape[0] == 2 and out.shape[-1] == 8


def test_tensor_scale_as_sdpa_takes_it():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 5, 8, dtype=torch.float64, generator=g) for _ in range(3))
    mask = torch.rand(2, 1, 1, 5, generator=g) > 0.3
    for scale in (torch.tensor(0.3), torch.tensor(0.3, dtype=torch.float64), 0.0):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        torch.testing.assert_close(va.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale), want,
                                   rtol=0, atol=1e-12)
    with pytest.raises(TypeError):  # a 1-D tensor: stock refuses it, so do we
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=torch.tensor([0.3]))
    with pytest.raises(va.InputTypeError, match="scale must be a float, a 0-d tensor or None"):
        va.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=torch.tensor([0.3]))
    learned = torch.tensor(0.3, requires_grad=True)
    with pytest.raises(TypeError):  # a scale that requires grad: stock refuses it, so do we
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=learned)
    with pytest.raises(va.InputTypeError, match="scale must not require grad"):
        va.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=learned)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -0.5, 1e-30, 2])
def test_scale_edge_values_as_sdpa(scale):
    """Values SDPA accepts give SDPA's result, NaNs included (a NaN scale makes every row NaN)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 5, 8, dtype=torch.float64, generator=g) for _ in range(3))
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)[:, None, None, :]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    got = va.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12, equal_nan=True)


# -- torch.inference_mode -----------------------------------------------------------------------

def test_inference_mode_masks_are_never_stale():
    """An inference tensor has no version counter: an in-place write leaves no trace. Each call
    builds its plan from the mask as it is at that call, so every edit is seen."""
    q = torch.randn(2, 2, 6, 8, dtype=torch.float64)
    with torch.inference_mode():
        mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
        mask[0, ..., 4:] = False
        for edit in (None, (1, 2), (0, 1)):
            if edit:
                mask[edit[0], ..., edit[1]:] = False
            va.reset_stats()
            got = va.scaled_dot_product_attention(q, q, q, attn_mask=mask)
            torch.testing.assert_close(got, F.scaled_dot_product_attention(q, q, q, attn_mask=mask),
                                       rtol=0, atol=1e-12)
            assert va.stats()["plan_builds"] == 1


def test_enabled_model_under_inference_mode_equals_stock():
    from _models import CHROMA_ATTN_LAYERS, chroma_inputs, tiny_chroma

    model = tiny_chroma()
    inputs = chroma_inputs((5, 2, 0))
    with torch.inference_mode():
        want = model(**inputs)[0]
        va.enable_varlen(model)
        try:
            for i in range(2):
                va.reset_stats()
                got = model(**chroma_inputs((5, 2, 0)))[0]
                st_ = va.stats()
                # Chroma's outer-product masks, packed: each forward builds one plan of its mask's
                # outer product on the device, shared by its calls, and reads its checks once
                # (inference tensors alike)
                assert st_["plan_builds"] == 1 and st_["host_syncs"] == 1, st_
                assert st_["backends"] == {"split_sdpa": CHROMA_ATTN_LAYERS}, st_
                torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        finally:
            va.disable_varlen(model)


# -- the model wrapper: deepcopy (EMA), torch.save, accelerate, exceptions ---------------------

def _chroma_pair():
    from _models import chroma_inputs, step, tiny_chroma
    return tiny_chroma, chroma_inputs, step


def test_deepcopy_of_an_enabled_model_runs_its_own_weights():
    """EMA and teacher copies are made with copy.deepcopy: the copy is enabled too (its hooks and
    state are copied) and runs, and trains, its own weights; the original is untouched. Each is
    disabled on its own."""
    import copy

    from _models import CHROMA_ATTN_LAYERS
    from _testing import assert_model_close

    tiny_chroma, chroma_inputs, step = _chroma_pair()
    model = va.enable_varlen(tiny_chroma())
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.9)
    twin = tiny_chroma()  # stock model with the copy's weights
    twin.load_state_dict(ema.state_dict())
    inputs = chroma_inputs()
    va.reset_stats()
    got = step(ema, inputs)
    assert va.stats()["plan_builds"] == 1, va.stats()  # one device plan for the forward, shared by its calls
    assert va.stats()["backends"] == {"split_sdpa": CHROMA_ATTN_LAYERS}, va.stats()
    assert all(p.grad is None for p in model.parameters()), "gradients went to the original"
    assert_model_close(got, step(twin, inputs), what="ema copy")
    assert (got[0] - step(model, inputs)[0]).abs().max() > 1e-3, "the copy ran the original's weights"
    va.disable_varlen(ema)  # each copy is enabled and disabled on its own
    assert hasattr(model, "_varlen_state") and not hasattr(ema, "_varlen_state")
    assert "forward" not in ema.__dict__ and "forward" not in model.__dict__
    va.reset_stats()
    with torch.no_grad():
        ema(**inputs)
    assert va.stats()["plan_builds"] == 0 and not va.stats()["backends"], "disabled, yet varlen ran"
    with torch.no_grad():
        model(**inputs)
    assert va.stats()["backends"] == {"split_sdpa": CHROMA_ATTN_LAYERS}, "disabling the copy disabled the original"


def test_torch_save_and_load_an_enabled_model():
    import io

    from _testing import assert_model_close

    tiny_chroma, chroma_inputs, step = _chroma_pair()
    model = va.enable_varlen(tiny_chroma(), backend="reference")
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    inputs = chroma_inputs()
    va.reset_stats()
    got = step(loaded, inputs)
    assert va.stats()["backends"].get("reference"), va.stats()
    assert_model_close(got, step(tiny_chroma(), inputs), what="loaded")
    va.disable_varlen(loaded)
    assert "forward" not in loaded.__dict__


@pytest.mark.parametrize("order", ["enable_then_prepare", "prepare_then_enable"])
def test_accelerate_prepare_unwrap_and_hooks(order):
    """Enabled before or after ``accelerator.prepare``: the prepared model (accelerate wraps its
    forward in bf16 autocast) runs varlen, one plan per forward. varlen_attn's hooks sit on
    the module, not on its forward, so the model ``unwrap_model`` hands back (accelerate's
    wrappers removed: float32, no autocast) is still enabled and equals stock's unwrapped model;
    ``disable_varlen`` then removes our hooks and leaves a hook added after enabling in place."""
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed")
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    from _models import CHROMA_ATTN_LAYERS
    from _testing import assert_model_close
    from varlen_attn.model import _enter_model, _leave_model

    tiny_chroma, chroma_inputs, step = _chroma_pair()
    inputs = chroma_inputs()
    model = tiny_chroma(dtype=torch.float32)
    f32 = {k: v.float() if v is not None and v.is_floating_point() else v for k, v in inputs.items()
           if k != "return_dict"}
    stock = tiny_chroma(dtype=torch.float32)
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    try:
        if order == "enable_then_prepare":
            va.enable_varlen(model)
            model = accelerator.prepare(model)
        else:
            model = accelerator.prepare(model)
            va.enable_varlen(model)
        stock_prepared = accelerator.prepare(stock)
        va.reset_stats()
        got = model(**f32, return_dict=False)[0]
        # one device plan for the forward (shared by its attention calls), the forward's checks read once
        assert va.stats()["plan_builds"] == 1 and va.stats()["host_syncs"] == 1, va.stats()
        want = stock_prepared(**f32, return_dict=False)[0]
        torch.testing.assert_close(got, want, rtol=0, atol=3e-2)  # both under bf16 autocast: rounding
        plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
        stock_plain = accelerator.unwrap_model(stock_prepared, keep_fp32_wrapper=False)
        # Still enabled, now in float32 without the bf16 autocast unwrap removed (which would be
        # far outside the float32 rule).
        assert hasattr(plain, "_varlen_state")
        va.reset_stats()
        with torch.no_grad():
            out = plain(**f32, return_dict=False)[0]
            assert out.dtype == torch.float32
            assert_model_close(out, stock_plain(**f32, return_dict=False)[0], what=f"unwrapped forward/{order}")
        assert va.stats()["backends"] == {"split_sdpa": CHROMA_ATTN_LAYERS}, va.stats()
        va.reset_stats()
        got = step(plain, {**f32})
        assert va.stats()["backends"] == {"split_sdpa": CHROMA_ATTN_LAYERS}, va.stats()
        assert_model_close(got[0], step(stock_plain, {**f32})[0], what=f"unwrapped/{order}")
        # A hook added after enabling (as enable_model_cpu_offload adds them) survives disable.
        add_hook_to_module(plain, ModelHook())
        va.disable_varlen(plain)
        assert hasattr(plain, "_hf_hook")
        ours = (_enter_model, _leave_model)
        assert not any(f in ours for f in (*plain._forward_pre_hooks.values(), *plain._forward_hooks.values()))
        va.reset_stats()
        out = plain(**f32, return_dict=False)[0]
        assert va.stats()["plan_builds"] == 0, "disabled, yet varlen ran"
        torch.testing.assert_close(out, stock_plain(**f32, return_dict=False)[0], rtol=0, atol=1e-6)
        remove_hook_from_module(plain)
    finally:
        from accelerate.state import AcceleratorState, GradientState
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_nothing_is_left_behind_after_an_exception_in_forward():
    """A forward that raises: this thread's stack of entries is empty again (the hooks that always
    run after a forward took theirs off), the checkpoint wrappers and hooks are as they were, and
    the next step runs packed."""
    from _models import CHROMA_ATTN_LAYERS
    from varlen_attn.hook import current

    tiny_chroma, chroma_inputs, step = _chroma_pair()
    model = va.enable_varlen(tiny_chroma())
    model.enable_gradient_checkpointing()
    step(model, chroma_inputs())  # installs the checkpoint wrappers, which stay while enabled
    funcs = {n: m._gradient_checkpointing_func for n, m in model.named_modules()
             if getattr(m, "_gradient_checkpointing_func", None) is not None}
    hooks = {n: (dict(m._forward_pre_hooks), dict(m._forward_hooks)) for n, m in model.named_modules()}
    depth = torch._C._len_torch_function_stack()
    bad = chroma_inputs()
    bad["hidden_states"] = bad["hidden_states"][:, :3]  # image tokens do not match img_ids
    with pytest.raises(Exception):
        model(**bad)
    assert current() is None and torch._C._len_torch_function_stack() == depth
    assert {n: m._gradient_checkpointing_func for n, m in model.named_modules()
            if getattr(m, "_gradient_checkpointing_func", None) is not None} == funcs
    assert {n: (dict(m._forward_pre_hooks), dict(m._forward_hooks)) for n, m in model.named_modules()} == hooks
    va.reset_stats()
    step(model, chroma_inputs())
    # every block checkpointed: each attention call runs again in the recomputation, on the plan the
    # forward built once on the device; one host read, the forward's checks (the recomputation's are
    # not read)
    assert va.stats()["plan_builds"] == 1 and va.stats()["host_syncs"] == 1, va.stats()
    assert va.stats()["backends"] == {"split_sdpa": 2 * CHROMA_ATTN_LAYERS}, va.stats()


def test_one_model_from_several_threads_with_checkpointing():
    """Trainers and servers share one model between threads: with gradient checkpointing on,
    each thread's forward and backward (recomputation included) equal stock's for its own batch,
    and no module is left changed. The checkpoint wrappers hold no per-forward state."""
    import threading

    from _models import loss
    from _testing import assert_model_close

    tiny_chroma, chroma_inputs, _ = _chroma_pair()
    stock = tiny_chroma()  # without checkpointing: stock Chroma drops the mask of checkpointed blocks
    model = va.enable_varlen(tiny_chroma())
    model.enable_gradient_checkpointing()  # after enabling: wrapped at the first forward
    params = [p for p in model.parameters()]
    batches = [chroma_inputs(lengths=lens, seed=s) for s, lens in enumerate([(5, 2, 0), (7, 1, 3), (0, 0, 6)])]

    def run(m, inputs):
        out = m(**inputs)[0]
        return out.detach(), torch.autograd.grad(loss(out), [p for p in m.parameters()], allow_unused=True)

    want = [run(stock, b) for b in batches]
    funcs_before = {n: m._gradient_checkpointing_func for n, m in model.named_modules()
                    if "_gradient_checkpointing_func" in m.__dict__}
    rounds, results, errors = 4, {}, []
    barrier = threading.Barrier(len(batches))

    def worker(i):
        try:
            for r in range(rounds):
                barrier.wait()
                results[i, r] = run(model, batches[i])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    names = [n for n, _ in model.named_parameters()]
    for (i, r), (out, grads) in sorted(results.items()):
        w_out, w_grads = want[i]
        got = {n: g for n, g in zip(names, grads) if g is not None}
        ref = {n: g for n, g in zip(names, w_grads) if g is not None}
        assert got.keys() == ref.keys()
        assert_model_close((out, got), (w_out, ref), what=f"thread {i}, round {r}")
    assert len(params) == len(names)
    # Each function wrapped once, around the function diffusers set; disabling restores it.
    after = {n: m._gradient_checkpointing_func for n, m in model.named_modules()
             if "_gradient_checkpointing_func" in m.__dict__}
    assert after.keys() == funcs_before.keys()
    assert all(getattr(after[n], "func", None) is f for n, f in funcs_before.items())
    va.disable_varlen(model)
    assert {n: m._gradient_checkpointing_func for n, m in model.named_modules()
            if "_gradient_checkpointing_func" in m.__dict__} == funcs_before


def _func_cases(packable: bool = False):
    """``(q, k, v, keep)``: a random mask with a query row that keeps no key, or (``packable``)
    the outer product of its first row, which packs."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    keep = (torch.arange(6)[None] < torch.tensor([6, 3])[:, None])[:, None, None, :]
    keep = keep & (torch.rand(2, 1, 6, 6, generator=g) > 0.3) | torch.eye(6, dtype=torch.bool)
    keep[1, :, 4] = False  # a query row with no valid key
    if packable:
        keep = keep[:, :, :1].expand(2, 1, 6, 6) & keep[:, :, :1].transpose(-1, -2)
    return q, k, v, keep


@pytest.mark.parametrize("transform", ["grad", "vmap", "jvp", "jacrev", "forward_ad"])
def test_torch_func_transforms_run_as_stock(transform):
    """torch.func transforms (and forward-mode AD) through the drop-in: stock SDPA runs them, so
    does varlen_attn, on masked SDPA with the reason recorded (the packed path's autograd Functions
    and kernels have no batching or forward-mode rule; before, grad and vmap raised "must override
    the setup_context staticmethod"). An explicit varlen backend refuses instead of falling back."""
    import torch.autograd.forward_ad as fwAD
    from torch.func import grad, jacrev, jvp, vmap

    q, k, v, keep = _func_cases()
    t = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def run(fn):
        att = lambda x: fn(x, k, v, attn_mask=keep)  # noqa: E731
        if transform == "grad":
            return grad(lambda x: att(x).pow(2).sum())(q)
        if transform == "vmap":  # three scaled copies of q, one call each
            qs = q * torch.arange(1.0, 4.0, dtype=q.dtype).view(3, 1, 1, 1, 1)
            return vmap(att)(qs)
        if transform == "jvp":
            return torch.stack(jvp(att, (q,), (t,)))
        if transform == "jacrev":
            return jacrev(lambda x: att(x)[0, 0, :2].sum(-1))(q)
        with fwAD.dual_level():
            return fwAD.unpack_dual(att(fwAD.make_dual(q, t))).tangent

    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # the backend stock's forward-mode AD needs
        want = run(F.scaled_dot_product_attention)
        va.reset_stats()
        got = run(va.scaled_dot_product_attention)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert va.stats()["fallbacks"] and all("torch.func" in r for r in va.stats()["fallbacks"]), va.stats()
    with pytest.raises(va.BackendUnavailableError, match="torch.func"):
        run(lambda *a, **kw: va.scaled_dot_product_attention(*a, backend="split_sdpa", **kw))


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float64], ids=["bool mask", "float 0/1 mask"])
def test_torch_func_grad_through_an_enabled_model(mask_dtype):
    """``torch.func.grad`` over ``functional_call`` of an enabled Chroma (functional training,
    per-sample gradients): the gradients autograd gives the enabled model (a float 0/1 mask read
    as boolean, enable_varlen's default; with a bool mask that is stock's)."""
    from torch.func import functional_call, grad

    from _models import chroma_inputs, loss, step, tiny_chroma

    model = va.enable_varlen(tiny_chroma())
    inputs = chroma_inputs((5, 2, 0), mask_dtype=mask_dtype)
    # A bool mask: stock's gradients; a float 0/1 one: the enabled model's eager ones (read as bool).
    _, want = step(tiny_chroma() if mask_dtype == torch.bool else model, inputs)
    params = {n: p.detach() for n, p in model.named_parameters()}
    got = grad(lambda p: loss(functional_call(model, p, args=(), kwargs=inputs)[0]))(params)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-11, msg=name)
    if mask_dtype != torch.bool:  # float_mask="error" cannot read the values inside a transform: it says so
        with va.varlen(model, float_mask="error"), pytest.raises(va.InputTypeError, match="torch.func"):
            grad(lambda p: loss(functional_call(model, p, args=(), kwargs=inputs)[0]))(params)


def test_per_sample_gradients_with_vmap_of_grad_through_an_enabled_model():
    """``vmap(grad(...))`` over the batch (per-sample gradients) of an enabled Chroma, each sample
    a batch of one with its own mask row: the same gradients as stock's."""
    from torch.func import functional_call, grad, vmap

    from _models import chroma_inputs, loss, tiny_chroma

    inputs = chroma_inputs((5, 2, 0))
    names = ["hidden_states", "encoder_hidden_states", "timestep", "attention_mask"]
    results = []
    for enabled in (False, True):
        model = tiny_chroma()
        if enabled:
            va.enable_varlen(model)
        params = {n: p.detach() for n, p in model.named_parameters()}

        def one(p, *sample):
            kw = dict(inputs, **{n: t[None] for n, t in zip(names, sample)})
            return loss(functional_call(model, p, args=(), kwargs=kw)[0])

        results.append(vmap(grad(one), in_dims=(None, 0, 0, 0, 0))(params, *(inputs[n] for n in names)))
    want, got = results
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-11, msg=name)


def test_a_plan_without_a_mask_inside_a_transform_says_so():
    """A prebuilt plan and no ``attn_mask`` inside a transform: masked SDPA has no mask to run
    on, so the call says so (as for an unpackable plan without a mask), rather than compute
    unmasked attention (what the first form of the transform route did, silently)."""
    from torch.func import grad

    q, k, v, keep = _func_cases(packable=True)
    plan = va.build_plan(keep, convention="torch")
    with pytest.raises(va.InputValueError, match="pass attn_mask"):
        grad(lambda x: va.scaled_dot_product_attention(x, k, v, plan=plan).sum())(q)
    got = grad(lambda x: va.scaled_dot_product_attention(x, k, v, attn_mask=keep, plan=plan).pow(2).sum())(q)
    want = grad(lambda x: F.scaled_dot_product_attention(x, k, v, attn_mask=keep).pow(2).sum())(q)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_another_threads_dual_level_does_not_reroute_this_threads_calls():
    """Forward-mode AD's dual level is process-wide: while another thread holds one, this
    thread's calls (no dual tensors) still pack, and an explicit backend or strict still runs."""
    import threading

    import torch.autograd.forward_ad as fwAD

    q, k, v, keep = _func_cases(packable=True)
    entered, leave = threading.Event(), threading.Event()

    def hold():
        with fwAD.dual_level():
            entered.set()
            leave.wait(30)

    other = threading.Thread(target=hold)
    other.start()
    try:
        assert entered.wait(30)
        va.reset_stats()
        got = va.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        va.scaled_dot_product_attention(q, k, v, attn_mask=keep, backend="split_sdpa", strict=True)
        st = va.stats()
    finally:
        leave.set()
        other.join()
    assert st["fallbacks"] == {} and st["backends"] == {"split_sdpa": 2}, st
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=keep), rtol=1e-10, atol=1e-12)
