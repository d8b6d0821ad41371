"""HunyuanVideo (diffusers ``HunyuanVideoTransformer3DModel``) under ``enable_varlen``: outputs and
the gradient of every parameter equal the stock model's, in float64 on the CPU.

Where masks reach attention in HunyuanVideo (diffusers 0.42), from its one mask input
``encoder_attention_mask`` ``[B, T]`` (True/1 = valid text token):

1. The token refiner (``context_embedder.token_refiner``, direct ``F.scaled_dot_product_attention``
   in ``AttnProcessor2_0``) builds ``[B, 1, T, T]``: ``m[:, None, :, None] & m[:, None, None, :]``
   and then, in place, ``mask[:, :, :, 0] = True``. So a valid query row sees the valid keys plus
   key 0 and a padded query row sees key 0 only. Per batch element that is a segment pattern (and
   packable) only when the text mask is all valid, all padded (empty prompt: every row sees key
   0), or exactly ``[1, 0, ..., 0]`` (every row sees key 0). Any other mask (e.g. 3 of 6 tokens)
   has rows with overlapping but different key sets: that attention legitimately falls back to
   masked SDPA (``backend="auto"``, reason recorded), and an explicit varlen backend raises
   ``BackendUnavailableError`` (explicit names never fall back silently).
   ``test_refiner_packability_all_masks`` checks this rule on every mask of length 4.
2. The joint attention of every dual- and single-stream block uses one ``[B, 1, 1, N]`` key
   padding mask over ``[image; text]`` (image first), valid keys = image + the first
   ``sum(m)`` text tokens: always packable.

Plan builds and host reads (``va.stats()``): the joint mask is a boolean key-padding mask, so
every joint call (dual-stream and single-stream blocks, and a checkpointed block's recomputation)
builds its own plan from its own mask with no host read. The refiner's ``[B, 1, T, T]`` mask
(``[B, H, T, T]`` once the processor repeats it per head) is read on the host once per call,
also when it then turns out not packable, and planned once (its layers' masks are equal).

Empty prompt: stock diffusers divides by ``mask.sum() == 0`` when pooling the text in
``HunyuanVideoTokenRefiner`` and returns NaN for that sample (and NaN in every parameter
gradient). ``test_empty_prompt_stock_nan`` documents that; the other empty-prompt tests patch
the pooled NaN to 0 with a forward pre-hook (in both the stock and the varlen run) so the
empty prompt's masks (all text keys dropped) can be compared with gradients.

No mask: stock requires ``encoder_attention_mask`` (``None.sum`` raises AttributeError); the
varlen-enabled model raises the same error.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

import varlen_attn as va
from _models import HY_T, HY_TEXT_DIM, hunyuan_inputs, hunyuan_model, hunyuan_text_mask, step
from _testing import assert_model_close

T = HY_T  # padded text length
BACKENDS = ("split_sdpa", "reference")
STRUCTURE = (
    "attn_mask is not a padding/segment pattern: two queries attend overlapping but "
    "different key sets (e.g. causal, sliding-window or arbitrary per-query masks)"
)
# Tolerance: _testing.assert_model_close (floor only: float64 stock vs float64 varlen).

# Masked attention calls of one forward of the tiny model (``hunyuan_model()``): one refiner
# layer; one dual-stream and one single-stream block, which share the joint key-padding mask.
REFINER_CALLS, JOINT_CALLS = 1, 2


def assert_counts(st, refiner_calls=REFINER_CALLS, joint_calls=JOINT_CALLS, unpackable_refiner=False):
    """One plan build per joint call (a boolean key-padding mask), with no host read; one plan for
    the refiner's ``[B, H, T, T]`` mask (read as a padding mask; equal in every refiner layer),
    with one host read per refiner call, and a second one in its build where that mask is not a
    padding mask (``unpackable_refiner``: read in full to find whether it is packable at all)."""
    assert st["plan_builds"] == min(refiner_calls, 1) + joint_calls, st
    assert st["host_syncs"] == refiner_calls * (2 if unpackable_refiner else 1), st



@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("VARLEN_ATTN_BACKEND", raising=False)  # "auto" must mean auto


@pytest.fixture(scope="module")
def model():
    return hunyuan_model()


@contextlib.contextmanager
def pooled_nan_guard(model):
    """Empty prompts: replace the refiner's pooled 0/0 = NaN by 0 (same patch for stock and varlen)."""
    def hook(_module, args):
        return (args[0], torch.nan_to_num(args[1], nan=0.0))

    handle = model.context_embedder.time_text_embed.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def run(model, inp, mask):
    """Output and every parameter's gradient (``_models.step``)."""
    return step(model, {**inp, "encoder_attention_mask": mask})


