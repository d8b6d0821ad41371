"""enable_varlen on diffusers' Qwen-Image and Flux transformers: outputs and every parameter's
gradient equal the stock model's, one plan per masked attention call (built from that call's own
mask), no host read for boolean key-padding masks, no fallback for padding masks.

Tiny random models in float64 on the CPU, batches of 3 with different prompt lengths, one of them
an empty prompt (caption dropout: zero valid text tokens), plus the no-mask and all-true cases,
for the CPU backends ``split_sdpa`` and ``reference``.

How each model gets its mask:

* Qwen-Image takes ``encoder_hidden_states_mask`` ``[B, T]``; ``QwenDoubleStreamAttnProcessor2_0``
  builds ``cat([text_mask, ones(B, N)])[:, None, None, :]`` in every block, so rows read
  ``[text valid, text padding, image]``: the gap sits in the middle of the row. Each block's
  attention call builds its plan from that boolean key-padding mask, on the device: one build per
  call, no host read.
* Flux has no mask argument. A user passes one through
  ``joint_attention_kwargs={"attention_mask": mask}``: ``FluxAttention.forward`` hands it to
  ``FluxAttnProcessor``, which passes it untouched to ``dispatch_attention_fn``; diffusers'
  native backend reshapes a 2-D ``[B, T+N]`` mask to ``[B, 1, 1, T+N]`` (in every call) and SDPA
  runs on ``[B, H, T + N, D]``, text first. So the mask may be ``[B, T+N]``, ``[B, 1, 1, T+N]``
  (key padding) or ``[B, 1, T+N, T+N]`` (Chroma-style outer product), bool or additive float.
  Flux does honour it: ``test_flux_mask_is_honoured`` checks the masked batch against each
  sample run alone with its prompt cut to the valid tokens. Every attention call builds its
  plan from the mask it receives: a boolean key-padding mask (``[B, T+N]`` reshaped per call,
  or ``[B, 1, 1, T+N]``) with no host read, an additive or outer-product mask with one host read
  per call.

Tolerance: ``_testing.assert_model_close`` (its docstring has the measurements). The baseline is the
stock model run on a permuted batch (outputs permuted back): an equivalent computation that only
changes float64 summation order (parameter gradients sum over the batch), so it measures the
rounding noise stock itself carries. ``split_sdpa`` with an all-true mask and every backend with
no mask are bit-exact. A real masking error moves outputs by ~1e-2.
"""

from __future__ import annotations

import functools
import inspect
import weakref

import pytest
import torch
import torch.utils.checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st

import varlen_attn as va
from _models import (FLUX_ATTN_LAYERS, QF_B, QF_H, QF_N, QF_T, QF_W, QWEN_ATTN_LAYERS, flux_ids, flux_model,
                     prefix_keep, qwen_flux_inputs, qwen_model, step)
from _testing import assert_model_close, assert_model_equal

BACKENDS = ("split_sdpa", "reference")
B, T, N, H_IMG, W_IMG = QF_B, QF_T, QF_N, QF_H, QF_W  # batch, padded prompt, image tokens (H x W)
PERM = torch.tensor([2, 0, 1])


# --------------------------------------------------------------------------------------------
# models and inputs: one instance of each model for the whole file (tests leave it stock)



@functools.cache
def qwen():
    return qwen_model()


@functools.cache
def flux():
    return flux_model()


INPUTS = qwen_flux_inputs()
TXT_IDS, IMG_IDS = flux_ids()


def _run(model, inputs, grad):
    if grad:
        return step(model, inputs)
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0], {}


def run_qwen(mask, perm=None, grad=True):
    """Output and parameter gradients (``_models.step``); ``perm`` permutes the batch on the way
    in and back on the way out."""
    perm = torch.arange(B) if perm is None else perm
    out, grads = _run(qwen(), {
        "hidden_states": INPUTS["hidden_states"][perm],
        "encoder_hidden_states": INPUTS["encoder_hidden_states"][perm],
        "encoder_hidden_states_mask": None if mask is None else mask[perm],
        "timestep": INPUTS["timestep"][perm],
        "img_shapes": [(1, H_IMG, W_IMG)] * B,
    }, grad)
    return out[torch.argsort(perm)], grads


