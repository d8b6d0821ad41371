"""How an enabled forward follows its masks: the mode, or tracked mask tensors.

The first forward of an enabled model (per set of mask inputs) runs under the mode, which sees
every torch function, and learns whether every mask that reached attention was derived from the
mask inputs alone. Where it was, later forwards wrap the mask inputs as tracked masks instead:
only functions taking one of them enter Python. These tests check that each diffusers model
lands where its mask code says, that the tracked forwards equal stock in output and gradients,
and what switches a model back to the mode.
"""

from __future__ import annotations

import copy
import ctypes

import pytest
import torch
import torch.nn.functional as F

import varlen_attn as va
from _models import (PIXART_LATENT, QF_B, QF_H, QF_N, QF_W, SANA_LATENT, SP_T, chroma_inputs, flux_ids,
                     flux_model, hunyuan_inputs, hunyuan_model, hunyuan_text_mask, pixart_model, prefix_keep,
                     own_names, qwen_flux_inputs, qwen_model, sana_model, sana_pixart_inputs, step, tiny_chroma)
from _testing import assert_model_close
from varlen_attn.model import RECHECK_UNMASKED

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
# forward). Qwen-Image joins its text mask with a torch.ones made in every attention layer: tracked
# masks plus the mode inside attention modules ("local"). HunyuanVideo's refiner writes its mask
# in place: a mask the tracked tensors cannot see made, so the mode stays.
MODELS = {
    "chroma": (tiny_chroma, lambda: chroma_inputs(), "tracked", 1),
    "flux": (flux_model, _qwen_flux("flux"), "tracked", 1),
    "sana": (sana_model, _sana_pixart(SANA_LATENT), "tracked", 1),
    "pixart": (pixart_model, _sana_pixart(PIXART_LATENT), "tracked", 1),
    "qwen": (qwen_model, _qwen_flux("qwen"), "entry", 1),
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
            # Forward pre-hooks on the attention modules' children: while forwards learn (every
            # forward under the mode), and where they learned to leave the hook at the first
            # submodule call.
            assert _watched(model) == (i == 0 or expected in ("mode", "entry")), (i, expected)
    finally:
        va.disable_varlen(model)
    assert not _watched(model)


def _watched(model) -> bool:
    from varlen_attn.model import _leave_entry

    return any(fn is _leave_entry for m in model.modules() for fn in m._forward_pre_hooks.values())


@pytest.mark.parametrize("name", ["chroma", "qwen"])
def test_compiled_blocks_track_and_run_without_the_hook(name, monkeypatch):
    """Blocks compiled after tracked forwards: the compiled graphs route their own attention
    (their derivation, Qwen-Image's torch.ones included, was followed while tracing), so every
    later forward tracks as learned eagerly, runs no call through the hook (Qwen-Image's attention
    modules run inside the graphs), builds one plan and equals stock."""
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
            assert st["forwards"] == {MODELS[name][2]: 1}, (i, st)
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


# -- the mode inside attention modules only ("local", "entry") ------------------------------------


class _JoinAttention(torch.nn.Module):
    """Attention as diffusers' modules are recognised (a ``processor``), over the text mask it is
    given joined with all-True image keys: made here (``extra`` None, as Qwen-Image's processor
    does) or handed in by its caller. ``late``: made after the projection (a submodule call)
    instead of before it, as Qwen-Image does."""

    def __init__(self, dim=16, heads=2, late=False):
        super().__init__()
        self.processor = object()
        self.qkv = torch.nn.Linear(dim, 3 * dim, dtype=torch.float64)
        self.heads, self.late = heads, late

    def joined(self, x, text_mask, extra):
        if extra is None:
            extra = torch.ones(x.shape[0], x.shape[1] - text_mask.shape[1], dtype=torch.bool)
        return torch.cat([text_mask, extra], 1)[:, None, None, :]

    def forward(self, x, text_mask, extra=None):
        mask = None if self.late else self.joined(x, text_mask, extra)
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        mask = self.joined(x, text_mask, extra) if self.late else mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2)


class _JoinNet(torch.nn.Module):
    """Layers of :class:`_JoinAttention`; ``outside`` names the layers whose all-True keys the
    net makes itself, outside the attention module."""

    def __init__(self, outside=(), layers=3, image=6, late=False):
        super().__init__()
        self.layers = torch.nn.ModuleList(_JoinAttention(late=late) for _ in range(layers))
        self.outside, self.image = set(outside), image

    def forward(self, x, attention_mask):
        for i, layer in enumerate(self.layers):
            extra = torch.ones(x.shape[0], self.image, dtype=torch.bool) if i in self.outside else None
            x = x + layer(x, attention_mask, extra)
        return x


def _hook_calls(monkeypatch) -> list:
    """The list that every call through the hook appends to: its scope's attention depth, and
    the function's name."""
    from varlen_attn import hook, scope

    calls = []
    original = hook.VarlenHook.__torch_function__

    def counted(self, func, types, args=(), kwargs=None):
        s = scope.current_scope()
        calls.append((s.attention_depth, getattr(func, "__name__", "")))
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(hook.VarlenHook, "__torch_function__", counted)
    return calls


def _swap(model, cls):
    """``model``'s layers replaced by ``cls`` layers with the same weights."""
    for i in range(len(model.layers)):
        fresh = cls()
        fresh.load_state_dict(model.layers[i].state_dict())
        model.layers[i] = fresh
    return model


def _join_inputs():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4 + 6, 16, generator=g, dtype=torch.float64, requires_grad=True)
    return x, prefix_keep([4, 1, 0], 4)


@pytest.mark.parametrize("outside, late, expected", [((), False, "entry"), ((), True, "local"),
                                                     ((0, 1, 2), False, "mode"), ((1,), False, "mode")],
                         ids=["inside-first", "inside-late", "outside", "both"])
