"""Bad input: one exception family, the argument named, expected and received stated."""

import logging
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import varlen_attn as va
import varlen_attn._errors

q = torch.randn(2, 4, 6, 8)
k = torch.randn(2, 4, 6, 8)
v = torch.randn(2, 4, 6, 8)
sdpa = va.scaled_dot_product_attention


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: sdpa(q.numpy(), k, v), TypeError, "query must be a torch.Tensor"),
        (lambda: sdpa(q[0], k, v), ValueError, r"query must be 4-D \[B, H, S, D\], got shape \(4, 6, 8\)"),
        (lambda: sdpa(q.int(), k.int(), v.int()), TypeError, "query must be floating point"),
        (lambda: sdpa(q, k.double(), v), TypeError, "must share a dtype"),
        (lambda: sdpa(q, k[:1], v[:1]), ValueError, "share the batch size, got 2, 1"),
        (lambda: sdpa(q, k, v[:, :, :5]), ValueError, "value must match key"),
        (lambda: sdpa(q, k[..., :4], v), ValueError, "head dim must equal"),
        (lambda: sdpa(q, k[:, :3], v[:, :3], enable_gqa=True), ValueError, "multiple of key heads"),
        (lambda: sdpa(q, k[:, :2], v[:, :2]), ValueError, "enable_gqa=True"),
        (lambda: sdpa(q, k, v, torch.ones(2, 1, 1, 5, dtype=torch.bool)), ValueError, "does not broadcast"),
        (lambda: sdpa(q, k, v, torch.ones(3, 1, 1, 6, dtype=torch.bool)), ValueError, "dim 0 is 3, expected 2 or 1"),
        (lambda: sdpa(q, k, v, torch.ones(2, 6, dtype=torch.int64)), TypeError, "attn_mask must be bool"),
        (lambda: sdpa(q, k, v, torch.tensor([0.0, float("nan"), 0, 0, 0, 0])), ValueError, "must not contain NaN"),
        (lambda: sdpa(q, k, v, torch.tensor([0.0, float("inf"), 0, 0, 0, 0])), ValueError, r"must not contain \+inf"),
        (lambda: sdpa(q, k, v, dropout_p=1.5), ValueError, r"dropout_p must be in \[0, 1\], got 1\.5"),
        (lambda: sdpa(q, k, v, scale="x"), TypeError, "scale must be a float"),
        (lambda: sdpa(q, k, v, backend="fa9"), ValueError, "backend must be 'auto'"),
        (lambda: sdpa(q, k, v, attn_mask=[True] * 6), TypeError, "attn_mask must be a torch.Tensor"),
        (lambda: va.attention(q, k, v, plan="plan"), TypeError, "plan must be a VarlenPlan"),
        (lambda: va.attention(q, k, v, plan=va.plan_from_seqlens([1, 2], seqlen_q=3)), ValueError, "plan was built for B=2, Sq=3"),
        (lambda: va.build_plan(None), ValueError, "needs batch_size and seqlen_q"),
        (lambda: va.build_plan(torch.tensor(True)), ValueError, "attn_mask must have a key dim"),
        (lambda: va.build_plan(torch.ones(2, 0, dtype=torch.bool)), ValueError, r"attn_mask must have a key dim.*shape \(2, 0\)"),
        (lambda: va.build_plan(torch.ones(2, 4, dtype=torch.bool, device="meta")), ValueError, "attn_mask must hold data"),
        (lambda: va.build_plan(torch.ones(2, 4, dtype=torch.bool), batch_size=2.0), TypeError, "batch_size must be an int, got float 2.0"),
        (lambda: va.build_plan(None, batch_size=-1, seqlen_q=3), ValueError, "batch_size must be >= 0, got -1"),
        (lambda: va.build_plan(torch.ones(2, 4, dtype=torch.bool), num_heads=0), ValueError, "num_heads must be >= 1, got 0"),
        (lambda: va.build_plan(torch.ones(2, 4, dtype=torch.bool), seqlen_q=True), TypeError, "seqlen_q must be an int, got bool"),
        (lambda: va.build_plan(torch.ones(2, 4, dtype=torch.bool), strict=1), TypeError, "strict must be a bool, got int 1"),
        (lambda: va.build_plan(torch.ones(2, 4, dtype=torch.bool), cache="no"), TypeError, "cache must be a bool, got str"),
        (lambda: va.build_plan(torch.ones(2, 4), float01_as_bool=None), TypeError, "float01_as_bool must be a bool"),
        # a keep-mask shaped for hidden states ([B, S, 1]) read as one key per query (Sk=1)
        (lambda: va.build_plan(torch.ones(2, 4, 1, dtype=torch.bool)), ValueError,
         r"attn_mask's last dim is the key length, got shape \(2, 4, 1\) \(Sk=1 under Sq=4\).*squeeze\(-1\)"),
        (lambda: va.build_plan(torch.ones(2, 1, 4, 1)), ValueError, r"got shape \(2, 1, 4, 1\) \(Sk=1 under Sq=4\)"),
        (lambda: va.build_plan(torch.ones(4, 1, dtype=torch.bool), convention="torch"), ValueError,
         r"got shape \(4, 1\) \(Sk=1 under Sq=4\).*pass seqlen_k"),
        (lambda: va.plan_from_seqlens([1, 2], [1]), ValueError, "seqlens_q and seqlens_k must have the same length"),
        (lambda: va.plan_from_seqlens([4], seqlen_q=3), ValueError, "exceeds the padded length"),
        (lambda: va.pack(torch.randn(2, 5, 3), va.plan_from_seqlens([1, 2], seqlen_q=4)), ValueError, r"x must be \[B, S, ...\] with B=2, S=4"),
        (lambda: va.pack(torch.randn(2, 4), va.plan_from_seqlens([1, 2], seqlen_q=4), "v"), ValueError, "which must be 'q'"),
    ],
)
def test_bad_input_raises_named_error(call, exc, match):
    with pytest.raises(va.VarlenAttnError, match=match) as info:
        call()
    assert isinstance(info.value, exc)


