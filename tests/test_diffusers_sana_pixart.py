"""Sana and PixArt under ``enable_varlen``: output and every parameter gradient equal the stock model's.

Both models run text cross-attention (queries = image tokens, keys = text tokens) through legacy
processors (``SanaAttnProcessor2_0``, ``AttnProcessor2_0``) that call SDPA directly with the mask
the model derived from ``encoder_attention_mask`` [B, T] (0/1): ``(1 - m.to(dtype)) * -10000``,
``unsqueeze(1)``, ``prepare_attention_mask`` (repeat_interleave to [B*H, 1, T]) and a ``view`` to
[B, H, 1, T]. Sana's self-attention is linear attention (no SDPA at all); PixArt's self-attention
is unmasked SDPA unless ``attention_mask`` is given.

Tolerance: ``_testing.assert_model_close``. An empty prompt (every text token masked) makes a
-10000 row; SDPA attends to all keys there (softmax shift invariance), but it rounds the scores
``s - 10000`` to the float64 grid at 10000 (ulp ~1.8e-12), so the *stock* result carries hundreds
of ulps of rounding noise that an exact computation does not. The baseline measures that noise
per case: the stock model run with the empty rows replaced by all-ones (mathematically the same
attention, no -10000 rounding). varlen may be at most 2x as far from stock as the baseline is
(or within the floor), and must also be within the floor of the baseline itself (it computes
the empty row as unmasked attention, without the -10000 rounding). Some gradients (``to_k.bias``)
are exactly zero in exact arithmetic and pure rounding noise in both runs: the floor's scale is
clamped at 1 for them.
"""

from __future__ import annotations

import pytest
import torch

import varlen_attn as va
from _models import (PIXART_LATENT, SANA_LATENT, SP_B, SP_LAYERS, SP_T, pixart_model, sana_model,
                     sana_pixart_inputs, step)
from _testing import assert_model_close, assert_model_equal

DT = torch.float64
BACKENDS = ("split_sdpa", "reference")
B, T, LAYERS = SP_B, SP_T, SP_LAYERS

# keep masks [B, T]: each holds an empty prompt (row of zeros) unless it says otherwise
KEEPS = {
    "ragged_with_empty": [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]],
    "holes_with_empty": [[1, 0, 1, 1, 0, 1], [0, 0, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0]],
    "all_true": [[1] * T] * B,
    "all_empty": [[0] * T] * B,  # caption dropout on the whole batch
}
MASK_DTYPES = (torch.bool, torch.int64, torch.float64, torch.float32)

