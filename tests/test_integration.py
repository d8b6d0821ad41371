"""enable_varlen on a tiny Chroma (joint text-first sequence, outer-product mask re-derived in every
block), gradient checkpointing, the float-mask policy, plan lifetime, threads, processors.

Chroma's boolean ``[B, 1, S, S]`` outer-product masks are routed as their keys' mask
(``execution.attend_outer``); the calls that pack run on one plan of the outer product of the
model's ``[B, S]`` mask, built on the device (no host read) once per model forward
(``execution.Deferred.plan``: one ``plan_builds`` a forward) and shared by every block of that
forward and by diffusers' checkpoint recomputation of it. The forward's checks that each mask is
that outer product are read once when the model's forward ends (one host read per forward); a
recomputation's checks are left unread. Blocks the caller checkpoints with torch.utils.checkpoint
directly recompute without the model's mask (``execution.UNREAD``): each recomputed call that
packs builds its own plan from its own mask's factors. Calls auto leaves to stock SDPA build no
plan."""

import gc
import inspect
import logging
import threading

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import varlen_attn as va
from _models import CHROMA_ATTN_LAYERS, chroma_inputs, step, tiny_chroma
from _testing import CopySaved, CountSyncs, assert_model_close, assert_model_equal, checkpoint_blocks

diffusers = pytest.importorskip("diffusers", reason="the diffusers extra is not installed")


@pytest.fixture(scope="module")
def chroma():
    """One stock Chroma for the tests that leave it as they found it (varlen disabled again,
    no checkpointing, no processor or backend change); the others build their own."""
    return tiny_chroma()


@pytest.fixture(scope="module")
def stock(chroma):
    """``stock(**chroma_inputs kwargs)``: the stock step of the shared model, computed once."""
    cache = {}

    def get(**kwargs):
        key = tuple(sorted(kwargs.items()))
        if key not in cache:
            cache[key] = step(chroma, chroma_inputs(**kwargs))
        return cache[key]

    return get


@pytest.mark.parametrize("backend", ["auto", "split_sdpa", "reference"])
@pytest.mark.parametrize("lengths", [(5, 2, 0), (7, 7, 7), (0, 0, 0), (1, 3, 6)])
def test_chroma_equals_stock(chroma, stock, backend, lengths):
    ref = stock(lengths=lengths)
    va.enable_varlen(chroma, backend)
    try:
        va.reset_stats()
        got = step(chroma, chroma_inputs(lengths))
        st = va.stats()
    finally:
        va.disable_varlen(chroma)
    assert_model_close(got, ref, what=f"chroma/{lengths}/{backend}")
    # outer-product masks, every call packed on the forward's one device plan of the model's mask's
    # outer product, and one host read for the forward (its checks, read together when it ends)
    assert st["plan_builds"] == 1 and st["host_syncs"] == 1, st
    assert st["fallbacks"] == {}
    assert st["backends"].get("split_sdpa" if backend == "auto" else backend) == CHROMA_ATTN_LAYERS


def test_chroma_without_mask_is_untouched(chroma, stock):
    ref = stock(with_mask=False)
    with va.varlen(chroma):
        va.reset_stats()
        got = step(chroma, chroma_inputs(with_mask=False))
    assert_model_equal(got, ref)
    # Every SDPA call is stock's own, untouched and not counted.
    assert va.stats()["plan_builds"] == va.stats()["host_syncs"] == 0 and va.stats()["backends"] == {}


def test_one_device_plan_per_forward_and_one_read_per_forward(chroma):
    """Three steps of one batch: each forward builds one plan of its mask's outer product on the
    device, which all its attention calls share, and reads its checks once (one ``.item()``):
    none of the other syncing ops (``nonzero``, ``torch.equal``, ...) beyond the stock model's own."""
    inputs = chroma_inputs()
    with CountSyncs() as stock_ops:
        step(chroma, inputs)
    va.enable_varlen(chroma)
    try:
        va.reset_stats()
        with CountSyncs() as ours:
            for _ in range(3):
                step(chroma, inputs)
    finally:
        va.disable_varlen(chroma)
    # one .item() of ours per forward (its checks), no other sync, whatever the model does itself
    assert sorted(ours.ops) == sorted(stock_ops.ops * 3 + ["_local_scalar_dense.default"] * 3), ours.ops
    assert va.stats()["plan_builds"] == 3 and va.stats()["host_syncs"] == 3, va.stats()


