"""``VarlenAttnProcessor`` on the real diffusers models: each module keeps its own processor.

``VarlenAttnProcessor.wrap(model)`` reads every attention module's current processor (what
``model.attn_processors`` lists) and installs one wrapper per module around that very object;
``unwrap`` puts the objects back. The wrapped model computes what the stock model computes, with
its masked attention packed: Sana's linear attention stays linear attention, Qwen-Image keeps its
joint processor, HunyuanVideo's token refiner its ``AttnProcessor2_0``.

``VarlenAttnProcessor()`` without a processor is refused: diffusers' ``set_attn_processor``
assigns the new processor without handing it the old one, so the bare form used to guess the
module's default class (Sana: a different answer, max diff ~0.1; Qwen-Image: an exception).

Tolerance: ``_testing.assert_model_close`` (float64 CPU, floor only: no empty prompt, so stock
carries no -10000 rounding noise; see ``test_diffusers_sana_pixart.py``).
"""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch

import varlen_attn as va
from _models import (FLUX_ATTN_LAYERS, PIXART_LATENT, QF_B, QF_H, QF_N, QF_W, SANA_LATENT, chroma_inputs,
                     flux_ids, flux_model, hunyuan_inputs, hunyuan_model, hunyuan_text_mask, pixart_model,
                     prefix_keep, qwen_flux_inputs, qwen_model, sana_model, sana_pixart_inputs, step, tiny_chroma)
from _testing import assert_model_close, assert_model_equal

diffusers = pytest.importorskip("diffusers", reason="the diffusers extra is not installed")
from diffusers.models.attention_processor import AttnProcessor2_0, SanaLinearAttnProcessor2_0

VP = va.VarlenAttnProcessor
TEXT_KEEP = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 1, 1, 0, 0]])  # Sana/PixArt [B, T]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("VARLEN_ATTN_BACKEND", raising=False)  # backend=None must mean auto


def _qwen_inputs():
    inputs = qwen_flux_inputs()
    inputs.pop("pooled_projections")
    return {**inputs, "encoder_hidden_states_mask": prefix_keep((7, 3, 1)), "img_shapes": [(1, QF_H, QF_W)] * QF_B}


def _flux_inputs():
    txt_ids, img_ids = flux_ids()
    joint = torch.cat([prefix_keep((7, 3, 1)), torch.ones(QF_B, QF_N, dtype=torch.bool)], 1)[:, None, None, :]
    return {**qwen_flux_inputs(), "img_ids": img_ids, "txt_ids": txt_ids,
            "joint_attention_kwargs": {"attention_mask": joint}}


# name -> (model builder, masked inputs, masked attention calls per forward (all packed),
#          {stock processor class name: modules})
MODELS = {
    "sana": (sana_model, lambda: {**sana_pixart_inputs(SANA_LATENT), "encoder_attention_mask": TEXT_KEEP}, 2,
             {"SanaLinearAttnProcessor2_0": 2, "SanaAttnProcessor2_0": 2}),
    "pixart": (pixart_model, lambda: {**sana_pixart_inputs(PIXART_LATENT), "encoder_attention_mask": TEXT_KEEP},
               2, {"AttnProcessor2_0": 4}),
    "qwen": (qwen_model, _qwen_inputs, 2, {"QwenDoubleStreamAttnProcessor2_0": 2}),
    "flux": (flux_model, _flux_inputs, 2, {"FluxAttnProcessor": 2}),
    "chroma": (tiny_chroma, chroma_inputs, 4, {"FluxAttnProcessor": 4}),
    # text lengths 6, 1, 1: the token refiner's mask is packable too (see test_diffusers_hunyuan)
    "hunyuan": (hunyuan_model, lambda: {**hunyuan_inputs(3), "encoder_attention_mask": hunyuan_text_mask([6, 1, 1])},
                3, {"AttnProcessor2_0": 1, "HunyuanVideoAttnProcessor2_0": 2}),
}


