"""enable_varlen's ``trim_text``: the trailing text columns every sample masks are cut before the
model's forward (varlen_attn.trim), for every model in ``TEXT_INPUTS``.

Each listed model, float64 on the CPU, random keep-masks (a prompt length per sample, 0 for an
empty prompt, and sometimes one kept column past it): the output and every gradient equal
enable_varlen with ``trim_text=False`` (``assert_model_close``'s floor: only the shapes of a few
reductions differ), the model's attention modules see the trimmed length and never the padded one
(their hidden-state inputs recorded), and ``stats()`` counts the forward and the tokens cut.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import varlen_attn as va
from varlen_attn.trim import BUCKET, TEXT_INPUTS

diffusers = pytest.importorskip("diffusers", reason="the diffusers extra is not installed")

from _models import (HY_POOLED_DIM, QF_H, QF_W, SP_CAPTION, hunyuan_inputs, hunyuan_model,  # noqa: E402
                     pixart_model, sana_model, sana_pixart_inputs, qwen_model, step, tiny_chroma)
from _testing import assert_model_close  # noqa: E402

F64 = torch.float64
B = 3
T = 260  # padded text length: kept lengths round up to a multiple of 16 up to 256, or to nothing cut (257..260)


def _randn(g, *shape):
    return torch.randn(*shape, generator=g, dtype=F64)


def chroma(keep, g):
    n = 16
    return n, {"hidden_states": _randn(g, B, n, 4), "encoder_hidden_states": _randn(g, B, T, 32),
               "timestep": torch.rand(B, generator=g, dtype=F64), "img_ids": _randn(g, n, 3),
               "txt_ids": torch.zeros(T, 3, dtype=F64),
               "attention_mask": torch.cat([keep, torch.ones(B, n, dtype=torch.bool)], 1)}


def qwen(keep, g):
    n = QF_H * QF_W
    return n, {"hidden_states": _randn(g, B, n, 4), "encoder_hidden_states": _randn(g, B, T, 32),
               "encoder_hidden_states_mask": keep, "timestep": torch.tensor([0.1, 0.5, 0.9], dtype=F64),
               "img_shapes": [(1, QF_H, QF_W)] * B}


def hunyuan(keep, g):
    inputs = hunyuan_inputs(B, seed=int(torch.randint(0, 99, (1,), generator=g)))
    inputs["encoder_hidden_states"] = _randn(g, B, T, inputs["encoder_hidden_states"].shape[-1])
    assert inputs["pooled_projections"].shape[-1] == HY_POOLED_DIM
    return 24, {**inputs, "encoder_attention_mask": keep.long()}  # the tokenizer's int64 mask


def sana_pixart(latent):
    def make(keep, g):
        inputs = sana_pixart_inputs(latent, generator=g)
        inputs["encoder_hidden_states"] = _randn(g, B, T, SP_CAPTION)
        return -1, {**inputs, "encoder_attention_mask": keep.long()}
    return make


def ltx_model():
    torch.manual_seed(0)
    return diffusers.LTXVideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, num_layers=1, caption_channels=SP_CAPTION).to(F64)


def ltx(keep, g):
    frames, height, width = 2, 2, 3
    return -1, {"hidden_states": _randn(g, B, frames * height * width, 4), "encoder_hidden_states": _randn(g, B, T, SP_CAPTION),
                "timestep": torch.tensor([10, 500, 999]), "encoder_attention_mask": keep.long(),
                "num_frames": frames, "height": height, "width": width}


MODELS = {
    "ChromaTransformer2DModel": (tiny_chroma, chroma),
    "QwenImageTransformer2DModel": (qwen_model, qwen),
    "HunyuanVideoTransformer3DModel": (hunyuan_model, hunyuan),
    "SanaTransformer2DModel": (sana_model, sana_pixart((B, 4, 4, 4))),
    "PixArtTransformer2DModel": (pixart_model, sana_pixart((B, 4, 8, 8))),
    "LTXVideoTransformer3DModel": (ltx_model, ltx),
}


def test_every_listed_model_is_tested():
    assert sorted(MODELS) == sorted(TEXT_INPUTS)


_MODELS: dict = {}


def model_of(name):
    if name not in _MODELS:
        _MODELS[name] = MODELS[name][0]()
    return _MODELS[name]


def keep_masks():
    """[B, T] keep-masks: a prompt length per sample (0: an empty prompt), sometimes one kept
    column past it (a column the other samples pad)."""
    sample = st.tuples(st.integers(0, T), st.none() | st.integers(0, T - 1))
    return st.lists(sample, min_size=B, max_size=B).map(_keep)


def _keep(samples):
    keep = torch.zeros(B, T, dtype=torch.bool)
    for b, (length, extra) in enumerate(samples):
        keep[b, :length] = True
        if extra is not None:
            keep[b, extra] = True
    return keep


def expected_length(keep) -> int:
    if not bool(keep.any(1).all()):
        return T
    last = int(keep.any(0).nonzero().max()) + 1
    return min(T, -(-last // BUCKET) * BUCKET)


def seen_lengths(model, run):
    """The sequence lengths (dim 1 of [B, S, C] inputs) the model's attention modules were called
    with during ``run()``."""
    seen = set()

    def record(module, args, kwargs):
        for x in (*args, *kwargs.values()):
            if isinstance(x, torch.Tensor) and x.ndim == 3:
                seen.add(x.shape[1])

    handles = [m.register_forward_pre_hook(record, with_kwargs=True)
               for m in model.modules() if getattr(m, "processor", None) is not None]
    try:
        return run(), seen
    finally:
        for h in handles:
            h.remove()


def longer(name, inputs, extra, g):
    """``inputs`` with ``extra`` more text columns that every sample masks (random values), as
    ``TEXT_INPUTS`` names them: the untrimmed model on these rounds differently from the
    untrimmed model on ``inputs`` only by the lengths of its reductions over tokens."""
    mask_name, text_names = TEXT_INPUTS[name]
    t = inputs[text_names[0]].shape[-2]
    out = dict(inputs)
    mask = inputs[mask_name]
    out[mask_name] = torch.cat([mask[:, :t], mask.new_zeros(mask.shape[0], extra), mask[:, t:]], 1)
    for text_name in text_names:
        x = inputs[text_name]
        pad = torch.randn(*x.shape[:-2], extra, x.shape[-1], generator=g, dtype=x.dtype)
        out[text_name] = torch.cat([x, pad], -2)
    return out


def cut_last(name, inputs):
    """``inputs`` without their last text column (every sample must mask it)."""
    mask_name, text_names = TEXT_INPUTS[name]
    t = inputs[text_names[0]].shape[-2]
    out = dict(inputs)
    mask = inputs[mask_name]
    out[mask_name] = torch.cat([mask[:, :t - 1], mask[:, t:]], 1)
    for text_name in text_names:
        out[text_name] = inputs[text_name].narrow(-2, 0, t - 1)
    return out


def farther(a, b, ref):
    """Per tensor, whichever of the step results ``a`` and ``b`` lies farther from ``ref``."""
    def pick(x, y, r):
        return x if (x - r).nan_to_num(0).abs().max() >= (y - r).nan_to_num(0).abs().max() else y
    return pick(a[0], b[0], ref[0]), {n: pick(a[1][n], b[1][n], ref[1][n]) for n in ref[1]}


def run(model, inputs, **options):
    """``(step result, stats, seen lengths)`` of ``model`` enabled with ``options``."""
    va.enable_varlen(model, **options)
    try:
        va.reset_stats()
        result, seen = seen_lengths(model, lambda: step(model, inputs))
        return result, va.stats(), seen
    finally:
        va.disable_varlen(model)


@pytest.mark.parametrize("name", sorted(MODELS))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(keep=keep_masks(), seed=st.integers(0, 2**16))
@example(keep=_keep([(1, None), (1, None), (137, None)]), seed=37849)  # CI's: rounding at 2.4e4 ulps
@example(keep=_keep([(1, None), (153, None), (1, None)]), seed=80)  # 5e3 ulps: only a shorter run shows it
def test_trimmed_equals_untrimmed(name, keep, seed):
    model = model_of(name)
    g = torch.Generator().manual_seed(seed)
    n_image, inputs = MODELS[name][1](keep, g)
    full, full_stats, full_seen = run(model, inputs, trim_text=False)
    got, st_, seen = run(model, inputs)
    # Tolerance: the untrimmed model's own change when its padding shrinks or grows by one column
    # every sample masks, cut or added by hand (its sums over tokens round differently with their
    # length: up to 5e3 ulps of a gradient with cancellation, seen in CI; the values of masked
    # columns change nothing, test_masked_columns_values_change_nothing), else the floor.
    baseline = None  # nothing is cut (checked below): the results must be the same
    if keep.any(1).all() and expected_length(keep) < T:
        shorter = run(model, cut_last(name, inputs), trim_text=False)[0]
        grown = run(model, longer(name, inputs, 1, g), trim_text=False)[0]
        baseline = farther(shorter, grown, full)
    assert_model_close(got, full, baseline=baseline, what=f"{name}, keep {keep.sum(1).tolist()}", equal_nan=True)
    n = expected_length(keep)
    assert st_["text_trims"] == (n < T) and st_["trimmed_tokens"] == B * (T - n), st_
    assert full_stats["text_trims"] == 0 and (T in full_seen or T + n_image in full_seen), full_seen
    if n < T:
        assert T not in seen and T + n_image not in seen, seen
        assert n in seen or n + n_image in seen, (n, seen)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_masked_columns_values_change_nothing(name):
    """What trimming relies on: the values in text columns every sample masks reach no result
    (bit for bit, untrimmed), so cutting them changes results only by the rounding of shorter sums."""
    keep = _keep([(5, None), (60, 100), (2, None)])
    g = torch.Generator().manual_seed(5)
    _, inputs = MODELS[name][1](keep, g)
    text_name = TEXT_INPUTS[name][1][0]
    other = dict(inputs)
    other[text_name] = inputs[text_name].clone()
    other[text_name][..., 101:, :] = 5 * torch.randn(other[text_name][..., 101:, :].shape, generator=g, dtype=F64)
    model = model_of(name)
    a, b = run(model, inputs, trim_text=False)[0], run(model, other, trim_text=False)[0]
    assert torch.equal(a[0], b[0]) and all(torch.equal(a[1][n], b[1][n]) for n in a[1])


def test_chroma_positional_and_checkpointed():
    """Chroma called positionally, its checkpointed single blocks given the trimmed mask back
    (restore_checkpoint_mask): equal to the untrimmed model without checkpointing."""
    keep = _keep([(5, None), (60, 100), (2, None)])  # sample 1 keeps column 100: 112 columns stay
    _, inputs = chroma(keep, torch.Generator().manual_seed(3))
    stock = tiny_chroma()
    full, _, _ = run(copy.deepcopy(stock), inputs, trim_text=False)
    model = copy.deepcopy(stock)
    model.enable_gradient_checkpointing()
    va.enable_varlen(model)
    va.reset_stats()
    names = ("hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids", "attention_mask")
    model.zero_grad(set_to_none=True)
    out = model(*(inputs[k] for k in names), return_dict=False)[0]
    (out.pow(2).sum() + out.sum()).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert va.stats()["trimmed_tokens"] == B * (T - 112)
    assert_model_close((out.detach(), grads), full, what="chroma positional, checkpointed")


def test_unlisted_model_and_option_off_are_untouched():
    """A subclass with its own forward is not in the table; trim_text=False cuts nothing."""

    class MyChroma(diffusers.ChromaTransformer2DModel):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    keep = _keep([(5, None), (7, None), (2, None)])
    n_image, inputs = chroma(keep, torch.Generator().manual_seed(0))
    mine = MyChroma.from_config(tiny_chroma().config).to(F64)
    for model, options in ((mine, {}), (tiny_chroma(), {"trim_text": False})):
        _, st_, seen = run(model, inputs, **options)
        assert st_["text_trims"] == 0 and T + n_image in seen, (st_, seen)


def test_trim_text_must_be_a_bool():
    with pytest.raises(TypeError, match="trim_text must be a bool, got"):
        va.enable_varlen(tiny_chroma(), trim_text=64)


def test_compiled_blocks_recompile_once_for_50_steps_of_prompt_lengths():
    """Blocks compiled (regional compilation), 50 steps of prompts of 1..300 tokens padded to
    512, as Chroma's pipeline pads: the kept lengths vary (multiples of 16) and dynamo compiles each
    block class at most twice (once static, once with the text length dynamic)."""
    from torch._dynamo import testing as dynamo_testing

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    model = va.enable_varlen(tiny_chroma())
    cnt = dynamo_testing.CompileCounterWithBackend("aot_eager")
    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        block.compile(backend=cnt)
    t, n = 512, 16
    lengths = set()
    for _ in range(50):
        lens = torch.randint(1, 301, (B,), generator=g)
        keep = torch.arange(t)[None] < lens[:, None]
        inputs = {"hidden_states": _randn(g, B, n, 4), "encoder_hidden_states": _randn(g, B, t, 32),
                  "timestep": torch.rand(B, generator=g, dtype=F64), "img_ids": _randn(g, n, 3),
                  "txt_ids": torch.zeros(t, 3, dtype=F64),
                  "attention_mask": torch.cat([keep, torch.ones(B, n, dtype=torch.bool)], 1)}
        va.reset_stats()
        step(model, inputs)
        lengths.add(t - va.stats()["trimmed_tokens"] // B)
    assert len(lengths) >= 2, lengths  # the test saw several buckets
    assert cnt.frame_count <= 4, f"{cnt.frame_count} frames for 2 block classes over lengths {sorted(lengths)}"
    torch._dynamo.reset()