def test_build_plan_takes_a_trailing_one_with_seqlen_k_given():
    """The [B, S, 1] refusal leaves alone what is meant: a seqlen_k given broadcasts the value over
    every key (query padding, as SDPA broadcasts it), seqlen_k=1 is a single key, and [B, 1] is a
    key-padding mask of one key per element."""
    keep = torch.arange(4)[None] < torch.tensor([4, 2])[:, None]
    rows = va.build_plan(keep[:, :, None], seqlen_k=4)
    assert rows.seqlens_q == (4, 2) and rows.seqlens_k == (4, 4)
    one = va.build_plan(keep[:, :, None], seqlen_k=1)
    assert one.seqlen_k == 1 and one.seqlens_q == (4, 2) and one.seqlens_k == (1, 1)
    assert va.build_plan(torch.ones(3, 1, dtype=torch.bool)).seqlens_k == (1, 1, 1)


def test_build_plan_warns_once_for_a_float01_mask(monkeypatch, caplog):
    """A float mask of 0s and 1s keeps SDPA's additive reading in build_plan (0 masks nothing out),
    almost surely not what its caller meant: one warning per process naming float01_as_bool.
    Additive masks (0/-inf), an all-ones float mask (both readings keep every key) and
    float01_as_bool=True get none."""
    monkeypatch.setattr(varlen_attn._errors, "_warned", set())
    keep = torch.arange(6)[None] < torch.tensor([6, 3])[:, None]
    with caplog.at_level(logging.WARNING, logger="varlen_attn"):
        additive = va.build_plan(torch.zeros(2, 6).masked_fill(~keep, float("-inf")), cache=False)
        ones = va.build_plan(torch.ones(2, 6), cache=False)
        as_bool = va.build_plan(keep.double(), float01_as_bool=True, cache=False)
        assert [r.getMessage() for r in caplog.records] == []
        plans = [va.build_plan(keep.float(), cache=False) for _ in range(3)]
        # rows of all 1 and all 0: uniform rows, packable as a bias (every key), not as keep-mask
        dropped = va.build_plan(torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]), cache=False)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "float01_as_bool=True" in warned[0] and "shape (2, 6)" in warned[0], warned
    assert additive.seqlens_k == (6, 3) and as_bool.read_as_bool and as_bool.seqlens_k == (6, 3)
    assert ones.seqlens_k == (6, 6) and not ones.read_as_bool
    assert all(not p.packable and "bias" in p.reason and not p.read_as_bool for p in plans)
    assert dropped.packable and dropped.seqlens_k == (3, 3) and not dropped.read_as_bool