def test_factories_made_inside_attention_only_track_locally(outside, late, expected, monkeypatch):
    """A mask joined with a factory's output inside attention modules only: later forwards track
    their masks and pay the mode inside attention modules only: up to each module's first
    submodule call where the mask is made before it ("entry"), through the module where it is
    made after ("local"). A factory output made outside them as well (the same key) keeps the
    mode. Every way: one plan per forward, output and input gradient equal to stock."""
    torch.manual_seed(0)
    model = _JoinNet(outside, late=late)
    x, keep = _join_inputs()
    ref = model(x, keep)
    (ref_grad,) = torch.autograd.grad(ref.sum(), x)
    calls = _hook_calls(monkeypatch)
    va.enable_varlen(model, backend="reference")
    try:
        for i in range(3):
            va.reset_stats()
            calls.clear()
            got = model(x, keep.clone())
            (grad,) = torch.autograd.grad(got.sum(), x)
            st = va.stats()
            assert st["forwards"] == {"mode" if i == 0 else expected: 1}, (i, st)
            assert st["plan_builds"] == 1 and st["backends"] == {"reference": 3}, (i, st)
            depths = [d for d, _ in calls]
            if i and expected in ("local", "entry"):
                assert depths and min(depths) > 0, (i, len(depths))  # never outside attention
                # The hook runs past the projection (``permute`` of its output) only where the
                # mask is made after it.
                assert any(f == "permute" for _, f in calls) == (expected == "local"), (i, calls)
            elif i:
                assert min(depths) == 0, i
            torch.testing.assert_close(got, ref)
            torch.testing.assert_close(grad, ref_grad)
    finally:
        va.disable_varlen(model)
    assert all("forward" not in layer.__dict__ for layer in model.layers)
    assert all(not layer.qkv._forward_pre_hooks for layer in model.layers)  # nothing of ours left


def test_qwen_pays_the_mode_at_attention_entry_only(monkeypatch):
    """Qwen-Image's later forwards run the hook inside attention modules only, and there only
    before the first projection (its processor makes its mask first; no ``linear`` through the
    hook): a few calls per attention module, against every call of the first (mode) forward."""
    build, inputs, _, _ = MODELS["qwen"]
    model = build()
    calls = _hook_calls(monkeypatch)
    va.enable_varlen(model)
    try:
        counts = []
        for _ in range(2):
            calls.clear()
            step(model, inputs())
            counts.append((len(calls), sum(d == 0 for d, _ in calls), sum(f == "linear" for _, f in calls)))
        attention = sum(1 for m in model.modules() if hasattr(m, "processor"))
    finally:
        va.disable_varlen(model)
    (mode_calls, mode_outside, mode_linear), (entry_calls, entry_outside, entry_linear) = counts
    assert mode_outside > 0 and entry_outside == 0 and mode_linear > 0 and entry_linear == 0, counts
    assert 0 < entry_calls <= 10 * attention < mode_calls, (counts, attention)


@pytest.mark.parametrize("pass_through_hook", [False, True], ids=["", "beside a diffusers hook that never skips"])
def test_an_attention_call_unseen_by_local_tracking_is_reported_and_relearned(caplog, pass_through_hook):
    """An attention module whose forward was put back after enabling (a hook registry removing
    its wrapper) is not seen by local tracking: its call runs stock SDPA (equal results). The
    forward says so and the next one relearns under the mode, routing every call again. Also
    where a diffusers hook replaces a forward but always calls it (layerwise casting's, on a
    LoRA layer): only hooks that may skip a module (caches) turn the report off."""
    torch.manual_seed(0)
    model = _JoinNet()
    x, keep = _join_inputs()
    ref = model(x, keep)
    if pass_through_hook:
        from diffusers.hooks import HookRegistry
        from diffusers.hooks.layerwise_casting import PeftInputAutocastDisableHook
        linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        HookRegistry.check_if_exists_or_initialize(linear).register_hook(PeftInputAutocastDisableHook(), "cast")
    va.enable_varlen(model, backend="reference")
    try:
        model(x, keep.clone())
        del model.layers[1].forward  # the class's forward again: no _AttentionForward
        va.reset_stats()
        with caplog.at_level("WARNING", logger="varlen_attn"):
            got = model(x, keep.clone())
        assert va.stats()["forwards"] == {"entry": 1} and va.stats()["backends"] == {"reference": 2}
        assert "2 masked attention call(s)" in caplog.text and "ran stock SDPA" in caplog.text
        torch.testing.assert_close(got, ref)
        va.reset_stats()
        torch.testing.assert_close(model(x, keep.clone()), ref)
        assert va.stats()["forwards"] == {"mode": 1} and va.stats()["backends"] == {"reference": 3}
    finally:
        va.disable_varlen(model)


class _LateFactory(_JoinAttention):
    """Makes its mask before the projection while ``model.late`` is False, after it otherwise:
    mask code that changes after the tracking was learned."""

    def forward(self, x, text_mask, extra=None):
        self.late = self.net_late[0]
        return super().forward(x, text_mask, extra)


def test_a_mask_made_past_the_entry_after_learning_is_reported_and_tracked_locally(caplog):
    """Under "entry" the hook leaves an attention module at its first submodule call. A module
    that starts making its mask after that call (changed code) is not seen there: its calls run
    stock SDPA (equal results), the forward says so, and the forwards after learn again and
    keep the hook through the attention modules ("local") even where the code is early again,
    routing every call."""
    torch.manual_seed(0)
    model = _JoinNet()
    late = [False]
    for i, layer in enumerate(model.layers):
        model.layers[i] = _LateFactory()
        model.layers[i].load_state_dict(layer.state_dict())
        model.layers[i].net_late = late
    x, keep = _join_inputs()
    ref = model(x, keep)
    va.enable_varlen(model, backend="reference")
    try:
        model(x, keep.clone())
        va.reset_stats()
        torch.testing.assert_close(model(x, keep.clone()), ref)
        assert va.stats()["forwards"] == {"entry": 1}
        late[0] = True
        va.reset_stats()
        with caplog.at_level("WARNING", logger="varlen_attn"):
            got = model(x, keep.clone())
        assert va.stats()["forwards"] == {"entry": 1} and va.stats()["backends"] == {}
        assert "0 masked attention call(s)" in caplog.text and "ran stock SDPA" in caplog.text
        torch.testing.assert_close(got, ref)
        late[0] = False  # early again: still "local" from now on, not "entry" and a miss again
        for expected in ("mode", "local", "local"):
            va.reset_stats()
            torch.testing.assert_close(model(x, keep.clone()), ref)
            st = va.stats()
            assert st["forwards"] == {expected: 1} and st["backends"] == {"reference": 3}, st
    finally:
        va.disable_varlen(model)


class _WeightsWrittenLate(_JoinAttention):
    """A float tensor made before the projection and joined with the tracked mask into the
    attention bias: before the projection, or (``late``, code changed after the tracking was
    learned) after it, first written there by a write that takes no tracked mask."""

    def forward(self, x, text_mask, extra=None):
        keep = self.joined(x, text_mask, extra)
        weights = torch.zeros(keep.shape, dtype=x.dtype)
        bias = None if self.late else torch.where(keep, weights, float("-inf"))
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        if self.late:
            weights[..., 0] = float("-inf")
            bias = torch.where(keep, weights, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).flatten(2)