def test_gradient_checkpointing_keeps_the_mask(stock):
    model = tiny_chroma()
    inputs = chroma_inputs()
    ref = stock()  # no checkpointing, mask applied everywhere
    model.enable_gradient_checkpointing()
    stock_ckpt = step(model, inputs)
    # diffusers' Chroma drops attention_mask in its checkpointed single blocks:
    assert (stock_ckpt[0] - ref[0]).abs().max() > 1e-3
    va.enable_varlen(model)
    va.reset_stats()
    got = step(model, inputs)
    st = va.stats()
    assert_model_close(got, ref, what="chroma/checkpointing")  # the mask applies with checkpointing too
    # 4 attention calls forward + 4 recomputed in backward, all on the forward's one device plan
    # (diffusers' recomputation shares it); one host read, the forward's checks (the
    # recomputation's are not read).
    calls = 2 * CHROMA_ATTN_LAYERS
    assert st["plan_builds"] == 1 and st["host_syncs"] == 1 and st["backends"] == {"split_sdpa": calls}, st
    va.disable_varlen(model)
    va.enable_varlen(model, restore_checkpoint_mask=False)
    # opt-out: stock behaviour
    assert_model_close(step(model, inputs), stock_ckpt, what="chroma/checkpointing, opt-out")
    va.disable_varlen(model)


@pytest.mark.usefixtures("fresh_dynamo")  # compiled blocks of earlier cases count towards dynamo's recompile limit
@pytest.mark.parametrize("use_reentrant,compiled,backend", [(False, None, "auto"), (True, None, "auto"),
                                                             (False, True, "auto"), (False, True, "reference"),
                                                             (True, True, "auto")])
def test_blocks_checkpointed_by_the_caller_equal_stock(use_reentrant, compiled, backend):
    """Blocks the caller checkpoints with torch.utils.checkpoint directly (eagerly, or around
    compiled blocks), reentrant or not: the recomputation, which runs in backward outside the
    model's forward, runs on varlen again (the attention modules' hooks, or a compiled block's
    boundary, put the model's policy on the thread), so torch's checkpoint finds the same tensors
    saved. Three steps with a new mask each equal stock checkpointed the same way. Eager or
    compiled: one device plan for the forward (the model's mask's outer product, shared by its
    calls), and one more per recomputed attention call (the recomputation, outside the model's
    forward, has no model mask: each call builds its plan from its own mask), and one host read
    per step (the forward's checks; the recomputation's are not read). Compiled blocks on both
    routes: the custom op (auto) and attention in the graph (``reference``, whose dense form
    traces)."""
    stock = checkpoint_blocks(tiny_chroma(), use_reentrant, None if compiled is None else False)
    model = va.enable_varlen(checkpoint_blocks(tiny_chroma(), use_reentrant, compiled), backend=backend)
    for i, lengths in enumerate([(5, 2, 0), (7, 1, 3), (2, 2, 2)]):
        va.reset_stats()
        got = step(model, chroma_inputs(lengths, seed=i))
        st = va.stats()
        assert_model_close(got, step(stock, chroma_inputs(lengths, seed=i)), what=f"{lengths}")
        calls = 2 * CHROMA_ATTN_LAYERS  # forward and recomputation
        assert st["plan_builds"] == 1 + CHROMA_ATTN_LAYERS and st["host_syncs"] == 1 and not st["fallbacks"], \
            (lengths, st)
        assert sum(st["backends"].values()) == calls, (lengths, st)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("strict", [False, True])
def test_a_whole_model_compiled_with_blocks_checkpointed_by_the_caller_runs_varlen(strict):
    """The whole model compiled around blocks the caller checkpoints with torch.utils.checkpoint
    (not diffusers' checkpoint function), which dynamo traces as a body of its own: every
    attention call of the forward and of its recomputation goes to varlen_attn (none runs stock
    SDPA uncounted, where ``strict`` would hold nothing), equal to stock, each building its plan
    from the mask Chroma derives in its block (one plan a step, one host read per call, and the
    comparison of a later step's new mask with the kept copy)."""
    stock = checkpoint_blocks(tiny_chroma())
    model = va.enable_varlen(checkpoint_blocks(tiny_chroma()), strict=strict)
    run = torch.compile(model, fullgraph=True, backend="aot_eager")
    for i, lengths in enumerate([(5, 2, 0), (7, 1, 3)]):
        va.reset_stats()
        got = step(run, chroma_inputs(lengths, seed=i))
        st = va.stats()
        got = (got[0], {n.replace("_orig_mod.", ""): g for n, g in got[1].items()})
        assert_model_close(got, step(stock, chroma_inputs(lengths, seed=i)), what=f"{lengths}")
        assert st["backends"] == {"split_sdpa": 2 * CHROMA_ATTN_LAYERS} and not st["fallbacks"], (lengths, st)
        assert st["plan_builds"] == 1 and st["host_syncs"] == 2 * CHROMA_ATTN_LAYERS + (i > 0), (lengths, st)