def run_varlen(model, inp, mask, backend, checkpointing=False, **kwargs):
    """``run`` with varlen enabled; returns (output, grads, stats) and always restores the model."""
    if checkpointing:
        model.enable_gradient_checkpointing()
    va.enable_varlen(model, backend=backend, **kwargs)
    try:
        va.reset_stats()
        out, grads = run(model, inp, mask)
        return out, grads, va.stats()
    finally:
        va.disable_varlen(model)
        if checkpointing:
            model.disable_gradient_checkpointing()


# Batches. Packable: every sample's text mask is full, empty or [1, 0, ..., 0] (prompt length
# T, 0 or 1), so all three masked attentions pack. Unpackable: some sample has 2..T-1 tokens.
PACKABLE = {
    "lengths_6_1": ([6, 1], False),
    "lengths_1_6_0_empty": ([1, 6, 0], True),
    "all_true": ([6, 6, 6], False),
}
UNPACKABLE = {
    "lengths_6_3_2": ([6, 3, 2], False),
    "lengths_4_0_empty": ([4, 0], True),
    "lengths_2_5_1": ([2, 5, 1], False),
    # Not right padded: stock's joint mask keeps the first sum(m) text tokens, its refiner the
    # marked ones; varlen must reproduce both readings.
    "holes": ([[1, 0, 1, 1, 0, 1], 6], False),
}

_REF_CACHE: dict = {}


def stock(model, name, rows, guard, seed=0):
    """Stock result (no varlen, no checkpointing), cached per case."""
    key = (name, seed)
    if key not in _REF_CACHE:
        inp, mask = hunyuan_inputs(len(rows), seed), hunyuan_text_mask(rows)
        with pooled_nan_guard(model) if guard else contextlib.nullcontext():
            _REF_CACHE[key] = run(model, inp, mask)
    return _REF_CACHE[key]


def varlen_case(model, name, rows, guard, backend, seed=0, **kwargs):
    inp, mask = hunyuan_inputs(len(rows), seed), hunyuan_text_mask(rows)
    with pooled_nan_guard(model) if guard else contextlib.nullcontext():
        return run_varlen(model, inp, mask, backend, **kwargs)


# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS + ("auto",))
@pytest.mark.parametrize("case", list(PACKABLE))
def test_packable_batches_equal_stock(model, case, backend):
    rows, guard = PACKABLE[case]
    ref = stock(model, case, rows, guard)
    got = varlen_case(model, case, rows, guard, backend)
    assert_model_close(got[:2], ref, what=f"hunyuan/{case}/{backend}")
    st = got[2]
    assert_counts(st)
    assert st["fallbacks"] == {}
    # 1 refiner + 1 dual + 1 single attention, all packed.
    assert st["backends"] == {("split_sdpa" if backend == "auto" else backend): 3}


@pytest.mark.parametrize("case", list(UNPACKABLE))
def test_unpackable_refiner_mask_falls_back_under_auto(model, case):
    rows, guard = UNPACKABLE[case]
    ref = stock(model, case, rows, guard)
    got = varlen_case(model, case, rows, guard, "auto")
    assert_model_close(got[:2], ref, what=f"hunyuan/{case}/auto")
    st = got[2]
    assert_counts(st, unpackable_refiner=True)  # the refiner's plan is still built (it finds the mask unpackable)
    assert st["fallbacks"] == {STRUCTURE: 1}  # only the refiner; joint attention packs
    assert st["backends"] == {"sdpa": 1, "split_sdpa": 2}


@pytest.mark.parametrize("backend", BACKENDS)
def test_unpackable_refiner_mask_with_explicit_backend_raises(model, backend):
    rows, guard = UNPACKABLE["lengths_6_3_2"]
    with pytest.raises(va.BackendUnavailableError, match="needs a packable mask"):
        varlen_case(model, "x", rows, guard, backend)
    with pytest.raises(va.NotPackableError, match="overlapping but different key sets"):
        varlen_case(model, "x", rows, guard, "auto", strict=True)
    assert getattr(model, "_varlen_state", None) is None  # disabled again after the error


@pytest.mark.parametrize("backend", ["split_sdpa", "reference", "auto"])
def test_gradient_checkpointing_equals_stock_without(model, backend):
    # Explicit backends: packable batch with an empty prompt; auto: an unpackable refiner mask.
    name = "lengths_1_6_0_empty" if backend != "auto" else "lengths_6_3_2"
    rows, guard = (PACKABLE | UNPACKABLE)[name]
    ref = stock(model, name, rows, guard)  # no checkpointing
    got = varlen_case(model, name, rows, guard, backend, checkpointing=True)
    assert not model.gradient_checkpointing
    assert_model_close(got[:2], ref, what=f"hunyuan/checkpointing/{name}/{backend}")
    st = got[2]
    # Dual + single block run twice (forward, recompute), each call with its own key-padding
    # plan; the refiner is not checkpointed.
    assert_counts(st, joint_calls=2 * JOINT_CALLS, unpackable_refiner=backend == "auto")
    if backend == "auto":
        assert st["fallbacks"] == {STRUCTURE: 1}
        assert st["backends"] == {"sdpa": 1, "split_sdpa": 4}
    else:
        assert st["fallbacks"] == {}
        assert st["backends"] == {backend: 5}


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
def test_pipeline_mask_dtypes(model, dtype, caplog):
    # The tokenizer gives an int64 mask; HunyuanVideoPipeline casts it to the transformer dtype.
    # Stock reads both as keep-masks (.bool(), sum), as does varlen (float_mask="bool").
    rows = [6, 3, 1]
    inp, mask = hunyuan_inputs(3, seed=1), hunyuan_text_mask(rows).to(dtype)
    ref = run(model, inp, mask)
    with caplog.at_level(logging.WARNING, logger="varlen_attn"):
        got = run_varlen(model, inp, mask, "auto")
    assert_model_close(got[:2], ref, what=f"hunyuan/mask {dtype}")
    assert_counts(got[2], unpackable_refiner=True)
    assert got[2]["fallbacks"] == {STRUCTURE: 1}