def _class_counts(procs: dict) -> dict:
    counts: dict = {}
    for p in procs.values():
        counts[type(p).__name__] = counts.get(type(p).__name__, 0) + 1
    return counts


def _inners(model) -> dict:
    return {n: p.processor for n, p in model.attn_processors.items()}


def _assert_originals(model, originals: dict):
    procs = model.attn_processors
    assert procs.keys() == originals.keys()
    assert all(procs[n] is p for n, p in originals.items()), "a processor is not the original object"


# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", [None, "reference"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_wrapped_model_equals_stock(name, backend):
    """Output and every parameter gradient equal stock; every masked attention ran packed; each
    wrapper holds the module's original processor object; unwrap restores exactly."""
    build, make_inputs, masked_calls, classes = MODELS[name]
    model = build()
    originals = model.attn_processors
    assert _class_counts(originals) == classes  # the config under test is what the table says
    ref = step(model, make_inputs())

    assert VP.wrap(model, backend=backend) is model
    procs = model.attn_processors
    assert all(isinstance(p, VP) and p.backend == backend for p in procs.values())
    assert all(procs[n].processor is p for n, p in originals.items())
    va.reset_stats()
    got = step(model, make_inputs())
    st = va.stats()
    assert_model_close(got, ref, what=f"{name}/wrapped/{backend}")
    packed = "split_sdpa" if backend is None else backend  # auto's pick on the CPU
    assert st["backends"].get(packed) == masked_calls, st
    assert st["fallbacks"] == {}, st

    assert VP.unwrap(model) is model
    _assert_originals(model, originals)
    assert_model_equal(step(model, make_inputs()), ref, what=f"{name}/unwrapped")


def test_sana_linear_attention_stays_linear():
    """Sana's self-attention is linear attention (SanaLinearAttnProcessor2_0, no SDPA, not the
    module class's default): wrapped, it is the same processor object and the same computation,
    bitwise. Running AttnProcessor2_0 there instead (what VarlenAttnProcessor() used to do)
    changes the result far beyond the tolerance: the model test above would catch it."""
    build, make_inputs, _, _ = MODELS["sana"]
    model = build()
    originals = model.attn_processors
    linear = {n: p for n, p in originals.items() if isinstance(p, SanaLinearAttnProcessor2_0)}
    assert sorted(linear) == ["transformer_blocks.0.attn1.processor", "transformer_blocks.1.attn1.processor"]
    ref = step(model, make_inputs())

    VP.wrap(model)
    assert all(_inners(model)[n] is p for n, p in linear.items())
    # Only the linear-attention modules wrapped: nothing there calls SDPA, so nothing changes.
    VP.unwrap(model)
    for block in model.transformer_blocks:
        block.attn1.set_processor(VP(block.attn1.get_processor(), backend="reference"))
    va.reset_stats()
    assert_model_equal(step(model, make_inputs()), ref, what="sana/linear attention wrapped")
    assert va.stats()["backends"] == {}

    # The former default: a generic processor on the linear-attention modules.
    for block in model.transformer_blocks:
        block.attn1.set_processor(VP(AttnProcessor2_0()))
    wrong = step(model, make_inputs())
    with pytest.raises(AssertionError, match="max error"):
        assert_model_close(wrong, ref, what="sana/generic processor")
    assert (wrong[0] - ref[0]).abs().max() > 1e-3


@pytest.mark.parametrize("kwargs", [{}, {"backend": "reference"}, {"processor": None, "strict": True}])
def test_bare_processor_is_refused_before_the_model_changes(kwargs):
    model = sana_model()
    originals = model.attn_processors
    with pytest.raises(va.InputTypeError, match=r"VarlenAttnProcessor\.wrap\(model\)") as info:
        model.set_attn_processor(VP(**kwargs))
    assert isinstance(info.value, TypeError)
    assert "linear attention" in str(info.value)
    _assert_originals(model, originals)  # the constructor raised: set_attn_processor never ran