def enabled_run(model, backend, run):
    """``(run(), stats())`` with ``model`` enabled on ``backend`` for the call (stats reset first),
    disabled again after."""
    va.enable_varlen(model, backend=backend)
    try:
        va.reset_stats()
        got = run()
        return got, va.stats()
    finally:
        va.disable_varlen(model)


def run_flux(mask, perm=None, grad=True, sample=None, text_len=T):
    """As :func:`run_qwen`; ``mask`` goes through ``joint_attention_kwargs["attention_mask"]``.
    ``sample``/``text_len`` run one batch element alone with its prompt cut to ``text_len``."""
    idx = torch.arange(B) if perm is None else perm
    if sample is not None:
        idx = torch.tensor([sample])
    out, grads = _run(flux(), {
        "hidden_states": INPUTS["hidden_states"][idx],
        "encoder_hidden_states": INPUTS["encoder_hidden_states"][idx, :text_len],
        "pooled_projections": INPUTS["pooled_projections"][idx],
        "timestep": INPUTS["timestep"][idx],
        "img_ids": IMG_IDS,
        "txt_ids": TXT_IDS[:text_len],
        "joint_attention_kwargs": None if mask is None else {"attention_mask": mask[idx]},
    }, grad)
    return (out if perm is None else out[torch.argsort(perm)]), grads


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b|: how far a mask moves an output (an effect size, not a tolerance)."""
    return (a - b).abs().max().item() / b.abs().max().item()


def flux_joint_mask(keep: torch.Tensor, form: str) -> torch.Tensor:
    """The user's joint ``[text; image]`` mask for Flux from a [B, T] text keep-mask."""
    joint = torch.cat([keep, torch.ones(keep.shape[0], N, dtype=torch.bool)], dim=1)  # [B, T+N]
    if form == "key_2d":  # diffusers' native backend unsqueezes it to [B, 1, 1, T+N]
        return joint
    if form == "key_bool":
        return joint[:, None, None, :]
    if form == "key_neg_inf":
        bias = torch.zeros(joint.shape, dtype=torch.float64).masked_fill(~joint, float("-inf"))
        return bias[:, None, None, :]
    if form == "outer_bool":  # Chroma's layout: padded text queries attend nothing (zero rows)
        return joint[:, None, :, None] & joint[:, None, None, :]
    raise ValueError(form)


@functools.cache
def stock(model: str, case: str):
    """Stock result of a case and its baseline: the stock run on a permuted batch."""
    run, mask = _case(model, case)
    ref = run(mask)
    permuted = run(mask, perm=PERM)
    assert_model_close(permuted, ref, what=f"stock {model}/{case} under batch permutation")
    return ref, permuted


# Host reads per attention call of a case's mask: none for a boolean key-padding mask (Qwen-Image
# builds a bool [B, 1, 1, T+N] joint mask from any text mask dtype), one for any other form: the
# check of a boolean outer product (run as key padding, on a plan built in each call; Flux's
# checks are read in the call), the plan's read of a float mask (planned once, the plan kept).
SYNCS_PER_CALL = {("flux", "prefix_neg_inf"): 1, ("flux", "prefix_outer"): 1}
KEPT_PLAN = {("flux", "prefix_neg_inf")}  # a float mask is not factored: one plan for its every call

QWEN_CASES = {
    # lengths 5, 2, 0: every row has a gap between valid text and the image; one empty prompt
    "prefix": lambda: prefix_keep([5, 2, 0]),
    # one full prompt, one partial, one empty
    "full_partial_empty": lambda: prefix_keep([T, 3, 0]),
    # Qwen's mask may have any pattern, not only a prefix
    "scattered": lambda: torch.tensor([[1, 0, 1, 1, 0, 1, 0], [0, 0, 0, 1, 1, 0, 0], [0] * T],
                                      dtype=torch.bool),
    # the pipeline's integer and float masks: both models read them as bool (nonzero = keep)
    "prefix_int64": lambda: prefix_keep([5, 2, 0]).long(),
    "prefix_float": lambda: prefix_keep([5, 2, 0]).double(),
    "all_true": lambda: torch.ones(B, T, dtype=torch.bool),
    "none": lambda: None,
}
FLUX_CASES = {
    "prefix": lambda: flux_joint_mask(prefix_keep([5, 2, 0]), "key_bool"),
    "full_partial_empty": lambda: flux_joint_mask(prefix_keep([T, 3, 0]), "key_bool"),
    "prefix_neg_inf": lambda: flux_joint_mask(prefix_keep([5, 2, 0]), "key_neg_inf"),
    "prefix_outer": lambda: flux_joint_mask(prefix_keep([5, 2, 0]), "outer_bool"),
    "all_true": lambda: flux_joint_mask(torch.ones(B, T, dtype=torch.bool), "key_bool"),
    "none": lambda: None,
}