def test_a_plain_tensor_written_past_the_entry_never_reuses_its_key(caplog):
    """Under inference_mode no version counter shows an in-place write, and past an attention
    module's first submodule call the hook no longer sees one. So the keys the hook gave plain
    tensors there go with it: a bias made from one written later is not taken for the earlier
    layers' (whose plan keeps key 0). Its call runs stock SDPA, said so, and every output
    equals stock."""
    torch.manual_seed(0)
    model = _swap(_JoinNet(), _WeightsWrittenLate)
    x, keep = _join_inputs()
    with torch.inference_mode():
        x = x.detach().clone()
        model.layers[1].late = True
        ref = model(x, keep)
        model.layers[1].late = False
        va.enable_varlen(model, backend="reference")
        try:
            model(x, keep.clone())
            va.reset_stats()
            model(x, keep.clone())
            assert va.stats()["forwards"] == {"entry": 1} and va.stats()["backends"] == {"reference": 3}
            model.layers[1].late = True
            va.reset_stats()
            with caplog.at_level("WARNING", logger="varlen_attn"):
                got = model(x, keep.clone())
            torch.testing.assert_close(got, ref)
            assert va.stats()["forwards"] == {"entry": 1} and va.stats()["backends"] == {"reference": 2}
            assert "2 masked attention call(s)" in caplog.text
        finally:
            va.disable_varlen(model)


class _BiasBeforeProjection(_JoinAttention):
    """A float bias made before the projection and written in place there: past the entry it
    would reach attention as a plain tensor, which only the hook routes."""

    def forward(self, x, text_mask, extra=None):
        keep = self.joined(x, text_mask, extra)
        bias = torch.zeros(keep.shape, dtype=x.dtype)
        bias.masked_fill_(~keep, float("-inf"))
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).flatten(2)


class _WritesAfterProjection(_JoinAttention):
    """The joined mask made before the projection, one key dropped after it by an in-place
    write that takes no tracked mask."""

    def forward(self, x, text_mask, extra=None):
        mask = self.joined(x, text_mask, extra)
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        mask[..., -1] = False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2)


@pytest.mark.parametrize("layer", [_BiasBeforeProjection, _WritesAfterProjection], ids=["plain-bias", "late-write"])
@pytest.mark.parametrize("inference", [False, True], ids=["grad", "inference_mode"])
def test_what_only_the_hook_sees_past_the_entry_keeps_it_through_the_module(layer, inference):
    """Masks made before the first submodule call, but routed or written where only the hook
    sees them (a plain float bias, an in-place write without a tracked mask): the mode forward
    learns "local", not "entry", and every later forward routes every call with one plan per
    mask, equal to stock (also under inference_mode, where no version counter shows a write)."""
    torch.manual_seed(0)
    model = _swap(_JoinNet(), layer)
    x, keep = _join_inputs()
    ctx = torch.inference_mode() if inference else torch.enable_grad()
    with ctx:
        x = x.detach().clone() if inference else x
        ref = model(x, keep)
        va.enable_varlen(model, backend="reference")
        try:
            for i in range(3):
                va.reset_stats()
                got = model(x, keep.clone())
                st = va.stats()
                assert st["forwards"] == {"mode" if i == 0 else "local": 1}, (i, st)
                assert st["backends"] == {"reference": 3} and st["fallbacks"] == {}, (i, st)
                torch.testing.assert_close(got, ref)
        finally:
            va.disable_varlen(model)


class _WritesItsMask(_JoinAttention):
    """Attention twice, the joined mask written in place in between."""

    def forward(self, x, text_mask, extra=None):
        if extra is None:
            extra = torch.ones(x.shape[0], x.shape[1] - text_mask.shape[1], dtype=torch.bool)
        mask = torch.cat([text_mask, extra], 1)[:, None, None, :]
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        first = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        mask[..., -1] = False
        return (first + F.scaled_dot_product_attention(q, k, v, attn_mask=mask)).transpose(1, 2).flatten(2)


def test_a_mask_written_in_place_inside_attention_gets_a_new_plan_under_inference_mode():
    """Under local tracking a mask of unknown derivation (the image keys made outside attention,
    after the tracking was learned) is keyed by object at its first attention call; written in
    place (no version counter under inference_mode), the second call must not reuse its plan."""
    torch.manual_seed(0)
    model = _JoinNet(layers=1)
    model.layers[0] = _WritesItsMask()
    x, keep = _join_inputs()
    with torch.inference_mode():
        x = x.detach().clone()
        model.outside = {0}
        ref = model(x, keep)
        model.outside = set()
        va.enable_varlen(model, backend="reference")
        try:
            model(x, keep.clone())
            model(x, keep.clone())
            model.outside = {0}
            va.reset_stats()
            got = model(x, keep.clone())
            assert va.stats()["forwards"] == {"local": 1} and va.stats()["plan_builds"] == 2
        finally:
            va.disable_varlen(model)
    torch.testing.assert_close(got, ref)


def test_a_model_pickled_enabled_by_the_previous_release_runs_and_disables():
    """Its state has the previous release's fields (no attention forwards, no learned tracking
    by that name): it loads, runs routed, learns again and disables."""
    import pickle

    torch.manual_seed(0)
    model = _JoinNet()
    x, keep = _join_inputs()
    ref = model(x, keep)
    va.enable_varlen(model, backend="reference")
    state = model._varlen_state
    del state.tracking, state.attention
    state.root_derived = {}
    loaded = pickle.loads(pickle.dumps(model))
    for i in range(2):
        va.reset_stats()
        torch.testing.assert_close(loaded(x, keep.clone()), ref)
        assert va.stats()["backends"] == {"reference": 3}, (i, va.stats())
    va.disable_varlen(loaded)
    assert not hasattr(loaded, "_varlen_state")


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_of_a_model_that_leaves_the_hook_at_entry_do_the_same(how):
    """An EMA copy (deepcopy) or a pickled model, taken after the forwards learned "entry": the
    copy keeps the learned tracking and the children's forward pre-hooks, routes every call with
    its own weights, equals stock, and disables on its own."""
    import copy
    import pickle

    torch.manual_seed(0)
    model = _JoinNet()
    x, keep = _join_inputs()
    va.enable_varlen(model, backend="reference")
    try:
        model(x, keep.clone())
        model(x, keep.clone())
        twin = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
        with torch.no_grad():
            for p in twin.parameters():
                p.mul_(0.5)
        va.reset_stats()
        got = twin(x, keep.clone())
        assert va.stats()["forwards"] == {"entry": 1} and va.stats()["backends"] == {"reference": 3}
        assert _watched(twin) and _watched(model)
        va.disable_varlen(twin)
        assert not _watched(twin) and _watched(model)
        torch.testing.assert_close(got, twin(x, keep))  # stock, the copy's weights
        assert (got - model(x, keep.clone())).abs().max() > 1e-3
    finally:
        va.disable_varlen(model)


