"""Lumina-Image 2.0 (diffusers ``Lumina2Transformer2DModel``) under ``enable_varlen``: outputs and
the gradient of every parameter equal the stock model's, in float64 on the CPU, and one plan per
masked attention call, none of which reads the host.

Where masks reach attention in Lumina2 (diffusers 0.42), from its mask input
``encoder_attention_mask`` ``[B, T]`` (1 = valid caption token):

1. The context refiner attends over the caption with that mask (``.bool().view(B, 1, 1, -1)`` in
   ``Lumina2AttnProcessor2_0``, in every refiner layer).
2. The joint blocks attend over ``[caption; image]`` packed to the left: the model makes the mask
   with ``hidden_states.new_zeros(B, L, dtype=torch.bool)`` and writes ``True`` over each row's
   length (host integers), and only when the rows' lengths differ (else ``None``). Every joint
   layer calls ``.bool()`` on it (the mask itself, already bool) and views it.

Both reach SDPA as boolean key-padding masks ``[B, 1, 1, S]``, so every masked attention call
builds its own plan on the device without a host read: one per refiner layer and per joint layer,
plus one per recomputed joint layer with checkpointing. A call without a mask (the joint layers
of a batch whose captions all have one length) runs stock SDPA and is not counted.
"""

from __future__ import annotations

import pytest
import torch

import varlen_attn as va
from _models import step, stock_and_enabled
from _testing import assert_model_close

diffusers = pytest.importorskip("diffusers", reason="the diffusers extra is not installed")

F64 = torch.float64
B, T, C, HW = 3, 6, 16, 8


def lumina2(layers=2, refiners=1):
    torch.manual_seed(0)
    return diffusers.Lumina2Transformer2DModel(
        sample_size=HW, patch_size=2, in_channels=4, hidden_size=32, num_layers=layers,
        num_refiner_layers=refiners, num_attention_heads=2, num_kv_heads=1, multiple_of=16,
        axes_dim_rope=(4, 6, 6), axes_lens=(64, 16, 16), cap_feat_dim=C).to(F64)


def inputs(lengths, dtype=torch.int64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {"hidden_states": torch.randn(B, 4, HW, HW, generator=g, dtype=F64),
            "timestep": torch.tensor([0.1, 0.5, 0.9], dtype=F64),
            "encoder_hidden_states": torch.randn(B, T, C, generator=g, dtype=F64),
            "encoder_attention_mask": (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).to(dtype)}


@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.bool], ids=["int", "bool"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["eager", "checkpointing"])
def test_lumina2_equals_stock_with_one_plan_per_call(checkpointing, mask_dtype):
    stock, model = stock_and_enabled(lumina2(layers=3, refiners=2), checkpointing)
    for i, lengths in enumerate(([6, 3, 1], [2, 6, 4], [5, 5, 1])):  # a new batch every step
        batch = inputs(lengths, mask_dtype, seed=i)
        va.reset_stats()
        got = step(model, {**batch, "encoder_attention_mask": batch["encoder_attention_mask"].clone()})
        st = va.stats()
        assert_model_close(got, step(stock, batch), what=f"lumina2 {lengths}")
        assert st["fallbacks"] == {}, st
        # 2 refiner + 3 joint layers, and the joint layers' recomputation (Lumina2 checkpoints those only)
        calls = 5 + (3 if checkpointing else 0)
        assert st["backends"] == {"split_sdpa": calls}, st
        # one plan per masked call; boolean key-padding masks: no host read
        assert st["plan_builds"] == calls and st["host_syncs"] == 0, (lengths, st)


def test_joint_blocks_without_a_mask_then_with_one():
    """The first batch has captions of one length: the model passes the joint blocks no mask, so
    they run stock SDPA, uncounted, and only the refiners' masked calls are packed. The next
    batches are padded: the joint mask (made with ``new_zeros``) reaches every joint attention
    call, and every masked call is packed with its own plan (no host read: key padding)."""
    stock, model = stock_and_enabled(lumina2(layers=3, refiners=2))
    for i, lengths in enumerate(([6, 6, 6], [6, 3, 1], [2, 6, 4])):
        batch = inputs(lengths, seed=i)
        va.reset_stats()
        got = step(model, {**batch, "encoder_attention_mask": batch["encoder_attention_mask"].clone()})
        st = va.stats()
        assert_model_close(got, step(stock, batch), what=f"lumina2 {lengths}")
        padded = len(set(lengths)) > 1
        assert st["backends"] == {"split_sdpa": 5 if padded else 2}, (lengths, st)  # refiners (+ joint blocks)
        assert st["plan_builds"] == (5 if padded else 2) and st["host_syncs"] == 0, (lengths, st)
        assert st["fallbacks"] == {}, st