def _case(model: str, case: str):
    if model == "qwen":
        return run_qwen, QWEN_CASES[case]()
    return run_flux, FLUX_CASES[case]()


def check_case(model: str, case: str, backend: str):
    ref, baseline = stock(model, case)
    run, mask = _case(model, case)  # a fresh mask object
    m = qwen() if model == "qwen" else flux()
    layers = QWEN_ATTN_LAYERS if model == "qwen" else FLUX_ATTN_LAYERS
    syncs = SYNCS_PER_CALL.get((model, case), 0)
    got, s = enabled_run(m, backend, lambda: run(mask))
    assert "forward" not in m.__dict__  # disable_varlen restored the class forward

    if mask is None:
        # Nothing to pack: the stock SDPA call runs untouched (not counted): bit-exact results.
        assert s["backends"] == {}
        assert s["plan_builds"] == 0 and s["host_syncs"] == 0, s
        assert_model_equal(got, ref, f"{model}/{case}/{backend}")
    else:
        # varlen ran every attention layer on the requested backend: a boolean key-padding mask
        # plans each call with no host read, a boolean outer product each call with one host read
        # (its check), a float mask once, with one host read per call.
        assert s["backends"] == {backend: layers}, s
        builds = 1 if (model, case) in KEPT_PLAN else layers
        assert s["plan_builds"] == builds and s["host_syncs"] == syncs * layers, s
        assert_model_close(got, ref, baseline=baseline, what=f"{model}/{case}/{backend}")
    assert s["fallbacks"] == {}, s


# --------------------------------------------------------------------------------------------
# Qwen-Image


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(QWEN_CASES))
def test_qwen_matches_stock(case, backend):
    check_case("qwen", case, backend)


def test_qwen_mask_matters():
    """The padding cases are a real test: the mask moves the stock output far beyond tolerance."""
    ref, _ = stock("qwen", "prefix")
    unmasked, _ = stock("qwen", "none")
    assert rel_diff(ref[0], unmasked[0]) > 1e-4  # > 4e11 float64 ulps: > 1e10 x the floor
    with pytest.raises(AssertionError):
        assert_model_close(unmasked[0], ref[0], what="qwen/no mask vs mask (must fail)")
    # The full-length sample of "full_partial_empty" is unaffected by its all-true row.
    ref_fpe, _ = stock("qwen", "full_partial_empty")
    assert_model_close(ref_fpe[0][0], unmasked[0][0], what="qwen/full-length sample")