class _LikeWrittenLate(_JoinAttention):
    """A float bias from ``zeros_like`` of the tracked mask: made before the projection, or
    (``late``, code changed after learning) after it, its zeros first written by a plain op."""

    def forward(self, x, text_mask, extra=None):
        keep = self.joined(x, text_mask, extra)
        if not self.late:
            bias = torch.where(keep, torch.zeros_like(keep, dtype=x.dtype), float("-inf"))
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        if self.late:
            weights = torch.zeros_like(keep, dtype=x.dtype)
            weights[..., 0] = float("-inf")
            bias = torch.where(keep, weights, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).flatten(2)


class _ViewThenWrite(_JoinAttention):
    """A view of the joined mask taken, then its base written in place (``write``)."""

    write = False

    def forward(self, x, text_mask, extra=None):
        mask = self.joined(x, text_mask, extra)[:, 0, 0, :]
        view = mask[:, None, None, :]
        if self.write:
            mask[:, 0] = False
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=view).transpose(1, 2).flatten(2)


@pytest.mark.parametrize("inference", [False, True], ids=["no_grad", "inference_mode"])
def test_a_plain_tensor_made_by_a_tracked_mask_is_never_keyed_unseen(inference):
    """Without a hook, only tracked masks have their writes seen: a plain tensor a tracked mask
    makes (``zeros_like(mask, dtype=float)``) gets no key, so a bias from it written in one layer
    only is never taken for the other layers' (under inference_mode no version counter would
    show the write). Equal to stock."""
    torch.manual_seed(0)
    model = _swap(_JoinNet(), _LikeWrittenLate)
    x, keep = _join_inputs()
    with torch.inference_mode() if inference else torch.no_grad():
        x = x.detach().clone()
        model.layers[1].late = True
        ref = model(x, keep)
        model.layers[1].late = False
        va.enable_varlen(model, backend="reference")
        try:
            model(x, keep.clone())
            model(x, keep.clone())
            model.layers[1].late = True
            got = model(x, keep.clone())
        finally:
            va.disable_varlen(model)
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("inference", [False, True], ids=["no_grad", "inference_mode"])
def test_a_write_to_a_masks_base_is_seen_by_its_views(inference):
    """A view of a mask keyed, then its base written in place in one layer only: the view's key
    goes (no version counter tells an inference tensor's views), so that layer gets a plan of
    its own. Every forward equals stock."""
    torch.manual_seed(0)
    model = _swap(_JoinNet(), _ViewThenWrite)
    model.layers[1].write = True
    x, keep = _join_inputs()
    with torch.inference_mode() if inference else torch.no_grad():
        x = x.detach().clone()
        ref = model(x, keep)
        va.enable_varlen(model, backend="reference")
        try:
            for i in range(3):
                va.reset_stats()
                torch.testing.assert_close(model(x, keep.clone()), ref, msg=lambda m: f"forward {i}: {m}")
                assert va.stats()["backends"] == {"reference": 3}, (i, va.stats())
        finally:
            va.disable_varlen(model)


def test_tensor_methods_are_told_from_op_overloads_and_functions():
    """While dynamo traces the hook, a Tensor method is re-issued as a method call; an op overload
    (dotted name: torch 2.11's dynamo asserted on looking it up on torch.Tensor), a torch function
    or any other callable is called as it is."""
    from varlen_attn.hook import _tensor_method

    assert _tensor_method(torch.Tensor.unflatten) and _tensor_method(torch.Tensor.__getitem__)
    assert _tensor_method(torch.Tensor.add)
    assert not _tensor_method(torch.ops.aten.mul.Tensor)
    assert not _tensor_method(torch.add) and not _tensor_method(lambda t: t)


# ------------------------------------------------------------------------------------------------
# A layer that re-casts its mask with a function returning the mask itself (``mask.bool()`` of a
# bool mask, ``.to`` its own dtype or device, ``.contiguous()``) hands attention the same tensor:
# one plan per forward, as for the mask passed as it is.

_SAME = {"bool": lambda m: m.bool(), "to_dtype": lambda m: m.to(torch.bool), "to_device": lambda m: m.to("cpu"),
         "contiguous": lambda m: m.contiguous(), "as_is": lambda m: m}


class _CastsItsMask(torch.nn.Module):
    def __init__(self, cast):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16, dtype=torch.float64)
        self.cast = cast

    def forward(self, x, mask):
        q = self.proj(x).unflatten(-1, (2, 8)).transpose(1, 2)
        m = self.cast(mask)
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=m[:, None, None, :])
        return x + out.transpose(1, 2).flatten(2)


class _CastNet(torch.nn.Module):
    def __init__(self, cast, layers=4):
        super().__init__()
        self.layers = torch.nn.ModuleList(_CastsItsMask(cast) for _ in range(layers))

    def forward(self, x, attention_mask, return_dict=False):  # return_dict: as diffusers models (``step``)
        for layer in self.layers:
            x = layer(x, attention_mask)
        return (x,)


@pytest.mark.parametrize("grad", ["train", "inference_mode"])
@pytest.mark.parametrize("cast", list(_SAME))
def test_a_mask_cast_to_itself_in_every_layer_keeps_one_plan(cast, grad):
    torch.manual_seed(0)
    stock = _CastNet(_SAME[cast])
    model = va.enable_varlen(copy.deepcopy(stock))
    for lengths in ([5, 3, 1], [2, 5, 4], [1, 1, 5]):  # the first forward under the mode, then tracked
        x = torch.randn(3, 5, 16, dtype=torch.float64)
        keep = torch.arange(5)[None] < torch.tensor(lengths)[:, None]
        va.reset_stats()
        if grad == "train":
            got = step(model, {"x": x, "attention_mask": keep.clone()})
            want = step(stock, {"x": x, "attention_mask": keep.clone()})
            assert_model_close(got, want, what=f"{cast} {lengths}")
        else:
            with torch.inference_mode():
                got = model(x, keep.clone())[0]
                want = stock(x, keep.clone())[0]
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        st = va.stats()
        assert st["plan_builds"] == 1 and st["host_syncs"] == 1, (cast, lengths, st)
        assert st["backends"] == {"split_sdpa": 4} and st["fallbacks"] == {}, st