def test_a_checkpoint_around_an_enabled_forward_and_more_is_left_as_it_is():
    """A checkpoint the caller puts around an enabled model's whole forward *and* masked
    attention outside the model: its recomputation runs the model's forward again, with its
    hooks, on varlen, and the attention outside stays stock SDPA (not counted), as in the
    forward (routing it in the recomputation only would make torch's checkpoint stop:
    "Recomputed values ... have different metadata"). Two steps, each with its own mask."""
    def run(model, inputs):
        keep = inputs["attention_mask"][:, -inputs["hidden_states"].shape[1]:].clone()
        keep[0, 3:] = False  # padded keys for the attention outside the model

        def fn(hidden_states):
            out = model(**{**inputs, "hidden_states": hidden_states, "return_dict": False})[0]
            q = out.view(out.shape[0], out.shape[1], 2, 2).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q, attn_mask=keep[:, None, None, :])

        model.zero_grad(set_to_none=True)
        x = inputs["hidden_states"].clone().requires_grad_()
        out = torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False)
        out.pow(2).sum().backward()
        return {"out": out.detach(), "grad x": x.grad, **{n: p.grad for n, p in model.named_parameters()}}

    stock, model = tiny_chroma(), va.enable_varlen(tiny_chroma())
    for i, lengths in enumerate([(5, 2, 0), (7, 1, 3)]):
        va.reset_stats()
        got = run(model, chroma_inputs(lengths, seed=i))
        assert va.stats()["backends"] == {"split_sdpa": 2 * CHROMA_ATTN_LAYERS}, va.stats()  # forward, recomputation
        assert_model_close(got, run(stock, chroma_inputs(lengths, seed=i)), what=f"{lengths}")


def test_processors_in_a_block_the_caller_checkpoints_keep_their_own_policies():
    """A block the caller checkpoints, whose attention modules run a ``VarlenAttnProcessor``
    (one ``strict``; the other also given a mask it cannot pack, which it runs on masked SDPA)
    and a stock processor, outside any enabled model: each
    processor's recomputation runs as its forward did, under its own policy, and the stock
    module's stays stock SDPA (not counted)."""
    heads, dim, s = 2, 8, 12

    class Inner:
        def __call__(self, attn, x, mask):
            q, k, v = attn.qkv(x).view(x.shape[0], s, 3, heads, dim).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(x.shape)

    class Attn(torch.nn.Module):
        def __init__(self, processor):
            super().__init__()
            self.qkv, self.processor = torch.nn.Linear(heads * dim, 3 * heads * dim, dtype=torch.float64), processor

        def forward(self, x, mask):
            return self.processor(self, x, mask)

    class Block(torch.nn.Module):
        def __init__(self, varlen):
            super().__init__()
            torch.manual_seed(0)
            wrap = (lambda **kw: va.VarlenAttnProcessor(Inner(), **kw)) if varlen else (lambda **kw: Inner())
            self.a, self.b, self.c = Attn(wrap()), Attn(Inner()), Attn(wrap(strict=True))

        def forward(self, x, pad, rand):
            x = x + self.a(x, pad)
            x = x + self.b(x, pad)
            return x + self.c(x, pad) + self.a(x, rand)  # rand: not packable, SDPA under a's policy

    def run(block):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(3, s, heads * dim, generator=g, dtype=torch.float64, requires_grad=True)
        pad = (torch.arange(s)[None] < torch.tensor([12, 5, 1])[:, None])[:, None, None, :]
        rand = torch.rand(3, 1, s, s, generator=g) > 0.3
        rand[..., 0] = True
        block.zero_grad(set_to_none=True)
        torch.utils.checkpoint.checkpoint(block, x, pad, rand, use_reentrant=False).pow(2).sum().backward()
        return {"grad x": x.grad, **{n: p.grad for n, p in block.named_parameters()}}

    va.reset_stats()
    got = run(Block(True))
    st = va.stats()  # a and c on the padding mask, forward and recomputation; a on the other mask: SDPA
    assert st["backends"] == {"split_sdpa": 4, "sdpa": 2} and sum(st["fallbacks"].values()) == 2, st
    assert_model_close(got, run(Block(False)), what="processors")