@pytest.mark.parametrize("backend", BACKENDS)
def test_qwen_one_plan_per_attention_call(backend):
    """Three forwards, two blocks each: the processor re-derives the joint mask in every block,
    and every attention call builds its plan from it (the same text mask object passed again
    changes nothing): one build per call, and no host read (a boolean key-padding mask)."""
    m = qwen()
    mask = prefix_keep([5, 2, 0])
    ref = [run_qwen(mask, grad=False)[0] for _ in range(3)]
    va.enable_varlen(m, backend=backend)
    try:
        va.reset_stats()
        got = [run_qwen(mask, grad=False)[0] for _ in range(3)]
        s = va.stats()
    finally:
        va.disable_varlen(m)
    assert s["plan_builds"] == 3 * QWEN_ATTN_LAYERS and s["host_syncs"] == 0, s
    assert s["backends"] == {backend: 3 * QWEN_ATTN_LAYERS} and s["fallbacks"] == {}, s
    for g, r in zip(got, ref):
        assert_model_close(g, r, what=f"qwen/3 forwards/{backend}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_qwen_gradient_checkpointing(backend):
    """Checkpointed blocks recompute in backward, on varlen again: each recomputed attention call
    builds its own plan (twice the layers' calls in all, no host read), and the gradients equal
    the stock (non-checkpointed) model's."""
    ref, baseline = stock("qwen", "prefix")
    m = qwen()
    m.enable_gradient_checkpointing()
    va.enable_varlen(m, backend=backend)
    try:
        va.reset_stats()
        got = run_qwen(prefix_keep([5, 2, 0]))
        s = va.stats()
    finally:
        va.disable_varlen(m)
        m.disable_gradient_checkpointing()
    assert s["plan_builds"] == 2 * QWEN_ATTN_LAYERS and s["host_syncs"] == 0, s
    # forward and recomputation both ran on varlen
    assert s["backends"] == {backend: 2 * QWEN_ATTN_LAYERS} and s["fallbacks"] == {}, s
    assert_model_close(got, ref, baseline=baseline, what=f"qwen/checkpointing/{backend}")


def _checkpoint_forward(module, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(module.forward, *args, use_reentrant=False, **kwargs)


def _checkpoint_moved(module, *args, **kwargs):
    # methods of the module that return it (to, train), then the module itself: stock checkpoints it
    module = module.to(args[0].dtype).train()
    return torch.utils.checkpoint.checkpoint(module, *args, use_reentrant=False, **kwargs)


_SEEN = weakref.WeakKeyDictionary()


def _checkpoint_by_keyword(module, *args, **kwargs):
    # the block as a key, its arguments bound to their names and passed by keyword
    _SEEN[module] = True
    assert isinstance(module, torch.nn.Module)
    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(module, use_reentrant=False, **bound.arguments)


def _checkpoint_casting(module, *args, **kwargs):
    # the tensor arguments as the function sees them: a bool mask among them, as with stock
    assert any(isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in args), [type(a) for a in args]
    return torch.utils.checkpoint.checkpoint(module, *args, use_reentrant=False, **kwargs)


def _checkpoint_reentrant(module, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(module, *args, use_reentrant=True, **kwargs)


@pytest.mark.parametrize("func", [_checkpoint_forward, _checkpoint_moved, _checkpoint_by_keyword, _checkpoint_casting,
                                  _checkpoint_reentrant],
                         ids=["module.forward", "module.to().train()", "keywords and identity", "sees its mask",
                              "reentrant"])
def test_qwen_with_a_checkpoint_function_of_the_callers_own(func):
    """``enable_gradient_checkpointing(func)``: diffusers hands ``func`` the block and its
    arguments, which it may use as it likes (``module.forward``, ``module.to()``, the block as a
    dict key, arguments by keyword, the mask itself). Enabled, it gets the same (before, a plain
    function: AttributeError), and the step equals stock's with the same function. The
    recomputation, reentrant or not, runs on varlen too (the attention modules' own hooks put the
    model's policy on the thread again): one plan per attention call, forward and recomputation."""
    mask = prefix_keep([5, 2, 0])
    m = qwen()
    m.enable_gradient_checkpointing(func)
    try:
        want = run_qwen(mask)
        got, s = enabled_run(m, "split_sdpa", lambda: run_qwen(mask))
    finally:
        m.disable_gradient_checkpointing()
    calls = 2 * QWEN_ATTN_LAYERS  # forward and recomputation
    assert s["plan_builds"] == calls and s["host_syncs"] == 0 and s["fallbacks"] == {}, s
    assert s["backends"] == {"split_sdpa": calls}, s
    assert_model_close(got, want, what=f"qwen/{func.__name__}")


@settings(max_examples=10, deadline=None)
@given(keep=st.lists(st.lists(st.booleans(), min_size=T, max_size=T), min_size=B, max_size=B),
       backend=st.sampled_from(BACKENDS))
def test_qwen_any_text_pattern(keep, backend):
    """Random text masks (any pattern, empty rows included) against the stock model."""
    keep = torch.tensor(keep, dtype=torch.bool)
    ref = run_qwen(keep)
    baseline = run_qwen(keep, perm=torch.tensor([1, 2, 0]))
    m = qwen()
    va.enable_varlen(m, backend=backend)
    try:
        va.reset_stats()
        got = run_qwen(keep)
        s = va.stats()
    finally:
        va.disable_varlen(m)
    assert s["plan_builds"] == QWEN_ATTN_LAYERS and s["host_syncs"] == 0, s
    assert s["fallbacks"] == {} and s["backends"] == {backend: QWEN_ATTN_LAYERS}, s
    assert_model_close(got, ref, baseline=baseline, what=f"qwen/random/{backend}")


# --------------------------------------------------------------------------------------------
# Flux (mask through joint_attention_kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(FLUX_CASES))
def test_flux_matches_stock(case, backend):
    check_case("flux", case, backend)


@pytest.mark.parametrize("backend", (None,) + BACKENDS)
def test_flux_mask_is_honoured(backend):
    """Flux does not ignore ``joint_attention_kwargs["attention_mask"]``: each sample of the
    masked batch equals that sample run alone, unmasked, with its prompt cut to its valid tokens
    (an empty prompt: no text at all). Stock (backend None) and varlen alike."""
    lens = [5, 2, 0]
    alone = [run_flux(None, sample=i, text_len=lens[i], grad=False)[0] for i in range(B)]
    mask = flux_joint_mask(prefix_keep(lens), "key_bool")
    m = flux()
    if backend is not None:
        va.enable_varlen(m, backend=backend)
    try:
        va.reset_stats()
        out = run_flux(mask, grad=False)[0]
        s = va.stats()
    finally:
        va.disable_varlen(m)
    for i in range(B):
        assert_model_close(out[i:i + 1], alone[i], what=f"flux/sample {i} alone/{backend}")
    unmasked = run_flux(None, grad=False)[0]
    assert rel_diff(out, unmasked) > 1e-4  # the mask changes the answer
    if backend is not None:
        assert s["backends"] == {backend: FLUX_ATTN_LAYERS} and s["plan_builds"] == FLUX_ATTN_LAYERS, s


@pytest.mark.parametrize("backend", BACKENDS)
def test_flux_one_plan_per_attention_call(backend):
    """A fresh user mask per forward: one plan per attention call, built on the device (a
    boolean key-padding mask: no host read). Passing the *same* mask object again changes
    nothing: plans are built from each call's mask, never looked up by the mask object."""
    m = flux()
    keep = prefix_keep([5, 2, 0])
    va.enable_varlen(m, backend=backend)
    try:
        va.reset_stats()
        for _ in range(3):
            run_flux(flux_joint_mask(keep, "key_bool"), grad=False)
        s = va.stats()
        assert s["plan_builds"] == 3 * FLUX_ATTN_LAYERS and s["host_syncs"] == 0, s
        assert s["backends"] == {backend: 3 * FLUX_ATTN_LAYERS} and s["fallbacks"] == {}, s
        same = flux_joint_mask(keep, "key_bool")
        va.reset_stats()
        # run_flux indexes the mask by the batch order (a new tensor), so call the model directly
        for _ in range(2):
            m(**{k: INPUTS[k] for k in ("hidden_states", "encoder_hidden_states", "pooled_projections",
                                        "timestep")},
              img_ids=IMG_IDS, txt_ids=TXT_IDS, joint_attention_kwargs={"attention_mask": same},
              return_dict=False)
        s = va.stats()
        assert s["plan_builds"] == 2 * FLUX_ATTN_LAYERS and s["host_syncs"] == 0, s
        assert s["backends"] == {backend: 2 * FLUX_ATTN_LAYERS} and s["fallbacks"] == {}, s
    finally:
        va.disable_varlen(m)


@settings(max_examples=10, deadline=None)
@given(lens=st.lists(st.integers(0, T), min_size=B, max_size=B), backend=st.sampled_from(BACKENDS),
       form=st.sampled_from(["key_bool", "key_neg_inf", "outer_bool"]))
def test_flux_any_prompt_lengths(lens, backend, form):
    """Random prompt lengths in each mask form: equal to stock; a boolean key-padding mask planned
    in every call with no host read, a boolean outer product in every call with a host read per
    call (its check), a float mask once (plans kept from earlier examples forgotten first), with
    a host read per call."""
    mask = flux_joint_mask(prefix_keep(lens), form)
    ref = run_flux(mask)
    baseline = run_flux(mask, perm=torch.tensor([1, 2, 0]))
    m = flux()
    va.enable_varlen(m, backend=backend)
    try:
        va.clear_plan_cache()
        va.reset_stats()
        got = run_flux(mask.clone())
        s = va.stats()
    finally:
        va.disable_varlen(m)
    syncs = 0 if form == "key_bool" else FLUX_ATTN_LAYERS
    assert s["plan_builds"] == (1 if form == "key_neg_inf" else FLUX_ATTN_LAYERS) and s["host_syncs"] == syncs, s
    assert s["fallbacks"] == {} and s["backends"] == {backend: FLUX_ATTN_LAYERS}, s
    assert_model_close(got, ref, baseline=baseline, what=f"flux/{lens}/{form}/{backend}")


def _flux_2d_forward(backend):
    """varlen run of a Flux batch with a 2-D [B, T+N] user mask: (result, stats)."""
    m = flux()
    va.enable_varlen(m, backend=backend)
    try:
        va.reset_stats()
        got = run_flux(flux_joint_mask(prefix_keep([5, 2, 0]), "key_2d"))
        return got, va.stats()
    finally:
        va.disable_varlen(m)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flux_2d_mask_matches_stock(backend):
    """A [B, T+N] mask (diffusers' native backend reshapes it per call): stock reads it as the
    [B, 1, 1, T+N] key-padding mask, and varlen matches it."""
    ref, baseline = stock("flux", "prefix")
    ref_2d = run_flux(flux_joint_mask(prefix_keep([5, 2, 0]), "key_2d"))
    assert_model_close(ref_2d, ref, what="flux/stock 2d vs 4d mask")
    got, s = _flux_2d_forward(backend)
    # the permuted 4-D run is an equivalent computation of ref_2d too
    assert_model_close(got, ref_2d, baseline=baseline, what=f"flux/2d/{backend}")
    assert s["backends"] == {backend: FLUX_ATTN_LAYERS} and s["fallbacks"] == {}, s
    assert s["plan_builds"] == FLUX_ATTN_LAYERS, s


@pytest.mark.parametrize("backend", BACKENDS)
def test_flux_2d_mask_costs_no_host_read(backend):
    """The [B, 1, 1, S] view diffusers makes of a 2-D mask in every call is a boolean key-padding
    mask: each call builds its plan on the device, with no host read."""
    _, s = _flux_2d_forward(backend)
    assert s["plan_builds"] == FLUX_ATTN_LAYERS and s["host_syncs"] == 0, s


def _cache_configs():
    from diffusers import FirstBlockCacheConfig, PyramidAttentionBroadcastConfig
    return {
        # skips every block after the first on a hit (a transformer block's attention included)
        "first_block_cache": FirstBlockCacheConfig(threshold=0.5),
        # returns an attention module's cached output without its forward on every other step
        "pyramid_attention_broadcast": PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(0, 1000),
            current_timestep_callback=lambda: 500),
    }


@pytest.mark.parametrize("cache", ["first_block_cache", "pyramid_attention_broadcast"])
@pytest.mark.parametrize("order", ["cache after enabling", "cache before enabling"])
def test_qwen_under_diffusers_caches_equals_stock(cache, order):
    """diffusers' caches (``model.enable_cache``) skip attention modules on a hit: fewer masked
    attention calls reach varlen_attn in some steps. Denoising steps equal stock's with the same
    cache, every masked call that did run ran packed (no fallback) with a plan of its own."""
    config = _cache_configs()[cache]
    mask = prefix_keep([5, 2, 0])
    stock_model, model = qwen_model(), qwen_model()
    if order == "cache before enabling":
        model.enable_cache(config)
    va.enable_varlen(model, backend="split_sdpa")
    if order == "cache after enabling":
        model.enable_cache(config)
    stock_model.enable_cache(config)
    inputs = {"hidden_states": INPUTS["hidden_states"], "encoder_hidden_states": INPUTS["encoder_hidden_states"],
              "encoder_hidden_states_mask": mask, "img_shapes": [(1, H_IMG, W_IMG)] * B}
    calls = []
    try:
        with torch.no_grad():
            for t in (0.9, 0.89, 0.88, 0.87):
                step_inputs = {**inputs, "timestep": torch.full((B,), t, dtype=torch.float64)}
                with stock_model.cache_context("cond"):
                    ref = stock_model(**step_inputs, return_dict=False)[0]
                va.reset_stats()
                with model.cache_context("cond"):
                    got = model(**step_inputs, return_dict=False)[0]
                s = va.stats()
                calls.append(sum(s["backends"].values()))
                assert s["fallbacks"] == {} and s["plan_builds"] == calls[-1] and s["host_syncs"] == 0, s
                assert_model_close(got, ref, what=f"{cache}, t={t}")
        assert min(calls) < max(calls) == QWEN_ATTN_LAYERS, calls  # the cache did skip attention
    finally:
        va.disable_varlen(model)