class _WritesThroughOut(_CastsItsMask):
    """Layer 1 and later narrow the mask in place through ``out=`` (a function not named as an
    in-place write that returns its input, written): the next layers must not reuse its plan."""

    def forward(self, x, mask):
        torch.logical_and(mask, self.drop, out=mask)
        return super().forward(x, mask)


@pytest.mark.parametrize("grad", ["train", "inference_mode"])
def test_a_mask_written_through_out_gets_a_new_plan(grad):
    torch.manual_seed(0)
    stock = _CastNet(_SAME["as_is"], layers=3)
    for i, layer in enumerate(stock.layers):
        layer.__class__ = _WritesThroughOut
        layer.drop = torch.ones(5, dtype=torch.bool)
        layer.drop[4 - i] = False  # each layer drops one more key position
    model = va.enable_varlen(copy.deepcopy(stock))
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    keep = torch.ones(3, 5, dtype=torch.bool)
    for _ in range(2):
        _assert_as_stock(model, stock, x, keep, grad, "out=")


def _assert_as_stock(model, stock, x, keep, grad: str, what: str) -> None:
    """``model`` and ``stock`` agree on ``(x, keep)``: output and gradients of a training step
    (``grad="train"``), or the output under ``torch.inference_mode``. Each gets its own copy of
    ``keep`` (the models write their masks)."""
    if grad == "train":
        assert_model_close(step(model, {"x": x, "attention_mask": keep.clone()}),
                           step(stock, {"x": x, "attention_mask": keep.clone()}), what=what)
    else:
        with torch.inference_mode():
            got, want = model(x, keep.clone())[0], stock(x, keep.clone())[0]
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _drop_key(mask, j, how, held):
    """Write key position ``j`` of every row of ``mask`` to False behind its version counter."""
    if how == "data":
        mask.data[:, j] = False
    elif how == "data set":
        keep = torch.ones(mask.shape[1], dtype=torch.bool)
        keep[j] = False
        mask.data = torch.logical_and(mask.data, keep)
    elif how == "numpy":
        mask.numpy()[:, j] = False
    elif how == "storage":
        storage = mask.untyped_storage()  # bool: one byte per element
        for b in range(mask.shape[0]):
            storage[b * mask.shape[1] + j] = 0
    elif how == "data_ptr":  # a raw write, as a custom kernel would make (bool: one byte per element)
        for b in range(mask.shape[0]):
            ctypes.memset(mask.data_ptr() + b * mask.shape[1] + j, 0, 1)
    else:  # "handle kept": the first layer takes .data, every layer writes through it
        if "data" not in held:
            held["data"] = mask.data
        held["data"][:, j] = False


class _WritesBehindTheCounter(_CastsItsMask):
    """Layer i drops one more key position of the model's mask, through what bumps no version
    counter (``.data``, NumPy, the storage): the next layers must not reuse an earlier plan."""

    def forward(self, x, mask):
        _drop_key(mask, 4 - self.index, self.how, self.held)
        return super().forward(x, mask)


@pytest.mark.parametrize("grad", ["train", "inference_mode"])
@pytest.mark.parametrize("how", ["data", "data set", "numpy", "storage", "data_ptr", "handle kept"])
def test_a_mask_written_behind_its_version_counter_gets_a_new_plan(how, grad):
    torch.manual_seed(0)
    stock = _CastNet(_SAME["as_is"], layers=3)
    held = {}
    for i, layer in enumerate(stock.layers):
        layer.__class__ = _WritesBehindTheCounter
        layer.index, layer.how, layer.held = i, how, held
    model = va.enable_varlen(copy.deepcopy(stock))
    for layer in model.layers:
        layer.held = held  # one handle for both models' layers, taken anew each forward
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    for _ in range(3):  # the first forward under the mode, then tracked masks
        keep = torch.ones(3, 5, dtype=torch.bool)
        va.reset_stats()
        held.clear()
        if grad == "train":
            got = step(model, {"x": x, "attention_mask": keep.clone()})
            held.clear()
            assert_model_close(got, step(stock, {"x": x, "attention_mask": keep.clone()}), what=how)
        else:
            with torch.inference_mode():
                got = model(x, keep.clone())[0]
                held.clear()
                want = stock(x, keep.clone())[0]
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        st = va.stats()
        # Every attention call ran packed (none went to stock SDPA unseen), on a plan of its own.
        assert st["backends"] == {"split_sdpa": 3} and st["fallbacks"] == {}, (how, st)
        assert st["plan_builds"] == 3, (how, st)


def _drop_key_through_a_view(mask, j, how, like):
    """Write key position ``j`` of every row of ``mask`` to False through plain views of it: the
    elements of a call that returns several (``unbind``, ``split``, ``chunk``), a view shaped
    after an activation (``view_as``, ``reshape_as``), or a transposing property (``T``, ``mT``)."""
    if how == "unbind":
        for row in mask.unbind(0):
            row[j] = False
    elif how in ("split", "chunk"):
        for part in (mask.split(1, 0) if how == "split" else mask.chunk(mask.shape[0], 0)):
            part[:, j] = False
    elif how in ("T", "mT"):  # property getters, which a tracked mask answers on a fast path
        getattr(mask, how)[j] = False
    else:
        view = mask.view_as(like) if how == "view_as" else mask.reshape_as(like)
        view[:, j] = False


class _WritesThroughAView(_CastsItsMask):
    """Layer i drops one more key position of the model's mask through a plain view of it, once
    ``writes`` is set (after the first forward: the forwards after it track masks, learned from
    one that wrote nothing)."""

    def forward(self, x, mask):
        if self.writes:
            _drop_key_through_a_view(mask, 4 - self.index, self.how, x[..., 0])
        return super().forward(x, mask)


