"""HunyuanVideo 1.5 (diffusers ``HunyuanVideo15Transformer3DModel``) under ``enable_varlen``:
outputs and the gradient of every parameter equal the stock model's, in float64 on the CPU, and
one host read per masked attention call.

The model reorders each sample's tokens (valid image, valid text of both encoders, then the
invalid ones) in Python loops over the batch and stacks the reordered text masks; every joint
attention processor then pads that mask to the joint length (``F.pad(..., value=True)``) and
squares it. The joint attention calls run that ``[B, 1, N, N]`` outer product as key padding
(``execution.attend_outer``), each building its plan on the device and reading its check once
(HunyuanVideo's checks are not deferred to the forward's end). The token refiner's legacy
processor repeats its ``[B, 1, T, T]`` mask per head: a mask with rows that is no key padding,
planned once per distinct mask, one host read per call. With checkpointing the joint layers run
again in backward (the refiner is not checkpointed), each recomputed call building its plan and
reading its check again. Where the
token refiner keeps HunyuanVideo's ``[:, :, :, 0] = True`` (not packable for most masks: masked
SDPA, the reason recorded; ``test_diffusers_hunyuan.py``), a fallback is allowed there.
"""

from __future__ import annotations


import pytest
import torch

import varlen_attn as va
from _models import step, stock_and_enabled
from _testing import assert_model_close

diffusers = pytest.importorskip("diffusers", reason="the diffusers extra is not installed")

F64 = torch.float64
B, T, T2, CAP, CAP2, IMGD, NI = 3, 6, 4, 16, 8, 8, 3


def hunyuan15():
    torch.manual_seed(0)
    return diffusers.HunyuanVideo15Transformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=3,
        num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=CAP,
        text_embed_2_dim=CAP2, image_embed_dim=IMGD, rope_axes_dim=(4, 6, 6)).to(F64)


def inputs(lengths, lengths_2, seed):
    g = torch.Generator().manual_seed(seed)

    def keep(lens, t):
        return (torch.arange(t)[None] < torch.tensor(lens)[:, None]).long()

    return {"hidden_states": torch.randn(B, 4, 2, 4, 4, generator=g, dtype=F64),
            "timestep": torch.tensor([10.0, 500.0, 990.0], dtype=F64),
            "encoder_hidden_states": torch.randn(B, T, CAP, generator=g, dtype=F64),
            "encoder_attention_mask": keep(lengths, T),
            "encoder_hidden_states_2": torch.randn(B, T2, CAP2, generator=g, dtype=F64),
            "encoder_attention_mask_2": keep(lengths_2, T2),
            "image_embeds": torch.zeros(B, NI, IMGD, dtype=F64)}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["eager", "checkpointing"])
def test_hunyuan15_equals_stock_with_one_read_per_call(checkpointing):
    stock, model = stock_and_enabled(hunyuan15(), checkpointing)
    for i, (lengths, lengths_2) in enumerate((([6, 3, 1], [2, 0, 1]), ([2, 6, 4], [4, 1, 0]))):
        batch = inputs(lengths, lengths_2, seed=i)
        va.reset_stats()
        got = step(model, batch)
        st = va.stats()
        assert_model_close(got, step(stock, batch), what=f"hunyuan 1.5 {lengths} {lengths_2}")
        joint = 3 * (2 if checkpointing else 1)  # 3 joint layers (and their recomputation)
        # the joint calls: a plan per call, built on the device, and one host read each (its check);
        # the refiner's per-head mask: one plan per distinct mask and one host read per call, and in
        # the later step one more (its new mask compared with the kept copy)
        assert st["plan_builds"] == 1 + joint and st["host_syncs"] == 1 + joint + (i > 0), (lengths, st)
        assert sum(st["backends"].values()) == 1 + joint, st  # + the refiner's one layer
        assert st["backends"].get("split_sdpa", 0) >= joint and len(st["fallbacks"]) <= 1, st  # joint layers packed