def test_enable_varlen_on_a_pipeline_names_the_part_to_pass():
    """A diffusers pipeline is not a module: enable_varlen says in one short line which part to
    pass (the transformer, or the unet of a UNet pipeline), without the pipeline's config (its
    repr), also when the pipeline's transformer is not loaded."""
    import _models
    from diffusers import (ChromaPipeline, DDIMScheduler, FlowMatchEulerDiscreteScheduler, StableDiffusionPipeline,
                           UNet2DConditionModel)

    parts = dict(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None, tokenizer=None)
    unet = UNet2DConditionModel(block_out_channels=(8, 16), layers_per_block=1, sample_size=8, norm_num_groups=4,
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), cross_attention_dim=8,
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), attention_head_dim=2)
    for pipe, part in ((ChromaPipeline(transformer=_models.tiny_chroma(), **parts), "transformer"),
                       (ChromaPipeline(transformer=None, **parts), "transformer"),
                       (StableDiffusionPipeline(vae=None, text_encoder=None, tokenizer=None, unet=unet,
                                                scheduler=DDIMScheduler(), safety_checker=None, feature_extractor=None,
                                                requires_safety_checker=False), "unet")):
        with pytest.raises(va.InputTypeError) as info:
            va.enable_varlen(pipe)
        message = str(info.value)
        assert message == (f"model must be the {part} (a torch.nn.Module), not a pipeline: pass pipe.{part}; "
                           f"got {type(pipe).__name__}"), message
        assert getattr(pipe, part) is None or not hasattr(getattr(pipe, part), "_varlen_state")


def test_a_non_module_gets_one_line_naming_its_type_and_pipe_transformer():
    """VarlenAttnProcessor.wrap on a pipeline, and enable_varlen or wrap on anything else that is
    not a module (a dict holding the transformer), say in one line what they got (its type, not
    its repr: a pipeline's config, a module listing) and what to pass."""
    import _models
    from diffusers import ChromaPipeline, FlowMatchEulerDiscreteScheduler

    transformer = _models.tiny_chroma()
    pipe = ChromaPipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), vae=None,
                          text_encoder=None, tokenizer=None)
    for call, got in ((lambda: va.VarlenAttnProcessor.wrap(pipe), "ChromaPipeline"),
                      (lambda: va.VarlenAttnProcessor.wrap({"transformer": transformer}), "dict"),
                      (lambda: va.enable_varlen({"transformer": transformer}), "dict"),
                      (lambda: va.enable_varlen("model"), "str")):
        with pytest.raises(va.InputTypeError) as info:
            call()
        message = str(info.value)
        assert message == ("model must be a torch.nn.Module (of a pipeline: pass pipe.transformer), "
                           f"got {got}"), message
    assert not hasattr(transformer, "_varlen_state")
    assert not any(isinstance(p, va.VarlenAttnProcessor) for p in transformer.attn_processors.values())


def test_explicit_backend_never_falls_back_silently():
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    with pytest.raises(va.BackendUnavailableError, match="needs a packable mask"):
        sdpa(q, k, v, causal, backend="split_sdpa")
    with pytest.raises(va.BackendUnavailableError, match="top-left"):
        sdpa(q[:, :, :3], k, v, is_causal=True, backend="reference")


