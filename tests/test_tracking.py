"""How an enabled forward follows its masks: the mode, or tracked mask tensors.

The first forward of an enabled model (per set of mask inputs) runs under the mode, which sees
every torch function, and learns whether every mask that reached attention was derived from the
mask inputs alone. Where it was, later forwards wrap the mask inputs as tracked masks instead:
only functions taking one of them enter Python. These tests check that each diffusers model
lands where its mask code says, that the tracked forwards equal stock in output and gradients,
and what switches a model back to the mode.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import varlen_attn as va
from _models import (PIXART_LATENT, QF_B, QF_H, QF_N, QF_W, SANA_LATENT, SP_T, chroma_inputs, flux_ids,
                     flux_model, hunyuan_inputs, hunyuan_model, hunyuan_text_mask, pixart_model, prefix_keep,
                     qwen_flux_inputs, qwen_model, sana_model, sana_pixart_inputs, step, tiny_chroma)
from _testing import assert_model_close

diffusers = pytest.importorskip("diffusers", reason="the diffusers extra is not installed")


def _qwen_flux(name):
    base = qwen_flux_inputs()
    keep = prefix_keep([5, 2, 0])
    if name == "qwen":
        base = {k: base[k] for k in ("hidden_states", "encoder_hidden_states", "timestep")}
        return lambda: {**base, "encoder_hidden_states_mask": keep.clone(), "img_shapes": [[(1, QF_H, QF_W)]] * QF_B}
    txt, img = flux_ids()
    joint = torch.cat([keep, torch.ones(QF_B, QF_N, dtype=torch.bool)], 1)
    return lambda: {**base, "img_ids": img, "txt_ids": txt, "joint_attention_kwargs": {"attention_mask": joint.clone()}}


def _sana_pixart(latent):
    base = sana_pixart_inputs(latent)
    return lambda: {**base, "encoder_attention_mask": prefix_keep([6, 3, 1], SP_T)}


# name -> (model, inputs with a NEW mask tensor per call, how its second forward tracks, plans per
# forward). Qwen-Image joins its text mask with a torch.ones made in every layer, HunyuanVideo's
# refiner writes its mask in place: masks the tracked tensors cannot see made, so the mode stays.
MODELS = {
    "chroma": (tiny_chroma, lambda: chroma_inputs(), "tracked", 1),
    "flux": (flux_model, _qwen_flux("flux"), "tracked", 1),
    "sana": (sana_model, _sana_pixart(SANA_LATENT), "tracked", 1),
    "pixart": (pixart_model, _sana_pixart(PIXART_LATENT), "tracked", 1),
    "qwen": (qwen_model, _qwen_flux("qwen"), "mode", 1),
    "hunyuan": (hunyuan_model, lambda: {**hunyuan_inputs(3), "encoder_attention_mask": hunyuan_text_mask([6, 3, 1])},
                "mode", 2),
}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_later_forwards_track_as_learned_and_equal_stock(name, checkpointing):
    build, inputs, expected, plans = MODELS[name]
    model = build()
    if checkpointing:
        model.enable_gradient_checkpointing()
    ref = step(model, inputs())
    va.enable_varlen(model, backend="auto", restore_checkpoint_mask=False)  # stock drops it too
    try:
        for i in range(3):
            va.reset_stats()
            got = step(model, inputs())  # a new mask object every step
            st = va.stats()
            assert st["forwards"] == {"mode" if i == 0 else expected: 1}, (i, st)
            assert st["plan_builds"] == plans and st["host_syncs"] == plans, (i, st)
            assert st["backends"].get("split_sdpa", 0) > 0, (i, st)
            assert_model_close(got, ref, what=f"{name} step {i}")
    finally:
        va.disable_varlen(model)


@pytest.mark.parametrize("name", ["chroma", "qwen"])
def test_compiled_blocks_track_and_run_without_the_hook(name, monkeypatch):
    """Blocks compiled after tracked forwards: the compiled graphs route their own attention
    (their derivation, Qwen-Image's torch.ones included, was followed while tracing), so every
    later forward tracks, runs no call through the hook (Chroma: none; Qwen-Image: the few eager
    ops outside its blocks on the first forward only), builds one plan and equals stock."""
    from varlen_attn import hook

    build, inputs, _, _ = MODELS[name]
    model = build()
    ref = step(model, inputs())
    calls = []
    original = hook.VarlenHook.__torch_function__

    def counted(self, func, types, args=(), kwargs=None):
        if not torch.compiler.is_compiling():
            calls.append(func)
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(hook.VarlenHook, "__torch_function__", counted)
    va.enable_varlen(model, restore_checkpoint_mask=False)
    try:
        step(model, inputs())
        blocks = [m for m in model.modules() if type(m).__name__.endswith("TransformerBlock")]
        assert blocks
        for block in blocks:
            block.compile(backend="aot_eager", fullgraph=True)
        for i in range(3):
            va.reset_stats()
            calls.clear()
            got = step(model, inputs())
            st = va.stats()
            assert st["forwards"] == {"mode" if i == 0 and name == "qwen" else "tracked": 1}, (i, st)
            assert st["plan_builds"] == 1 and st["fallbacks"] == {}, st
            assert st["backends"].get("split_sdpa", 0) >= len(blocks), st
            if i > 0:
                assert calls == [], (i, len(calls), calls[:5])
            # Compiled graphs give a parameter the forward never used a zero gradient, not None.
            extra = {n: g for n, g in got[1].items() if n not in ref[1]}
            assert all(not g.any() for g in extra.values()), sorted(extra)
            got = (got[0], {n: g for n, g in got[1].items() if n in ref[1]})
            assert_model_close(got, ref, what=f"compiled {name} step {i}")
    finally:
        va.disable_varlen(model)
        torch._dynamo.reset()
    # disable_varlen takes the wrappers off again: the blocks' own compiled call and forward.
    assert all("forward" not in b.__dict__ and type(b._compiled_call_impl).__name__ != "_Boundary"
               for b in blocks)


def test_blocks_replaced_by_torch_compile_are_routed_and_restored():
    """``torch.compile(block)`` put in place of each block (an OptimizedModule child, not
    ``block.compile()``): routed inside the graphs, tracked forwards, equal to stock; disabling
    leaves the OptimizedModules as they were."""
    model = tiny_chroma()
    ref = step(model, chroma_inputs())
    va.enable_varlen(model)
    try:
        for blocks in (model.transformer_blocks, model.single_transformer_blocks):
            for i in range(len(blocks)):
                blocks[i] = torch.compile(blocks[i], backend="aot_eager", fullgraph=True)
        for i in range(3):
            va.reset_stats()
            got = step(model, chroma_inputs())
            st = va.stats()
            assert st["forwards"] == {"mode" if i == 0 else "tracked": 1}, (i, st)
            assert st["plan_builds"] == 1 and st["backends"].get("split_sdpa", 0) >= 4, (i, st)
            got = (got[0], {n.replace("._orig_mod", ""): g for n, g in got[1].items()})
            assert_model_close(got, ref, what=f"torch.compile(block) step {i}")
    finally:
        va.disable_varlen(model)
        torch._dynamo.reset()
    opt = model.transformer_blocks[0]
    assert type(opt.__dict__["forward"]).__name__ != "_Boundary" and "forward" not in opt._orig_mod.__dict__


def test_compiled_blocks_run_eagerly_are_still_routed():
    """With dynamo told to run compiled code eagerly (set_stance("force_eager")), the blocks'
    attention still goes to varlen_attn (the forward's hook re-entered around them), not to
    stock SDPA unrecorded."""
    model = tiny_chroma()
    ref = step(model, chroma_inputs())
    va.enable_varlen(model)
    try:
        for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
            block.compile(backend="aot_eager", fullgraph=True)
        with torch.compiler.set_stance("force_eager"):
            for i in range(2):
                va.reset_stats()
                got = step(model, chroma_inputs())
                st = va.stats()
                assert st["plan_builds"] == 1 and st["backends"].get("split_sdpa", 0) >= 4, (i, st)
                assert_model_close(got, ref, what=f"force_eager step {i}")
    finally:
        va.disable_varlen(model)
        torch._dynamo.reset()


class _LeaksItsMask(torch.nn.Module):
    """Attention over a key-padding mask, returning the mask it derived (a tracked mask)."""

    def forward(self, q, attention_mask):
        m = attention_mask[:, None, None, :]
        return F.scaled_dot_product_attention(q, q, q, attn_mask=m), m


def test_a_tracked_mask_outside_its_forward_is_a_plain_tensor():
    model = _LeaksItsMask()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 5, 8, generator=g, dtype=torch.float64)
    keep = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    va.enable_varlen(model, backend="reference")
    try:
        model(q, keep.clone())
        va.reset_stats()
        out, leaked = model(q, keep.clone())
        assert va.stats()["forwards"] == {"tracked": 1} and va.stats()["backends"] == {"reference": 1}
    finally:
        va.disable_varlen(model)
    stock = F.scaled_dot_product_attention(q, q, q, attn_mask=keep[:, None, None, :])
    torch.testing.assert_close(out, stock)
    va.reset_stats()
    # Used after its forward, the derived mask computes as a plain tensor and attention with it
    # is stock SDPA (bit-exact), not varlen_attn.
    again = F.scaled_dot_product_attention(q, q, q, attn_mask=leaked & leaked)
    assert va.stats()["backends"] == {} and va.stats()["plan_builds"] == 0
    torch.testing.assert_close(again, stock, rtol=0, atol=0)
