"""Review of the deferred outer-product checks (Chroma, model.OUTER_MASKS): paths around a
forward's one read that must still equal stock. CPU, float64."""

from __future__ import annotations

import copy

import pytest
import torch

import varlen_attn as va
from varlen_attn import costs, hook

from _models import chroma_inputs, loss, step, tiny_chroma
from _testing import assert_model_close


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_two_forwards_one_backward_and_accumulation_use_each_forwards_own_factors(checkpointing):
    a, b = chroma_inputs(), chroma_inputs((3, 7, 1), seed=2)
    stock = tiny_chroma()
    enabled = va.enable_varlen(copy.deepcopy(stock))
    if checkpointing:
        enabled.enable_gradient_checkpointing()

    def together(m):
        m.zero_grad(set_to_none=True)
        (loss(m(**a)[0]) + loss(m(**b)[0])).backward()
        return grads(m)

    def accumulated(m):
        m.zero_grad(set_to_none=True)
        for inp in (a, b):
            loss(m(**inp)[0]).backward()
        return grads(m)

    va.reset_stats()
    assert_model_close(together(enabled), together(stock), what="two forwards, one backward")
    assert not va.stats()["fallbacks"] and va.stats()["host_syncs"] == 2, va.stats()
    assert_model_close(accumulated(enabled), accumulated(stock), what="accumulated")


@pytest.mark.parametrize("checkpointing", [False, True])
def test_no_grad_inference_mode_and_a_forward_that_raised_leave_nothing_stale(checkpointing):
    inp = chroma_inputs()
    stock = tiny_chroma()
    enabled = va.enable_varlen(copy.deepcopy(stock))
    if checkpointing:
        enabled.enable_gradient_checkpointing()
    with torch.no_grad():
        ref = stock(**inp)[0]
        assert_model_close(enabled(**inp)[0], ref, what="no_grad")
    with torch.inference_mode():
        assert_model_close(enabled(**inp)[0], ref, what="inference_mode")

    def boom(*_):
        raise RuntimeError("boom")

    handle = enabled.transformer_blocks[1].register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        enabled(**inp)
    handle.remove()
    assert hook.current() is None
    va.reset_stats()
    assert_model_close(step(enabled, inp), step(stock, inp), what="after a forward that raised")
    assert va.stats()["host_syncs"] == 1 and not va.stats()["fallbacks"], va.stats()


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float64])
def test_edge_masks(checkpointing, mask_dtype):
    """Every text token kept, none kept, batch of one; a float 0/1 mask equals the bool one."""
    stock = tiny_chroma()
    enabled = va.enable_varlen(copy.deepcopy(stock))
    if checkpointing:
        enabled.enable_gradient_checkpointing()
    for lengths in [(7, 7, 7), (0, 0, 0), (7, 0, 3)]:
        inp = chroma_inputs(lengths, mask_dtype=mask_dtype)
        ref = step(stock, chroma_inputs(lengths))
        va.reset_stats()
        assert_model_close(step(enabled, inp), ref, what=str(lengths))
        assert va.stats()["host_syncs"] == 1, va.stats()
    one = {k: (v[:1] if isinstance(v, torch.Tensor) and k not in ("img_ids", "txt_ids") else v)
           for k, v in chroma_inputs(mask_dtype=mask_dtype).items()}
    ref_in = {**one, "attention_mask": one["attention_mask"] != 0}
    assert_model_close(step(enabled, one), step(stock, ref_in), what="batch of one")


@pytest.mark.parametrize("checkpointing", [False, True])
def test_peft_lora_chroma(checkpointing):
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"], init_lora_weights="gaussian")
    stock = peft.get_peft_model(tiny_chroma(), cfg)
    enabled = copy.deepcopy(stock)
    va.enable_varlen(enabled.base_model.model)
    if checkpointing:
        enabled.base_model.model.enable_gradient_checkpointing()
    for inp in (chroma_inputs(), chroma_inputs(mask_dtype=torch.float64)):
        va.reset_stats()
        assert_model_close(step(enabled, inp), step(stock, chroma_inputs()), what="LoRA")
        assert va.stats()["host_syncs"] == 1 and not va.stats()["fallbacks"], va.stats()


def test_float_bias_left_to_stock_as_key_padding_fails_its_check_and_equals_stock():
    """A float mask that is no 0/1 mask, on the route that hands stock the keys' mask: its
    check fails and the forward runs again, read as stock reads it."""
    lay = {"tokens": [16, 256],
           "routes": {"sdpa:cpu": {"cost": [1.0, 10.0]}, "split_sdpa": {"cost": [2.0, 20.0]}}}
    costs.use([{"gpu": "cpu", "capability": None, "dtype": "float64", "layouts": {"key_padding": lay}}])
    try:
        stock = tiny_chroma()
        enabled = va.enable_varlen(copy.deepcopy(stock))
        enabled.enable_gradient_checkpointing()
        inp = chroma_inputs(mask_dtype=torch.float64)
        assert_model_close(step(enabled, inp), step(stock, chroma_inputs()), what="float 0/1")
        inp["attention_mask"] = inp["attention_mask"] * 0.5
        va.reset_stats()
        assert_model_close(step(enabled, inp), step(stock, inp), what="float bias")
        assert va.stats()["fallbacks"], va.stats()
    finally:
        costs.use(None)