@pytest.mark.parametrize("grad", ["train", "inference_mode"])
@pytest.mark.parametrize("how", ["unbind", "split", "chunk", "view_as", "reshape_as", "T", "mT"])
def test_a_mask_written_through_a_view_gets_a_new_plan(how, grad):
    """Under inference_mode no version counter shows a write through a view: the view must stay
    a tracked mask, so that its write is seen and the next layers build their own plan."""
    torch.manual_seed(0)
    stock = _CastNet(_SAME["as_is"], layers=3)
    for i, layer in enumerate(stock.layers):
        layer.__class__ = _WritesThroughAView
        layer.index, layer.how, layer.writes = i, how, False
    model = va.enable_varlen(copy.deepcopy(stock))
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    for i in range(3):  # the first forward under the mode, writing nothing; then tracked masks
        for layer in (*stock.layers, *model.layers):
            layer.writes = i > 0
        keep = torch.ones(3, 5, dtype=torch.bool)
        va.reset_stats()
        _assert_as_stock(model, stock, x, keep, grad, how)
        st = va.stats()
        assert st["fallbacks"] == {}, (how, st)
        if i == 1:  # the case this test is about: a write the tracking was not learned with
            assert st["forwards"] == {"tracked": 1}, st
        else:  # the forward after it follows the masks under the mode again (warned): all packed
            assert st["backends"] == {"split_sdpa": 3}, (how, st)


class _OneMaskNet(torch.nn.Module):
    """Every layer attends with the same 4-D mask tensor; layer 0 puts it on a buffer's storage
    (``.data = buffer``), and layer i drops key position 4 - i through the buffer."""

    def __init__(self, layers=3):
        super().__init__()
        self.projs = torch.nn.ModuleList(torch.nn.Linear(16, 16, dtype=torch.float64) for _ in range(layers))

    def forward(self, x, attention_mask, return_dict=False):
        m = attention_mask[:, None, None, :].clone()
        buffer = torch.ones_like(m)
        for i, proj in enumerate(self.projs):
            if i == 0:
                m.data = buffer
            buffer[..., 4 - i] = False
            q = proj(x).unflatten(-1, (2, 8)).transpose(1, 2)
            x = x + F.scaled_dot_product_attention(q, q, q, attn_mask=m).transpose(1, 2).flatten(2)
        return (x,)


@pytest.mark.parametrize("grad", ["train", "inference_mode"])
def test_a_mask_put_on_a_buffer_and_written_through_it_gets_a_new_plan(grad):
    torch.manual_seed(0)
    stock = _OneMaskNet()
    model = va.enable_varlen(copy.deepcopy(stock))
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    for _ in range(3):
        keep = torch.ones(3, 5, dtype=torch.bool)
        va.reset_stats()
        _assert_as_stock(model, stock, x, keep, grad, ".data = buffer")
        assert va.stats()["backends"] == {"split_sdpa": 3}, va.stats()


class _DerivesPerLayer(torch.nn.Module):
    """Layer ``i`` attends with ``derive(i, mask)``."""

    def __init__(self, derive, layers=3):
        super().__init__()
        self.derive = derive
        self.projs = torch.nn.ModuleList(torch.nn.Linear(16, 16, dtype=torch.float64) for _ in range(layers))

    def forward(self, x, attention_mask, return_dict=False):
        for i, proj in enumerate(self.projs):
            q = proj(x).unflatten(-1, (2, 8)).transpose(1, 2)
            m = self.derive(i, attention_mask)
            x = x + F.scaled_dot_product_attention(q, q, q, attn_mask=m).transpose(1, 2).flatten(2)
        return (x,)


_PER_LAYER = {
    # True == 1 as Python values, not as indices: a bool index selects, an int one gathers.
    "bool or int index": lambda i, m: m[:, torch.tensor([True] * 5) if i == 0 else torch.tensor([1] * 5)][
        :, None, None, :],
    # Random draws keyed like deterministic functions reused the first layer's plan.
    "poisson": lambda i, m: (m & (torch.poisson(m.double() * 2.0) > 1))[:, None, None, :],
    "binomial": lambda i, m: (m & (torch.binomial(torch.full(m.shape, 3.0, dtype=torch.float64),
                                                  torch.full(m.shape, 0.5, dtype=torch.float64)) > 1))[:, None, None, :],
    "gamma": lambda i, m: (m & (torch._standard_gamma(torch.full(m.shape, 2.0, dtype=torch.float64)) > 1.5))[
        :, None, None, :],
}


@pytest.mark.parametrize("how", list(_PER_LAYER))
def test_masks_each_layer_derives_differently_get_their_own_plans(how):
    torch.manual_seed(0)
    stock = _DerivesPerLayer(_PER_LAYER[how])
    model = va.enable_varlen(copy.deepcopy(stock))
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    for i in range(3):  # the first forward under the mode, then how it learned
        keep = torch.arange(5)[None] < torch.tensor([5, 4, 3])[:, None]
        with torch.no_grad():
            torch.manual_seed(100 + i)
            got = model(x, keep.clone())[0]
            torch.manual_seed(100 + i)
            want = stock(x, keep.clone())[0]
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"{how}, forward {i}")


@torch.library.custom_op("varlen_attn_tests::keep_first", mutates_args=("out",))
def _keep_first(src: torch.Tensor, out: torch.Tensor, n: int) -> None:
    """A mask kernel as a custom op: writes ``out`` (its second argument) with ``src``'s first
    ``n`` keys."""
    out.copy_(src)
    out[..., n:] = False


class _WritesABuffer(torch.nn.Module):
    """Every layer attends with one buffer mask, which layer i rewrites, by a custom op that
    mutates its second argument or by ``_foreach_copy_``, to keep its first 5 - i keys."""

    def __init__(self, how, layers=3):
        super().__init__()
        self.how = how
        self.projs = torch.nn.ModuleList(torch.nn.Linear(16, 16, dtype=torch.float64) for _ in range(layers))

    def forward(self, x, attention_mask, return_dict=False):
        m = attention_mask[:, None, None, :]
        buf = m.clone()
        for i, proj in enumerate(self.projs):
            if self.how == "custom op":
                _keep_first(m, buf, 5 - i)
            else:
                torch._foreach_copy_([buf], [m & (torch.arange(5) < 5 - i)])
            q = proj(x).unflatten(-1, (2, 8)).transpose(1, 2)
            x = x + F.scaled_dot_product_attention(q, q, q, attn_mask=buf).transpose(1, 2).flatten(2)
        return (x,)


@pytest.mark.parametrize("grad", ["train", "inference_mode"])
@pytest.mark.parametrize("how", ["custom op", "foreach"])
def test_a_mask_written_by_an_op_that_writes_another_argument_gets_a_new_plan(how, grad):
    """Under inference_mode no version counter shows these writes: the hook reads them from the op's
    schema (a custom op's ``mutates_args``) and from the list an in-place ``_foreach_*_`` takes."""
    torch.manual_seed(0)
    stock = _WritesABuffer(how)
    model = va.enable_varlen(copy.deepcopy(stock))
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    for lengths in ([5, 4, 5], [5, 5, 3], [4, 5, 5]):
        _assert_as_stock(model, stock, x, torch.arange(5)[None] < torch.tensor(lengths)[:, None], grad, how)


