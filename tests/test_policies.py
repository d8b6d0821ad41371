"""Every enable_varlen policy behaves the same on every path: eager, every block compiled
(``block.compile(fullgraph=True)``, regional compilation as OneTrainer and diffusers do it) and
the whole model compiled (``torch.compile(model, fullgraph=True)``).

The model is a tiny diffusers Chroma (its mask is re-derived in every block as an outer
product). Each test runs one policy on one path and checks what the policy promises: the result
against the stock model, the backend that ran, the fallback recorded, or the error raised.
"""

import pytest
import torch
from torch._dynamo.utils import counters

import varlen_attn as va
from _models import CHROMA_ATTN_LAYERS, chroma_inputs, step, tiny_chroma
from _testing import assert_model_close

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # conftest.py

PATHS = ("eager", "blocks", "whole")
# Dynamo with its plain "eager" backend: the policies are decided while tracing (constants handed
# to the custom op) and at run time inside it, so AOTAutograd adds nothing to what is tested here
# and would triple the time; tests/test_compile.py covers aot_eager and inductor.
BACKEND = "eager"
LENGTHS = (5, 2, 0)


def enabled(path, **policy):
    """A fresh tiny Chroma with ``enable_varlen(**policy)``, prepared for ``path``; returns
    ``(model, callable)``."""
    model = va.enable_varlen(tiny_chroma(), **policy)
    if path == "blocks":
        for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
            block.compile(fullgraph=True, backend=BACKEND)
        return model, model
    if path == "whole":
        return model, torch.compile(model, fullgraph=True, backend=BACKEND)
    return model, model


def run(fn, inputs):
    va.reset_stats()
    out, grads = step(fn, inputs)
    grads = {n.replace("_orig_mod.", ""): g for n, g in grads.items()}
    assert not counters["graph_break"], dict(counters["graph_break"])
    return (out, grads), va.stats()


def stock(inputs, checkpointing=False):
    model = tiny_chroma()
    if checkpointing:
        model.enable_gradient_checkpointing()
    return step(model, inputs)


BIAS_REASON = "additive bias"


# -- float_mask -----------------------------------------------------------------------------

@pytest.mark.parametrize("path", PATHS)
def test_float_mask_bool_reads_a_01_mask_as_keep_mask(path):
    inputs = chroma_inputs(LENGTHS, mask_dtype=torch.float64)
    _, fn = enabled(path, float_mask="bool")
    got, st = run(fn, inputs)
    assert_model_close(got, stock(chroma_inputs(LENGTHS)), what=f"{path}/bool")  # the bool mask's result
    assert st["backends"] == {"split_sdpa": CHROMA_ATTN_LAYERS} and not st["fallbacks"], st


@pytest.mark.parametrize("path", PATHS)
def test_float_mask_bias_keeps_sdpa_reading(path):
    inputs = chroma_inputs(LENGTHS, mask_dtype=torch.float64)
    _, fn = enabled(path, float_mask="bias")
    got, st = run(fn, inputs)
    assert_model_close(got, stock(inputs), what=f"{path}/bias")  # stock reads the float mask as a bias
    assert st["backends"] == {"sdpa": CHROMA_ATTN_LAYERS}, st
    assert [r for r in st["fallbacks"] if BIAS_REASON in r], st


@pytest.mark.parametrize("path", PATHS)
def test_float_mask_error_raises(path):
    _, fn = enabled(path, float_mask="error")
    with pytest.raises(Exception, match="float_mask='error'") as info:
        step(fn, chroma_inputs(LENGTHS, mask_dtype=torch.float64))
    assert isinstance(info.value, (va.InputTypeError, RuntimeError)), info.value


@pytest.mark.parametrize("path", PATHS)
def test_float_mask_policies_leave_bool_masks_alone(path):
    inputs = chroma_inputs(LENGTHS)
    _, fn = enabled(path, float_mask="error")
    got, st = run(fn, inputs)
    assert_model_close(got, stock(inputs), what=f"{path}/bool mask")
    assert st["backends"] == {"split_sdpa": CHROMA_ATTN_LAYERS}, st


# -- strict -----------------------------------------------------------------------------------

@pytest.mark.parametrize("path", PATHS)
def test_strict_raises_on_a_mask_that_cannot_be_packed(path):
    _, fn = enabled(path, strict=True, float_mask="bias")  # the float 0/1 mask is then a bias
    with pytest.raises(Exception, match=BIAS_REASON) as info:
        step(fn, chroma_inputs(LENGTHS, mask_dtype=torch.float64))
    assert isinstance(info.value, (va.NotPackableError, RuntimeError)), info.value