def test_empty_prompt_stock_nan(model):
    """Without the guard, stock returns NaN for the empty-prompt sample (0/0 in the refiner's
    pooling) and NaN in every parameter gradient. The other samples must still equal stock."""
    rows = [5, 0, 3]
    inp, mask = hunyuan_inputs(3, seed=2), hunyuan_text_mask(rows)
    ref_out, ref_grads = run(model, inp, mask)
    assert torch.isnan(ref_out[1]).all()
    assert not torch.isnan(ref_out[[0, 2]]).any()
    assert all(torch.isnan(g).any() for g in ref_grads.values())
    out, _, st = run_varlen(model, inp, mask, "auto")
    assert_model_close(out[[0, 2]], ref_out[[0, 2]], what="hunyuan/the samples with a prompt")
    # Deviation from stock (reported, not a contract): varlen drops masked keys instead of
    # multiplying them by zero, so the NaN text tokens of the empty sample never reach its image
    # tokens and its output is finite where stock's is NaN.
    assert not torch.isnan(out[1]).any()
    assert st["fallbacks"] == {STRUCTURE: 1}


def test_no_mask_is_rejected_like_stock(model):
    inp = hunyuan_inputs(2)
    with pytest.raises(AttributeError) as stock_err:
        model(**inp, encoder_attention_mask=None)
    va.enable_varlen(model, backend="split_sdpa")
    try:
        va.reset_stats()
        with pytest.raises(AttributeError) as varlen_err:
            model(**inp, encoder_attention_mask=None)
    finally:
        va.disable_varlen(model)
    assert str(varlen_err.value) == str(stock_err.value)
    assert va.stats()["plan_builds"] == 0


def _refiner_packable(m: torch.Tensor) -> bool:
    """The rule derived above, per sample: full, empty, or only token 0."""
    return bool(m.all()) or not bool(m[1:].any())


@pytest.fixture(scope="module")
def refiner():
    return hunyuan_model().context_embedder


@pytest.mark.parametrize("bits", range(16))
def test_refiner_packability_all_masks(refiner, bits):
    """Every [1, 4] text mask through the token refiner alone (HunyuanVideoTokenRefiner, whose
    mask input is ``attention_mask``): falls back exactly when the rule says, equal to stock; one
    plan (one host read) for its one masked call."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 4, HY_TEXT_DIM, generator=g, dtype=torch.float64)
    t = torch.tensor([400])
    m = torch.tensor([[(bits >> i) & 1 for i in range(4)]], dtype=torch.bool)
    ref = refiner(x, t, m)
    va.enable_varlen(refiner, backend="auto")
    try:
        va.reset_stats()
        got = refiner(x, t, m)
    finally:
        va.disable_varlen(refiner)
    st = va.stats()
    packable = _refiner_packable(m[0])
    # The empty mask gives NaN in both (pooling 0/0), hence equal_nan.
    assert_model_close(got, ref, what=f"hunyuan/refiner, mask {m.tolist()}", equal_nan=True)
    assert st["fallbacks"] == ({} if packable else {STRUCTURE: 1}), (m, st)
    assert st["plan_builds"] == 1 and st["host_syncs"] == (1 if packable else 2), (m, st)


def test_two_refiner_layers_share_one_plan():
    """Two refiner layers (diffusers' default) and two blocks of each kind: equal to stock; the 2
    refiner calls take a host read each and share one plan, the 4 joint calls plan each without
    one."""
    m = hunyuan_model(num_refiner_layers=2, num_layers=2)
    rows = [6, 1]
    inp, mask = hunyuan_inputs(2), hunyuan_text_mask(rows)
    ref = run(m, inp, mask)
    got = run_varlen(m, inp, mask, "split_sdpa")
    assert_model_close(got[:2], ref, what="hunyuan/two refiner layers")
    assert_counts(got[2], refiner_calls=2, joint_calls=4)
    assert got[2]["fallbacks"] == {} and got[2]["backends"] == {"split_sdpa": 6}