class _ReadsItsMaskOut(_CastsItsMask):
    """Hands the mask's memory out (read only) after its attention call, then multiplies the
    activations by the mask, and takes ``.data`` of a tensor without storage (sparse)."""

    def forward(self, x, mask):
        x = super().forward(x, mask)
        mask.numpy()
        torch.eye(2).to_sparse().data  # noqa: B018 - the escape of a tensor without storage
        return x * mask[..., None].to(x.dtype)


def test_an_escaped_mask_leaves_activations_plain_tensors():
    """After an escape, what is made from the mask and an activation is no tracked mask: the
    model hands back plain tensors, and the forwards after the first keep tracking masks."""
    torch.manual_seed(0)
    stock = _CastNet(_SAME["as_is"], layers=3)
    for layer in stock.layers:
        layer.__class__ = _ReadsItsMaskOut
    model = va.enable_varlen(copy.deepcopy(stock))
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    keep = torch.arange(5)[None] < torch.tensor([5, 3, 1])[:, None]
    for i in range(3):
        va.reset_stats()
        with torch.no_grad():
            got, want = model(x, keep.clone())[0], stock(x, keep.clone())[0]
        assert type(got) is torch.Tensor, type(got)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert va.stats()["forwards"] == ({"mode": 1} if i == 0 else {"tracked": 1}), va.stats()


@pytest.mark.parametrize("how", ["blocks compiled", "model compiled"])
def test_a_mask_cast_to_itself_in_compiled_layers_keeps_one_plan(how, fresh_dynamo):
    """The same under torch.compile (aot_eager): a traced ``mask.bool()`` is a new tensor of the
    graph, derived from the root, and every layer's derivation is the same."""
    torch.manual_seed(0)
    stock = _CastNet(_SAME["bool"])
    model = va.enable_varlen(copy.deepcopy(stock))
    if how == "blocks compiled":
        for layer in model.layers:
            layer.compile(fullgraph=True, backend="aot_eager")
        run = model
    else:
        run = torch.compile(model, backend="aot_eager")
    for lengths in ([5, 3, 1], [2, 5, 4]):
        x = torch.randn(3, 5, 16, dtype=torch.float64)
        keep = torch.arange(5)[None] < torch.tensor(lengths)[:, None]
        va.reset_stats()
        got = own_names(step(run, {"x": x, "attention_mask": keep.clone()}))
        assert_model_close(got, step(stock, {"x": x, "attention_mask": keep.clone()}), what=f"{how} {lengths}")
        st = va.stats()
        assert st["plan_builds"] == 1 and st["host_syncs"] == 1, (how, lengths, st)


# ------------------------------------------------------------------------------------------------
# Found in review of the changes above: each of these ran on a stale plan (wrong results).

class _MaskArgAttention(torch.nn.Module):
    """An attention module (it has a ``processor``) taking its key-padding mask as an argument
    (None: no mask)."""

    def __init__(self):
        super().__init__()
        self.processor = object()
        self.qkv = torch.nn.Linear(16, 48, dtype=torch.float64)

    def forward(self, x, attention_mask=None):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4)
        mask = None if attention_mask is None else attention_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).flatten(2)


def _stock_enabled_and_inputs(make, b: int, s: int):
    """``(stock, enabled copy, x [b, s, 16], keep [b, s])``, the last row's last two keys padded."""
    torch.manual_seed(0)
    stock = make()
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[-1, s - 2:] = False
    return stock, va.enable_varlen(copy.deepcopy(stock)), torch.randn(b, s, 16, dtype=torch.float64), keep


def _grad_mode(grad: str):
    return torch.inference_mode() if grad == "inference_mode" else torch.no_grad()