@pytest.mark.parametrize("path", PATHS)
def test_strict_runs_packable_masks(path):
    inputs = chroma_inputs(LENGTHS)
    _, fn = enabled(path, strict=True)
    got, st = run(fn, inputs)
    assert_model_close(got, stock(inputs), what=f"{path}/strict")
    assert st["backends"] == {"split_sdpa": CHROMA_ATTN_LAYERS}, st


# -- backend ----------------------------------------------------------------------------------

@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_backend_is_the_one_that_runs(path, backend):
    inputs = chroma_inputs(LENGTHS)
    _, fn = enabled(path, backend=backend)
    got, st = run(fn, inputs)
    assert_model_close(got, stock(inputs), what=f"{path}/{backend}")
    assert st["backends"] == {backend: CHROMA_ATTN_LAYERS} and not st["fallbacks"], st


@pytest.mark.parametrize("path", PATHS)
def test_explicit_backend_never_falls_back(path):
    _, fn = enabled(path, backend="reference", float_mask="bias")
    with pytest.raises(Exception, match="needs a packable mask") as info:
        step(fn, chroma_inputs(LENGTHS, mask_dtype=torch.float64))
    assert isinstance(info.value, (va.BackendUnavailableError, RuntimeError)), info.value


# -- restore_checkpoint_mask ------------------------------------------------------------------

@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("restore", [True, False])
def test_restore_checkpoint_mask(path, restore):
    """diffusers' Chroma calls its checkpointed single blocks without the mask. restore=True:
    the result equals the model without checkpointing; False: it equals stock with
    checkpointing (diffusers' behaviour), which differs."""
    inputs = chroma_inputs(LENGTHS)
    model, fn = enabled(path, restore_checkpoint_mask=restore)
    model.enable_gradient_checkpointing()
    got, _ = run(fn, inputs)
    want = stock(inputs, checkpointing=not restore)
    other = stock(inputs, checkpointing=restore)
    assert (want[0] - other[0]).abs().max() > 1e-3, "the checkpoint mask must matter for this test"
    assert_model_close(got, want, what=f"{path}/restore={restore}")


# -- gradient checkpointing -------------------------------------------------------------------

@pytest.mark.parametrize("path", PATHS)
def test_checkpointed_blocks_run_their_attention_on_every_path(path):
    """With diffusers' gradient checkpointing, attention runs on varlen_attn in the forward and
    in the recomputation on every path; with the whole model compiled too, where the checkpoint
    is a higher-order op whose body dynamo traces apart from the modes around it (the hook is
    entered inside the checkpointed call: before, attention there ran stock SDPA, unrecorded)."""
    inputs = chroma_inputs(LENGTHS)
    model, fn = enabled(path)
    model.enable_gradient_checkpointing()
    got, st = run(fn, inputs)
    assert_model_close(got, stock(inputs), what=f"{path}/checkpointing")  # the mask given back
    assert st["backends"] == {"split_sdpa": 2 * CHROMA_ATTN_LAYERS} and not st["fallbacks"], st


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("policy,match", [({"strict": True}, BIAS_REASON),
                                          ({"backend": "reference"}, "needs a packable mask")])
def test_checkpointed_blocks_keep_the_policy_on_every_path(path, policy, match):
    """strict and an explicit backend refuse a mask they cannot pack inside checkpointed blocks
    as elsewhere, the whole model compiled included."""
    model, fn = enabled(path, float_mask="bias", **policy)
    model.enable_gradient_checkpointing()
    with pytest.raises(Exception, match=match):
        step(fn, chroma_inputs(LENGTHS, mask_dtype=torch.float64))


@pytest.mark.parametrize("path", PATHS)
def test_restore_checkpoint_mask_finds_a_positional_mask(path):
    """The mask given back to checkpointed blocks is found where the caller passed it by
    position too (with the whole model compiled it was looked up by keyword only, and Chroma's
    checkpointed single blocks silently ran without it)."""
    import inspect

    inputs = chroma_inputs(LENGTHS)
    params = list(inspect.signature(type(tiny_chroma()).forward).parameters)[1:]
    given = params[:params.index("attention_mask") + 1]
    args = [inputs[p] for p in given]
    rest = {"return_dict": False, **{k: v for k, v in inputs.items() if k not in given}}
    model, fn = enabled(path)
    model.enable_gradient_checkpointing()
    model.zero_grad(set_to_none=True)
    out = fn(*args, **rest)[0]
    assert_model_close(out.detach(), stock(inputs)[0], what=f"{path}/positional mask")