def test_processor_argument_must_be_an_instance():
    with pytest.raises(va.InputTypeError, match="instance"):
        VP(AttnProcessor2_0)
    with pytest.raises(va.InputTypeError, match="instance"):
        VP(3)
    with pytest.raises(va.InputValueError):
        VP(AttnProcessor2_0(), backend="no_such_backend")


def test_wrap_twice_rewraps_never_nests_and_unwrap_restores():
    model = qwen_model()
    originals = model.attn_processors
    VP.wrap(model)
    VP.wrap(model, backend="reference", strict=True)
    procs = model.attn_processors
    assert all(isinstance(p, VP) and not isinstance(p.processor, VP) for p in procs.values())
    assert all(p.backend == "reference" and p.strict for p in procs.values())
    assert all(procs[n].processor is p for n, p in originals.items())
    VP.unwrap(model)
    _assert_originals(model, originals)
    VP.unwrap(model)  # nothing wrapped: nothing changes
    _assert_originals(model, originals)


def test_shared_processor_instance_stays_shared():
    """stock ``set_attn_processor(p)`` shares one instance between modules; wrap/unwrap keep that."""
    model = pixart_model()
    shared = AttnProcessor2_0()
    model.set_attn_processor(shared)
    VP.wrap(model)
    assert all(p.processor is shared for p in model.attn_processors.values())
    VP.unwrap(model)
    assert all(p is shared for p in model.attn_processors.values())


def test_wrap_a_single_module_or_a_block():
    build, make_inputs, _, _ = MODELS["qwen"]
    model = build()
    originals = model.attn_processors
    ref = step(model, make_inputs())
    attn = model.transformer_blocks[0].attn
    VP.wrap(attn, backend="reference")  # the module itself
    VP.wrap(model.transformer_blocks[1], backend="reference")  # a block holding one
    assert all(isinstance(p, VP) for p in model.attn_processors.values())
    va.reset_stats()
    assert_model_close(step(model, make_inputs()), ref, what="qwen/wrapped per module")
    assert va.stats()["backends"] == {"reference": 2}
    VP.unwrap(model)
    _assert_originals(model, originals)


class _CountingVP(VP):
    """A subclass of the wrapper with its own ``__init__`` and ``__call__``."""

    def __init__(self, processor, backend=None, strict=False):
        super().__init__(processor, backend, strict)
        self.calls = 0

    def __call__(self, attn, *args, **kwargs):
        self.calls += 1
        return super().__call__(attn, *args, **kwargs)


@pytest.mark.parametrize("cls", [VP, _CountingVP], ids=["VarlenAttnProcessor", "a subclass"])
def test_explicit_processor_per_module(cls):
    """``VarlenAttnProcessor(processor)`` as before: mirrors the processor's ``__call__``
    signature (diffusers passes Qwen-Image's ``encoder_hidden_states_mask`` and
    ``image_rotary_emb`` only to processors that declare them), and pickles back to its class.
    A subclass keeps its own ``__init__`` and ``__call__`` (before, ``__new__`` built on
    VarlenAttnProcessor itself: no ``__init__`` ran and the forward raised AttributeError)."""
    import pickle

    build, make_inputs, _, _ = MODELS["qwen"]
    model = build()
    ref = step(model, make_inputs())
    for block in model.transformer_blocks:
        block.attn.set_processor(cls(block.attn.get_processor(), backend="reference"))
    wrapped = model.transformer_blocks[0].attn.processor
    assert isinstance(wrapped, cls) and type(wrapped).__name__ == "VarlenQwenDoubleStreamAttnProcessor2_0"
    params = inspect.signature(wrapped.__call__).parameters
    assert {"encoder_hidden_states_mask", "image_rotary_emb"} <= params.keys()
    va.reset_stats()
    assert_model_close(step(model, make_inputs()), ref, what=f"qwen/explicit {cls.__name__}")
    assert va.stats()["backends"] == {"reference": 2}
    assert getattr(wrapped, "calls", 1) == 1
    copy = pickle.loads(pickle.dumps(wrapped))
    assert isinstance(copy, cls) and type(copy).__name__ == type(wrapped).__name__