@pytest.mark.parametrize("source", ["backend", "VARLEN_ATTN_BACKEND"])
def test_a_backend_that_is_not_registered_is_refused_naming_the_accepted_values(source, monkeypatch):
    """A backend name the library does not have (``flex``, removed), as the argument or in the
    environment: ``InputValueError`` naming where the name came from, every accepted value and
    the name received."""
    accepted = ["auto", "sdpa", *sorted(va.kernels.BACKENDS)]
    assert "flex" not in accepted
    keep = torch.ones(2, 6, dtype=torch.bool)
    named = {"backend": "flex"} if source == "backend" else {}
    if source == "backend":
        monkeypatch.delenv("VARLEN_ATTN_BACKEND", raising=False)
    else:
        monkeypatch.setenv("VARLEN_ATTN_BACKEND", "flex")
    calls = [lambda: sdpa(q, k, v, keep[:, None, None], **named),
             lambda: va.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), keep, **named)]
    for call in calls:
        with pytest.raises(va.InputValueError) as info:
            call()
        message = str(info.value)
        assert message.startswith(f"{source} must be ") and message.endswith(", got 'flex'"), message
        assert all(repr(name) in message for name in accepted), message


def test_not_packable_plan_without_mask_is_an_error():
    plan = va.build_plan(torch.ones(6, 6, dtype=torch.bool).tril()[None, None], convention="torch")
    assert not plan.packable
    with pytest.raises(va.InputValueError, match="pass attn_mask"):
        va.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), plan=va.build_plan(
            torch.ones(6, 6, dtype=torch.bool).tril()[None].expand(2, 6, 6)))


_OPTION_VALUES = {
    # what torch's argument parser takes for SDPA's float parameters, what it refuses, and some
    # values in between (numpy scalars, 0-d tensors, bools)
    "dropout_p": [0.0, 0, np.float32(0.0), np.float64(0.0), np.False_, np.array(0.0), Fraction(0), torch.tensor(0.0), torch.tensor(0),
                  None, "0", 1.5, -0.1, 1.0, np.float32(1.0), torch.zeros(1), torch.tensor(0.0, requires_grad=True)],
    "scale": [0.5, 1, np.float32(0.5), np.int64(2), np.True_, np.array(0.5), Fraction(1, 2), torch.tensor(0.5), None, "x", torch.ones(1),
              torch.tensor(0.5, requires_grad=True), torch.tensor(1j)],
    "is_causal": [False, True, np.bool_(False), None, 0, 1, 1.0, "yes", torch.tensor(True)],
    "enable_gqa": [False, True, np.bool_(True), None, 0, 1, "no"],
}


@pytest.mark.parametrize("name, value", [(n, v) for n, vs in _OPTION_VALUES.items() for v in vs],
                         ids=lambda x: type(x).__name__ if not isinstance(x, str) or len(x) > 12 else x)
@pytest.mark.parametrize("masked", [False, True], ids=["no mask", "mask"])
def test_option_types_run_or_refuse_as_stock(name, value, masked):
    """SDPA's float and bool options: where stock's argument parser takes a value, the drop-in
    and ``va.attention`` run with stock's result; where it refuses one, they refuse it (a
    ``TypeError`` or ``ValueError`` naming the argument), with a mask too (the checks used to
    run only on the path stock's own SDPA call reached)."""
    torch.manual_seed(0)
    qd, kd, vd = (t.double() for t in (q, k, v))
    keep = torch.rand(2, 1, 1, 6) > 0.3
    keep[..., 0] = True
    mask = keep if masked else None
    kwargs = {name: value}
    try:
        ref = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, **kwargs)
    except (TypeError, ValueError, RuntimeError):
        ref = None
    for label, call in (
            ("drop-in", lambda: sdpa(qd, kd, vd, attn_mask=mask, **kwargs)),
            ("attention", lambda: va.attention(qd.transpose(1, 2), kd.transpose(1, 2), vd.transpose(1, 2),
                                               None if mask is None else mask[:, 0, 0], **kwargs).transpose(1, 2))):
        if ref is None:
            with pytest.raises((TypeError, ValueError), match=name):
                call()
        else:
            torch.testing.assert_close(call(), ref, msg=lambda m: f"{label}, {name}={value!r}: {m}")