# name -> (builder, latent shape). Sana's self-attention is linear attention, PixArt's unmasked
# SDPA: an SDPA call without a mask runs stock inside an enabled model, uncounted.
MODELS = {
    "sana": (sana_model, SANA_LATENT),
    "pixart": (pixart_model, PIXART_LATENT),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def setup(request):
    build, shape = MODELS[request.param]
    model = build()
    inputs = sana_pixart_inputs(shape, seed=42)
    yield request.param, model, inputs
    va.disable_varlen(model)



def _run(model, inputs, **masks):
    """Output and the grad of every parameter (``_models.step``)."""
    return step(model, {**inputs, **masks})


def _with_varlen(model, inputs, backend, enable_kwargs=None, forwards=1, **masks):
    va.enable_varlen(model, backend=backend, **(enable_kwargs or {}))
    try:
        va.reset_stats()
        for _ in range(forwards):
            got = _run(model, inputs, **masks)
        return got, va.stats()
    finally:
        va.disable_varlen(model)


def _exact_mask(mask):
    """Same attention as ``mask``, without SDPA's -10000 rounding: empty rows become all-ones."""
    if mask is None:
        return None
    empty = (mask == 0).all(-1, keepdim=True)
    return torch.where(empty, torch.ones_like(mask), mask)


_STOCK: dict = {}


def _stock(name, model, inputs, key, masks, exact=None):
    """(stock, baseline) for ``masks`` (a dict of model mask arguments), computed once per model
    and ``key`` (parametrizations over backends share it). The baseline is stock with the
    ``exact`` masks (default: :func:`_exact_mask` of each); where they equal ``masks`` (no empty
    row) it is the same computation, and stock itself is the baseline."""
    if (name, key) not in _STOCK:
        stock = _run(model, inputs, **masks)
        exact = {k: _exact_mask(m) for k, m in masks.items()} if exact is None else exact
        same = all(torch.equal(exact[k], m) for k, m in masks.items())
        _STOCK[name, key] = stock, (stock if same else _run(model, inputs, **exact))
    return _STOCK[name, key]


def _assert_equal_to_stock(got, stock, baseline, what=""):
    assert_model_close(got, stock, baseline=baseline, what=what)
    assert_model_close(got, baseline, what=f"{what} vs exact")


def _keep(case, dtype):
    return torch.tensor(KEEPS[case]).to(dtype)


# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_dtype", MASK_DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(KEEPS))
def test_text_mask_equals_stock(setup, case, mask_dtype, backend):
    name, model, inputs = setup
    mask = _keep(case, mask_dtype)
    stock, baseline = _stock(name, model, inputs, (case, mask_dtype), {"encoder_attention_mask": mask})
    got, st = _with_varlen(model, inputs, backend, encoder_attention_mask=mask)
    _assert_equal_to_stock(got, stock, baseline, f"{name}/{case}/{mask_dtype}/{backend}")
    # Whatever the input's dtype, the model hands SDPA a -10000 float mask [B, H, 1, T], equal in
    # every layer: the first call builds the plan, every masked call reads the host once (the
    # build's read, then the comparison with the kept copy); backward builds none.
    assert st["plan_builds"] == 1, st
    assert st["host_syncs"] == LAYERS, st
    assert st["fallbacks"] == {}, st
    # One masked cross-attention per layer, all packed; PixArt's unmasked self-attention is
    # stock's own call, not counted.
    assert st["backends"] == {backend: LAYERS}, st


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_mask_is_stock(setup, backend):
    name, model, inputs = setup
    stock, _ = _stock(name, model, inputs, "none", {})
    got, st = _with_varlen(model, inputs, backend)
    assert_model_close(got, stock, what=f"{name}/none/{backend}")
    # Nothing to pack: no plan, and every SDPA call is stock's own, untouched and not counted.
    assert st["plan_builds"] == 0 and st["host_syncs"] == 0, st
    assert st["fallbacks"] == {}, st
    assert st["backends"] == {}, st


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_plan_per_masked_attention_call(setup, backend):
    """Two forwards (each with its backward) of one mask: one plan build for the distinct mask, one
    host read per masked attention call (the build's, then each comparison with the kept copy),
    2 x layers in all; the backward builds none."""
    name, model, inputs = setup
    mask = _keep("ragged_with_empty", torch.int64)
    _, st = _with_varlen(model, inputs, backend, forwards=2, encoder_attention_mask=mask)
    assert st["plan_builds"] == 1 and st["host_syncs"] == 2 * LAYERS, st
    assert st["backends"][backend] == 2 * LAYERS and st["fallbacks"] == {}, st


@pytest.mark.parametrize("backend", BACKENDS)
def test_float_mask_bias_policy_equals_stock(setup, backend):
    """float_mask='bias' keeps the float 0/1 input as given; the model itself turns it into a
    -10000 bias, so the result and the plan and host-read counts are the same as under the
    default policy."""
    name, model, inputs = setup
    mask = _keep("ragged_with_empty", torch.float64)
    stock, baseline = _stock(name, model, inputs, ("ragged_with_empty", torch.float64),
                             {"encoder_attention_mask": mask})
    got, st = _with_varlen(model, inputs, backend, {"float_mask": "bias"}, encoder_attention_mask=mask)
    _assert_equal_to_stock(got, stock, baseline, f"{name}/bias-policy/{backend}")
    assert st["plan_builds"] == 1 and st["host_syncs"] == LAYERS, st
    assert st["fallbacks"] == {} and st["backends"][backend] == LAYERS, st


def _bias_stock(name, model, inputs, keep_case):
    """(stock, baseline, bias) for the ready bias [B, 1, T] made from KEEPS[keep_case]."""
    keep = _keep(keep_case, DT)
    bias = ((1 - keep) * -10000.0)[:, None]
    exact = ((1 - _exact_mask(keep)) * -10000.0)[:, None]
    stock, baseline = _stock(name, model, inputs, ("bias", keep_case), {"encoder_attention_mask": bias},
                             {"encoder_attention_mask": exact})
    return stock, baseline, bias


@pytest.mark.parametrize("keep_case", ["ragged_with_empty", "all_true"])
def test_precomputed_bias_input_with_bias_policy(setup, keep_case):
    """Both models also accept the mask as a ready bias [B, 1, T] (0 keep, -10000 drop; used as
    is since ndim != 2). That is an additive float, so it needs float_mask='bias'."""
    name, model, inputs = setup
    stock, baseline, bias = _bias_stock(name, model, inputs, keep_case)
    got, st = _with_varlen(model, inputs, "split_sdpa", {"float_mask": "bias"}, encoder_attention_mask=bias)
    _assert_equal_to_stock(got, stock, baseline, f"{name}/bias-input/{keep_case}")
    assert st["plan_builds"] == 1 and st["host_syncs"] == LAYERS, st
    assert st["fallbacks"] == {} and st["backends"]["split_sdpa"] == LAYERS, st


@pytest.mark.parametrize("keep_case", ["ragged_with_empty", "all_true"])
def test_precomputed_bias_input_default_policy(setup, keep_case):
    """Under the default float_mask='bool' a ready -10000 bias [B, 1, T] is not a 0/1 mask, so it
    keeps SDPA's additive reading: same result as stock, one plan for the mask, one host read per
    masked call, no fallback."""
    name, model, inputs = setup
    stock, baseline, bias = _bias_stock(name, model, inputs, keep_case)
    got, st = _with_varlen(model, inputs, "split_sdpa", {}, encoder_attention_mask=bias)
    _assert_equal_to_stock(got, stock, baseline, f"{name}/bias-input-default/{keep_case}")
    assert st["plan_builds"] == 1 and st["host_syncs"] == LAYERS and st["fallbacks"] == {}, st


def test_precomputed_zero_bias_input_default_policy(setup):
    """An all-zero bias [B, 1, T] (keep every token) is not 0/1-with-a-one: stock reading."""
    name, model, inputs = setup
    bias = torch.zeros(B, 1, T, dtype=DT)
    with torch.no_grad():
        stock = model(**inputs, encoder_attention_mask=bias, return_dict=False)[0]
        va.enable_varlen(model, backend="split_sdpa")
        try:
            got = model(**inputs, encoder_attention_mask=bias, return_dict=False)[0]
        finally:
            va.disable_varlen(model)
    assert_model_close(got, stock, what=f"{name}/zero bias")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_checkpointing_equals_stock(setup, backend):
    name, model, inputs = setup
    mask = _keep("ragged_with_empty", torch.bool)
    stock, baseline = _stock(name, model, inputs, ("ragged_with_empty", torch.bool),
                             {"encoder_attention_mask": mask})
    model.enable_gradient_checkpointing()
    try:
        got, st = _with_varlen(model, inputs, backend, encoder_attention_mask=mask)
    finally:
        model.disable_gradient_checkpointing()
    _assert_equal_to_stock(got, stock, baseline, f"{name}/checkpointing/{backend}")
    # every block is checkpointed: its recomputation in backward is a second masked call per
    # layer, which reads the host once like the forward's, and takes the forward's plan
    assert st["plan_builds"] == 1 and st["host_syncs"] == 2 * LAYERS, st
    assert st["fallbacks"] == {} and st["backends"][backend] == 2 * LAYERS, st


@pytest.fixture(scope="module")
def pixart_self_cross():
    """A PixArt batch with both masks, its stock result and baseline (shared by the backends)."""
    model = pixart_model()
    g = torch.Generator().manual_seed(7)
    inputs = sana_pixart_inputs(PIXART_LATENT, timestep=(3, 300, 900), generator=g)
    n = 16  # (8 / patch 2)^2 image tokens
    am = (torch.rand(B, n, generator=g) > 0.3).long()
    am[1] = 0  # every image key masked for one sample: a -10000 row in self-attention too
    em = _keep("holes_with_empty", torch.int64)
    masks = {"attention_mask": am, "encoder_attention_mask": em}
    stock = _run(model, inputs, **masks)
    baseline = _run(model, inputs, attention_mask=_exact_mask(am), encoder_attention_mask=_exact_mask(em))
    return model, inputs, masks, stock, baseline


@pytest.mark.parametrize("backend", BACKENDS)
def test_pixart_self_and_cross_masks(pixart_self_cross, backend):
    """PixArt also takes ``attention_mask`` [B, N_image] for its self-attention: two masked calls
    per layer (self, cross), each a -10000 float mask: one plan per distinct mask, one host read
    per call."""
    model, inputs, masks, stock, baseline = pixart_self_cross
    got, st = _with_varlen(model, inputs, backend, **masks)
    _assert_equal_to_stock(got, stock, baseline, f"pixart/self+cross/{backend}")
    assert st["plan_builds"] == 2 and st["host_syncs"] == 2 * LAYERS, st
    assert st["fallbacks"] == {}, st
    assert st["backends"] == {backend: 2 * LAYERS}, st


def test_disable_restores_stock_bitwise(setup):
    name, model, inputs = setup
    mask = _keep("ragged_with_empty", torch.int64)
    before = _run(model, inputs, encoder_attention_mask=mask)
    _with_varlen(model, inputs, "split_sdpa", encoder_attention_mask=mask)
    assert "forward" not in model.__dict__ and not hasattr(model, "_varlen_state")
    va.reset_stats()
    after = _run(model, inputs, encoder_attention_mask=mask)
    assert va.stats()["backends"] == {} and va.stats()["plan_builds"] == 0
    assert_model_equal(after, before, f"{name}: stock after disable_varlen")
