"""CogView4 (diffusers ``CogView4Transformer2DModel``) with its training attention processor
(``CogView4TrainingAttnProcessor``, the one for masked training: the mask comes in as
``attention_kwargs={"text_attn_mask": int32 [B, T]}``) under ``enable_varlen``: outputs and the
gradient of every parameter equal the stock model's, in float64 on the CPU, and one plan per
masked attention call.

In every attention module, before its first submodule call, the processor makes the joint mask
from a non-bool factory output: ``torch.ones(B, T + N, dtype=torch.int32)`` (and another for the
image tokens), writes the text mask into it, then ``unsqueeze(2).to(dtype)``, its outer product
(``@``), ``.to(torch.bool)`` and ``unsqueeze(1)``: a ``[B, 1, N, N]`` outer-product mask. Every
call must still be varlen_attn's (none left to stock SDPA), run as key padding
(``execution.attend_outer``): one plan per call, built on the device, and one host read each (its
check, read in the call: CogView4's checks are not deferred to the forward's end), also with
checkpointing, whose recomputed calls build and read again.
(The default processor passes a float 0/1 matrix that SDPA adds as a bias; see
``docs/troubleshooting.md``.)
"""

from __future__ import annotations


import pytest
import torch

import varlen_attn as va
from _models import step, stock_and_enabled
from _testing import assert_model_close

diffusers = pytest.importorskip("diffusers", reason="the diffusers extra is not installed")
from diffusers.models.transformers.transformer_cogview4 import CogView4TrainingAttnProcessor  # noqa: E402

F64 = torch.float64
B, T, CAP = 3, 6, 16


def cogview4():
    torch.manual_seed(0)
    model = diffusers.CogView4Transformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        text_embed_dim=CAP, time_embed_dim=16, condition_dim=8, pos_embed_max_size=16, sample_size=8,
        rope_axes_dim=(8, 8)).to(F64)
    for module in model.modules():
        if hasattr(module, "set_processor"):
            module.set_processor(CogView4TrainingAttnProcessor())
    return model


def inputs(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    text = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).to(torch.int32)
    return {"hidden_states": torch.randn(B, 4, 8, 8, generator=g, dtype=F64),
            "encoder_hidden_states": torch.randn(B, T, CAP, generator=g, dtype=F64),
            "timestep": torch.tensor([10, 500, 990]),
            "original_size": torch.tensor([[64, 64]] * B, dtype=F64),
            "target_size": torch.tensor([[64, 64]] * B, dtype=F64),
            "crop_coords": torch.tensor([[0, 0]] * B, dtype=F64),
            "attention_kwargs": {"text_attn_mask": text}}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["eager", "checkpointing"])
def test_cogview4_training_processor_equals_stock_with_one_read_per_call(checkpointing):
    stock, model = stock_and_enabled(cogview4(), checkpointing)
    for i, lengths in enumerate(([6, 3, 1], [2, 6, 4], [5, 1, 3])):  # a new batch every step
        batch = inputs(lengths, seed=i)
        va.reset_stats()
        got = step(model, {**batch, "attention_kwargs": {"text_attn_mask": batch["attention_kwargs"]["text_attn_mask"].clone()}})
        st = va.stats()
        assert_model_close(got, step(stock, batch), what=f"cogview4 {lengths}")
        assert st["fallbacks"] == {}, st
        calls = 2 * (2 if checkpointing else 1)  # 2 layers (and their recomputation)
        assert st["backends"] == {"split_sdpa": calls}, (lengths, st)  # no call left to stock SDPA
        # a plan per call, built on the device, and one host read a call (its check): no plan is
        # kept, so a later step's new mask is compared with nothing
        assert st["plan_builds"] == calls and st["host_syncs"] == calls, (lengths, st)