@pytest.mark.parametrize("checkpointing", [True, False])
def test_hooks_that_copy_saved_tensors_leave_steps_equal_to_stock(checkpointing):
    """Under saved-tensor hooks that copy what autograd saves (offloading), a checkpointed block's
    recomputation gets copies of its inputs, the masks among them: every step still routes every
    attention call, the recomputed ones too, all on the one plan the forward builds on the device
    from the model's mask (diffusers' recomputation shares it), and equals stock under the same
    hooks."""
    # Stock without checkpointing: diffusers' checkpointed Chroma drops the mask in its single blocks.
    stock, model = tiny_chroma(), va.enable_varlen(tiny_chroma())
    if checkpointing:
        model.enable_gradient_checkpointing()
    calls = CHROMA_ATTN_LAYERS * (2 if checkpointing else 1)
    for i, lengths in enumerate([(5, 2, 0), (7, 1, 3), (0, 4, 7)]):
        inputs = chroma_inputs(lengths, seed=i)
        va.reset_stats()
        hooks = CopySaved()
        with hooks:
            got = step(model, inputs)
        st = va.stats()
        assert hooks.copied > 0
        assert st["plan_builds"] == 1 and sum(st["backends"].values()) == calls, (i, st)
        with CopySaved():
            want = step(stock, inputs)
        assert_model_close(got, want, what=f"step {i} {lengths}")


def test_float_mask_policy(chroma, stock, caplog):
    bool_ref = stock()
    float_inputs = chroma_inputs(mask_dtype=torch.float64)
    stock_float = stock(mask_dtype=torch.float64)  # SDPA reads 0/1 as a bias: not the meant mask
    assert (stock_float[0] - bool_ref[0]).abs().max() > 1e-3
    with caplog.at_level(logging.WARNING, logger="varlen_attn"):
        with va.varlen(chroma):
            va.reset_stats()
            got = step(chroma, float_inputs)
            step(chroma, float_inputs)
            # the 0/1 outer products read as boolean, checked against the model's mask: one device
            # plan a forward (shared by its calls), one read a step
            st_ = va.stats()
            assert st_["fallbacks"] == {} and st_["plan_builds"] == 2, st_
            assert st_["host_syncs"] == 2, st_
    assert_model_close(got, bool_ref, what="chroma/float 0-1 mask, policy bool")
    assert sum("float 0/1" in r.message for r in caplog.records) <= 1
    with va.varlen(chroma, float_mask="bias"):
        va.reset_stats()
        assert_model_close(step(chroma, float_inputs), stock_float, what="chroma/float 0-1 mask, policy bias")
        assert va.stats()["fallbacks"]  # a bias is not packable: SDPA ran, reason recorded
    with va.varlen(chroma, float_mask="error"), pytest.raises(va.InputTypeError, match="float_mask='error'"):
        step(chroma, float_inputs)
    # Not a 0/1 mask (a 0/0.5 "mask"): SDPA's additive reading under every policy.
    half = chroma_inputs(mask_dtype=torch.float64)
    half["attention_mask"] = half["attention_mask"] * 0.5
    stock_half = step(chroma, half)
    with va.varlen(chroma):
        assert_model_close(step(chroma, half), stock_half, what="chroma/0-0.5 mask")


def test_disable_restores_exactly():
    """enable_varlen adds forward hooks (the model's and its attention modules') and never
    replaces ``forward``; disable_varlen removes exactly those hooks, and a hook of the user's
    stays where it was."""
    def hooks(model):
        return {n: (list(m._forward_pre_hooks.values()), list(m._forward_hooks.values()))
                for n, m in model.named_modules()}

    model = tiny_chroma()
    own = model.transformer_blocks[0].attn.register_forward_hook(lambda *a: None)
    procs = {n: p for n, p in model.attn_processors.items()}
    forward_before = model.forward
    hooks_before = hooks(model)
    va.enable_varlen(model)
    va.enable_varlen(model)  # twice is harmless
    assert "forward" not in model.__dict__ and hasattr(model, "_varlen_state")
    added = {n: (len(pre) - len(hooks_before[n][0]), len(post) - len(hooks_before[n][1]))
             for n, (pre, post) in hooks(model).items()}
    attention = {n for n, m in model.named_modules() if getattr(m, "processor", None) is not None}
    assert added == {n: (1, 1) if n == "" or n in attention else (0, 0) for n in added}, added
    va.disable_varlen(model)
    assert "forward" not in model.__dict__ and model.forward == forward_before
    assert all(model.attn_processors[n] is p for n, p in procs.items())
    assert not hasattr(model, "_varlen_state")
    assert hooks(model) == hooks_before
    own.remove()