class _NarrowsAMaskOfItsOwn(torch.nn.Module):
    """After learning on ``attention_mask``, ``own`` switches to a mask it makes (unseen by tracked
    masks) and narrows in place before every layer, outside the attention modules."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_MaskArgAttention() for _ in range(3))
        self.own = False

    def forward(self, x, attention_mask, return_dict=False):
        own = x.new_ones(x.shape[:2], dtype=torch.bool) if self.own else None
        for i, layer in enumerate(self.layers):
            if own is not None:
                own[:, x.shape[1] - 1 - i] = False
            x = x + layer(x, attention_mask=attention_mask if own is None else own)
        return (x,)


@pytest.mark.parametrize("grad", ["no_grad", "inference_mode"])
def test_a_mask_argument_written_between_attention_modules_gets_a_new_plan(grad):
    stock, model, x, keep = _stock_enabled_and_inputs(_NarrowsAMaskOfItsOwn, b=2, s=6)
    with _grad_mode(grad):
        for _ in range(2):
            model(x, keep.clone())  # learns to follow tracked masks
        model.own = stock.own = True
        va.reset_stats()
        got, want = model(x, keep.clone())[0], stock(x, keep.clone())[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    st = va.stats()
    assert st["forwards"] == {"tracked": 1} and st["backends"] == {"split_sdpa": 3}, st
    assert st["plan_builds"] == 3, st  # one per value the mask took


class _FillsThroughAnOverload(_CastsItsMask):
    """Layer 1 and later fill the mask's last position through an aten op overload, whose name
    (``fill_.Scalar``) does not end in ``_``: a write all the same (its schema says so)."""

    def forward(self, x, mask):
        torch.ops.aten.fill_.Scalar(mask[:, -1], False)
        return super().forward(x, mask)


@pytest.mark.parametrize("grad", ["no_grad", "inference_mode"])
def test_a_mask_written_by_a_mutating_op_overload_gets_a_new_plan(grad):
    def make():
        net = _CastNet(_SAME["bool"], layers=2)
        net.layers[1].__class__ = _FillsThroughAnOverload
        return net

    stock, model, x, keep = _stock_enabled_and_inputs(make, b=3, s=5)
    with _grad_mode(grad):
        for _ in range(2):
            va.reset_stats()
            got, want = model(x, keep.clone())[0], stock(x, keep.clone())[0]
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            assert va.stats()["plan_builds"] == 2, va.stats()


class _FactoryFromValues(torch.nn.Module):
    """Each layer's mask comes from a like factory whose other tensor argument carries values: a
    0-d fill (``new_full``, ``full_like``) or a length in the size of ``new_ones``."""

    def __init__(self, how):
        super().__init__()
        self.layers = torch.nn.ModuleList(_MaskArgAttention() for _ in range(3))
        self.how = how

    def forward(self, x, attention_mask, return_dict=False):
        b, s = x.shape[:2]
        for i, layer in enumerate(self.layers):
            n = attention_mask.sum(1).min() - i  # a 0-d tensor, different per layer
            if self.how == "new_ones":
                m = torch.cat([attention_mask.new_ones((b, n)), attention_mask.new_zeros((b, s - n))], 1)
            else:  # the template, an activation, gives only dtype and device; n gives the values
                template = x[..., 0]
                bound = template.new_full((b, s), n) if self.how == "new_full" else torch.full_like(template, n)
                m = torch.arange(s) < bound
            x = x + layer(x, attention_mask=m.bool())
        return (x,)


@pytest.mark.parametrize("how", ["new_ones", "new_full", "full_like"])
def test_like_factories_key_their_other_tensor_arguments_by_value(how):
    torch.manual_seed(0)
    stock = _FactoryFromValues(how)
    model = va.enable_varlen(copy.deepcopy(stock))
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    keep = torch.ones(2, 6, dtype=torch.bool)
    with torch.no_grad():
        for _ in range(2):
            got, want = model(x, keep.clone())[0], stock(x, keep.clone())[0]
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


class _OwnMaskNet(torch.nn.Module):
    """Layers of attention modules, called with no mask input: the net makes a key-padding mask
    itself in every forward (``own=True``, from a factory's output), or none at all, or hands
    its attention modules a mask through their ``attention_mask`` argument (``handed``)."""

    def __init__(self, layers=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(_MaskArgAttention() for _ in range(layers))
        self.own = False
        self.handed = None

    def forward(self, x):
        mask = (torch.arange(x.shape[1]) < x.shape[1] - 2).expand(x.shape[:2]) if self.own else self.handed
        for layer in self.layers:
            x = x + layer(x, attention_mask=mask)
        return x


class _LengthsAttention(_MaskArgAttention):
    """Makes its key-padding mask itself, from ``lengths`` (no mask argument), where given."""

    def forward(self, x, lengths=None):
        mask = None if lengths is None else torch.arange(x.shape[1]) < torch.tensor(lengths)[:, None]
        return super().forward(x, attention_mask=mask)


class _LengthsNet(torch.nn.Module):
    """No mask input: its attention modules make masks from ``lengths`` where they differ."""

    def __init__(self, layers=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(_LengthsAttention() for _ in range(layers))

    def forward(self, x, lengths):
        for layer in self.layers:
            x = x + layer(x, lengths=lengths if len(set(lengths)) > 1 else None)
        return x


def test_a_forward_with_no_mask_input_follows_nothing_once_it_met_no_mask(monkeypatch):
    """A model called without its mask (or one with no mask input) has nothing for the mode to
    follow: after one forward under the mode that met no masked attention call, later ones track
    nothing (no Python on their torch functions), their SDPA calls stock's own, bitwise equal. A
    forward that meets a mask all the same (one its attention modules are handed) runs it packed,
    equal to stock, and sends the next forward back to the mode; a model that makes its own
    masks in every forward stays under the mode, one plan per forward. One that starts making
    masks inside its attention modules (unseen there: they run stock SDPA, equal) is seen again
    by the mode within ``RECHECK_UNMASKED`` forwards."""
    torch.manual_seed(0)
    model = _OwnMaskNet()
    x = torch.randn(3, 8, 16, dtype=torch.float64)
    calls = _hook_calls(monkeypatch)

    def run():
        va.reset_stats()
        calls.clear()
        return model(x), va.stats(), len(calls)

    ref = model(x)
    va.enable_varlen(model, backend="reference")
    try:
        seen = [run() for _ in range(3)]
        for got, _, _ in seen:
            assert torch.equal(got, ref)
        assert [s["forwards"] for _, s, _ in seen] == [{"mode": 1}, {"tracked": 1}, {"tracked": 1}]
        assert [s["backends"] for _, s, _ in seen] == [{}, {}, {}]
        assert seen[0][2] > 0 and seen[1][2] == seen[2][2] == 0, [n for _, _, n in seen]  # no Python per op

        keep = torch.ones(3, 8, dtype=torch.bool)
        keep[0, 5:] = False
        keep[2, 2:] = False
        model.handed = keep
        va.disable_varlen(model)
        ref_masked = model(x)
        va.enable_varlen(model, backend="reference")
        run()  # under the mode again (a new enable): learns nothing from a forward with a mask
        model.handed = None
        run()
        model.handed = keep  # a forward that follows nothing meets a mask
        got, st, _ = run()
        assert st["forwards"] == {"tracked": 1} and st["backends"] == {"reference": 3}, st
        torch.testing.assert_close(got, ref_masked)
        got, st, _ = run()
        assert st["forwards"] == {"mode": 1} and st["backends"] == {"reference": 3}, st
        torch.testing.assert_close(got, ref_masked)

        model.handed, model.own = None, True
        va.disable_varlen(model)
        ref_own = model(x)
        va.enable_varlen(model, backend="reference")
        for _ in range(3):
            got, st, _ = run()
            assert st["forwards"] == {"mode": 1} and st["plan_builds"] == 1, st
            torch.testing.assert_close(got, ref_own)
    finally:
        va.disable_varlen(model)

    net = _LengthsNet()
    ragged = [8, 5, 2]
    want_equal, want_ragged = net(x, [8, 8, 8]), net(x, ragged)
    va.enable_varlen(net, backend="reference")
    try:
        forwards = []
        for i in range(2 + RECHECK_UNMASKED):
            va.reset_stats()
            got = net(x, [8, 8, 8] if i < 2 else ragged)
            torch.testing.assert_close(got, want_equal if i < 2 else want_ragged, rtol=1e-12, atol=1e-12)
            forwards.append((next(iter(va.stats()["forwards"])), sum(va.stats()["backends"].values())))
        assert forwards[:2] == [("mode", 0), ("tracked", 0)], forwards
        # unseen until the recheck, then packed under the mode from there on
        first = forwards.index(("mode", 3), 2)
        assert 2 < first <= RECHECK_UNMASKED and all(f == ("tracked", 0) for f in forwards[2:first]), forwards
        assert all(f == ("mode", 3) for f in forwards[first:]), forwards
    finally:
        va.disable_varlen(net)