class _WeightedProcessor(torch.nn.Module):
    """A processor with weights (like diffusers' IP-adapter processors)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.gain = torch.nn.Parameter(torch.ones((), dtype=torch.float64))

    def __call__(self, attn, *args, **kwargs):
        return self.gain * self.inner(attn, *args, **kwargs)


def test_wrap_refuses_without_changing_anything():
    model = pixart_model()
    attn = model.transformer_blocks[1].attn2
    attn.set_processor(_WeightedProcessor(attn.get_processor()))
    originals = model.attn_processors
    with pytest.raises(va.InputTypeError, match=r"transformer_blocks\.1\.attn2 .*nn\.Module.*enable_varlen"):
        VP.wrap(model)
    _assert_originals(model, originals)  # the module before it was not wrapped either
    assert "transformer_blocks.1.attn2.processor.gain" in dict(model.named_parameters())
    with pytest.raises(va.InputValueError, match="no diffusers attention module.*enable_varlen"):
        VP.wrap(torch.nn.Linear(2, 2))
    with pytest.raises(va.InputTypeError, match="torch.nn.Module"):
        VP.wrap(model.attn_processors)
    with pytest.raises(va.InputValueError):
        VP.wrap(pixart_model(), backend="no_such_backend")


def test_diffusers_backend_settings_reach_the_wrapped_processor():
    """``_attention_backend`` (set_attention_backend, enable_varlen's native backend) is the
    wrapped processor's; legacy processors without it stay without it (diffusers asks hasattr)."""
    build, make_inputs, masked_calls, _ = MODELS["flux"]
    model = build()
    ref = step(model, make_inputs())
    VP.wrap(model, backend="reference")
    model.set_attention_backend("native")
    inners = list(_inners(model).values())
    assert all(p._attention_backend == "native" for p in inners)
    assert all(w._attention_backend == "native" for w in model.attn_processors.values())
    # enable_varlen makes the backend native-by-default while enabled; the processors take its
    # policy, and each masked call builds its own plan from its own mask (Flux's joint mask is a
    # boolean key-padding mask: no host read).
    with va.varlen(model, backend="split_sdpa"):
        assert all(p._attention_backend is None for p in inners)
        va.reset_stats()
        got = step(model, make_inputs())
        st = va.stats()
    assert all(p._attention_backend == "native" for p in inners)
    assert_model_close(got, ref, what="flux/wrapped inside enable_varlen")
    assert st["backends"] == {"split_sdpa": masked_calls}, st
    assert st["plan_builds"] == masked_calls == FLUX_ATTN_LAYERS and st["host_syncs"] == 0, st
    model.reset_attention_backend()
    assert all(p._attention_backend is None for p in inners)

    sana = sana_model()
    VP.wrap(sana)
    assert not any(hasattr(p, "_attention_backend") for p in sana.attn_processors.values())


def test_deepcopy_and_pickle_keep_the_wrappers():
    build, make_inputs, _, _ = MODELS["sana"]
    model = build()
    ref = step(model, make_inputs())
    VP.wrap(model, backend="reference")
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        procs, orig = clone.attn_processors, model.attn_processors
        assert all(type(procs[n]) is type(p) and procs[n].backend == "reference" for n, p in orig.items())
        assert all(procs[n].processor is not p.processor for n, p in orig.items())
        assert _class_counts(_inners(clone)) == {"SanaLinearAttnProcessor2_0": 2, "SanaAttnProcessor2_0": 2}
        assert_model_close(step(clone, make_inputs()), ref, what="sana/copied")
        VP.unwrap(clone)
        assert _class_counts(clone.attn_processors) == {"SanaLinearAttnProcessor2_0": 2, "SanaAttnProcessor2_0": 2}