def test_diffusers_attention_backend_is_native_while_enabled():
    model = tiny_chroma()
    model.set_attention_backend("native")
    procs = [m.processor for m in model.modules() if hasattr(m, "processor")]
    before = [p._attention_backend for p in procs]
    assert all(b is not None for b in before)
    va.enable_varlen(model)
    assert all(p._attention_backend is None for p in procs)
    va.disable_varlen(model)
    assert [p._attention_backend for p in procs] == before


def test_varlen_processor_per_module(stock):
    model = tiny_chroma()
    ref = stock()
    va.VarlenAttnProcessor.wrap(model, backend="reference")
    va.reset_stats()
    got = step(model, chroma_inputs())
    assert_model_close(got, ref, what="chroma/VarlenAttnProcessor")
    assert va.stats()["backends"] == {"reference": CHROMA_ATTN_LAYERS}
    # Per-module wrapper of an explicit processor keeps its signature for diffusers' kwarg filter.
    inner = diffusers.models.transformers.transformer_flux.FluxAttnProcessor()
    wrapped = va.VarlenAttnProcessor(inner)
    assert isinstance(wrapped, va.VarlenAttnProcessor)
    assert "image_rotary_emb" in inspect.signature(wrapped.__call__).parameters


class ToyAttention(torch.nn.Module):
    """Two attention layers that re-derive a joint mask from a [B, T] input in every layer."""

    def __init__(self, d=16, h=2):
        super().__init__()
        self.h = h
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(d, 3 * d) for _ in range(2))

    def forward(self, x, encoder_mask):
        b, s, d = x.shape
        for lin in self.qkv:
            joint = torch.cat([encoder_mask, torch.ones(b, s - encoder_mask.shape[1], dtype=torch.bool)], 1)
            q, k, v = lin(x).view(b, s, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
            x = x + F.scaled_dot_product_attention(q, k, v, attn_mask=joint[:, None, None, :]).transpose(1, 2).reshape(b, s, d)
        return x


def test_no_growth_over_1000_steps():
    """1000 steps, a new mask each: one plan per attention call (two layers), none kept once
    its step is done, and this thread's stack of entries empty after each forward."""
    from varlen_attn.hook import current
    from varlen_attn.plan import _PLANS

    def plans_alive():
        gc.collect()
        return sum(isinstance(o, va.VarlenPlan) for o in gc.get_objects())

    model = va.enable_varlen(ToyAttention())
    x = torch.randn(2, 12, 16)
    before = plans_alive()
    va.reset_stats()
    for i in range(1000):
        mask = torch.arange(4)[None] < torch.tensor([i % 5, (i + 2) % 5])[:, None]
        model(x, mask).sum().backward()
        assert current() is None
    assert va.stats()["plan_builds"] == 2000 and va.stats()["host_syncs"] == 0, va.stats()
    assert plans_alive() <= before, "plans outlive their steps"
    assert len(_PLANS._entries) <= _PLANS._capacity


def test_two_models_in_two_threads():
    models = [va.enable_varlen(ToyAttention()) for _ in range(2)]
    xs = [torch.randn(2, 12, 16) for _ in range(2)]
    masks = [torch.tensor([[True, True, False, False], [True, False, False, False]]),
             torch.tensor([[True, True, True, False], [False, False, False, False]])]
    with torch.no_grad():
        expected = []
        for m, x, mask in zip(models, xs, masks):
            va.disable_varlen(m)
            expected.append(m(x, mask))
            va.enable_varlen(m)
    errors, results = [], [[], []]

    def work(i):
        try:
            with torch.no_grad():
                for _ in range(50):
                    results[i].append(models[i](xs[i], masks[i]))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for i in range(2):
        for r in results[i]:
            assert_model_close(r, expected[i], what=f"toy/thread {i}")


def test_enable_varlen_bad_input():
    with pytest.raises(va.InputTypeError, match="model must be a torch.nn.Module"):
        va.enable_varlen("model")
    with pytest.raises(va.InputValueError, match="float_mask must be one of"):
        va.enable_varlen(ToyAttention(), float_mask="maybe")
    with pytest.raises(va.InputValueError, match="backend must be"):
        va.enable_varlen(ToyAttention(), backend="fa9")
