"""Review of compiled blocks on the model's outer-product plan (``execution.outer_in_op``): the
custom op finds the forward's checks on the thread's stack and packs on the plan of the outer
product of the model's mask (or, unread, of the call's own factors). Its outputs and gradients
must equal masked SDPA (and the stock model) on every route, and agree with the eager path
(``execution.attend_outer``). CPU, float64."""

from __future__ import annotations

import copy
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

import varlen_attn as va
from varlen_attn import execution, kernels
from varlen_attn.execution import UNREAD, Deferred, Entry
from varlen_attn.functional import sdpa_with_policy
from varlen_attn.policy import Policy

from _models import CHROMA_ATTN_LAYERS, chroma_inputs, loss, step, tiny_chroma
from _testing import assert_model_close, checkpoint_blocks
from test_backends import fake_flash  # noqa: F401 - a fixture: FA4's fused route (own backward) on the CPU

# Element 0: padded tokens in the middle; 1: few kept; 2: none kept (dead: SDPA's zero rows).
KEEP = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)


def _qkv(keep, gqa, seed=0, d=32):
    g = torch.Generator().manual_seed(seed)
    b, s = keep.shape
    hq, hk = (4, 2) if gqa else (2, 2)
    return (torch.randn(b, hq, s, d, generator=g, dtype=torch.float64),
            *(torch.randn(b, hk, s, d, generator=g, dtype=torch.float64) for _ in range(2)))


def _out_and_grads(fn, q, k, v):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    return [out.detach(), *torch.autograd.grad((out * w).nan_to_num(0.0).sum(), (q, k, v))]


def _checks(mode, keep):
    return {"deferred": Deferred(keep, []), "unread": Deferred(keep, []).unread(), "UNREAD": UNREAD,
            "read": None}[mode]


def _compiled_sdpa(policy, gqa):
    return torch.compile(lambda q, k, v, m: sdpa_with_policy(q, k, v, m, enable_gqa=gqa, policy=policy),
                         fullgraph=True, backend="aot_eager")


def _run(f, entry, q, k, v, mask):
    def call(q, k, v):
        execution.push(entry)
        try:
            return f(q, k, v, mask)
        finally:
            execution.pop()
    return _out_and_grads(call, q, k, v)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("backend", ["auto", "reference", "flash_attn_4"])
def test_the_op_on_the_outer_plan_equals_masked_sdpa_on_every_route(backend, gqa, fake_flash, monkeypatch):  # noqa: F811
    """A compiled call whose mask is the outer product of the entry's model mask runs in the
    custom op on that product's plan (deferred: its check kept for the forward's read; unread:
    the forward's factors or the call's own, UNREAD), with no host read; outputs and gradients
    (the op's backward: FA4's own, or the forward recomputed for split_sdpa and reference) equal
    masked SDPA, a dead element included, with and without GQA."""
    monkeypatch.setitem(kernels.PRIORITY, "cpu", ("flash_attn_4", *kernels.PRIORITY["cpu"]))
    ran = {"auto": "flash_attn_4"}.get(backend, backend)
    q, k, v = _qkv(KEEP, gqa)
    mask = KEEP[:, None, :, None] & KEEP[:, None, None, :]
    ref = _out_and_grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa),
                         q, k, v)
    policy = Policy(backend, model=True)
    f = _compiled_sdpa(policy, gqa)
    for mode in ("deferred", "unread", "UNREAD", "read"):
        checks = _checks(mode, KEEP)
        va.reset_stats()
        got = _run(f, Entry(policy, checks=checks), q, k, v, mask)
        st = va.stats()
        assert st["backends"] == {ran: 1} and st["host_syncs"] == (mode == "read"), (mode, st)
        if mode == "deferred":
            assert len(checks.flags) == 1 and not checks.flags[0], checks.flags
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=lambda m: f"{mode}: {m}")


def _enabled_compiled(stock, checkpointing: bool = True, dynamic=None, **options):
    """An enabled copy of ``stock`` (``options``: enable_varlen's), checkpointed by diffusers,
    every block compiled on its own (aot_eager, ``dynamic`` as ``torch.compile`` takes it)."""
    model = va.enable_varlen(copy.deepcopy(stock), **options)
    if checkpointing:
        model.enable_gradient_checkpointing()
    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        block.compile(fullgraph=True, dynamic=dynamic, backend="aot_eager")
    return model


def _masks_seen(monkeypatch) -> list:
    """The shapes of the masks that reach stock's SDPA from now on (None: no mask), as a list."""
    seen, sdpa = [], execution.TORCH_SDPA

    def spy(*args, **kwargs):
        mask = kwargs.get("attn_mask")
        seen.append(None if mask is None else tuple(mask.shape))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(execution, "TORCH_SDPA", spy)
    return seen


@pytest.fixture
def stock_cheaper(monkeypatch, cpu_costs):
    """``stock_cheaper(kernel)``: ``cpu_costs(kernel)`` (conftest: stock on ``kernel``, weighed
    cheaper than packing at every length). Returns the list of calls that reached the op's outer
    route."""

    def use(kernel: str) -> list:
        cpu_costs(kernel)
        in_op, outer_in_op = [], execution.outer_in_op
        monkeypatch.setattr(execution, "outer_in_op", lambda *a, **kw: in_op.append(1) or outer_in_op(*a, **kw))
        return in_op

    return use


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("shape", ["batch", "broadcast", "sq_ne_sk"])
def test_the_keys_route_in_the_graph_equals_masked_sdpa_and_flags_or_poisons_a_failed_check(shape, gqa, stock_cheaper):
    """An enabled model's compiled call whose keys' mask auto leaves to stock's cuDNN (it fails on
    rows) runs in the graph (no call reaches the op's outer route): outputs and gradients equal
    masked SDPA exactly, a dead element, a mask broadcast over the batch and Sq != Sk included; the
    check kept for the forward's read (deferred: one flag, clear). A mask that is no outer product
    of its rows and keys: deferred, its flag set; unread (a recomputation), output and gradients
    NaN."""
    in_op = stock_cheaper("cudnn")
    keep_k = KEEP
    keep_q = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool) if shape == "sq_ne_sk" else KEEP
    mask = keep_q[:, None, :, None] & keep_k[:, None, None, :]
    if shape == "broadcast":
        mask = mask[:1]
    q, k, v = _qkv(KEEP, gqa)
    q = q[:, :, : keep_q.shape[1]]
    policy = Policy("auto", model=True, in_graph=True)
    f = torch.compile(lambda q, k, v, m: sdpa_with_policy(q, k, v, m, enable_gqa=gqa, policy=policy,
                                                          checks=execution.current().checks),
                      fullgraph=True, backend="aot_eager")
    bad_mask = mask.clone()
    bad_mask[..., 0] = True  # every query sees key 0: no outer product
    ref = _out_and_grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa),
                         q, k, v)
    for mode in ("deferred", "unread"):
        checks = _checks(mode, None)
        got = _run(f, Entry(policy, checks=checks), q, k, v, mask)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=lambda m: f"{mode}: {m}")
        if mode == "deferred":
            assert len(checks.flags) == 1 and not checks.flags[0], checks.flags
        checks = _checks(mode, None)
        qg = q.clone().requires_grad_()
        with execution.active(Entry(policy, checks=checks)):
            out = f(qg, k, v, bad_mask)
        (dq,) = torch.autograd.grad(out.sum(), qg)
        if mode == "deferred":
            assert len(checks.flags) == 1 and checks.flags[0], checks.flags
        else:
            assert out.isnan().all() and dq.isnan().all(), "a failed unread check: NaN output and gradients"
    assert not in_op


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("backend", ["auto", "flash_attn_4"])
def test_a_mask_that_is_no_product_of_the_models_mask_is_flagged_or_poisoned_in_the_op(backend, fake_flash,  # noqa: F811
                                                                                       monkeypatch):
    """The op's check: deferred, the flag the forward's read finds; unread (a recomputation),
    the op's output is all NaN (visible past the op), and its backward runs (no error) on
    the plan it kept; read in the call, the call's own mask gives masked SDPA under auto
    (an explicit backend raises, as eagerly)."""
    monkeypatch.setitem(kernels.PRIORITY, "cpu", ("flash_attn_4", *kernels.PRIORITY["cpu"]))
    q, k, v = _qkv(KEEP, False)
    mask = (KEEP[:, None, :, None] & KEEP[:, None, None, :]).clone()
    mask[0, 0, 2, :] = True  # a padded query attends every key: no outer product at all
    ref = _out_and_grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), q, k, v)
    policy = Policy(backend, model=True)
    f = _compiled_sdpa(policy, False)
    for mode in ("deferred", "unread", "UNREAD", "read"):
        checks = _checks(mode, KEEP)
        if mode == "read" and backend != "auto":  # an explicit backend never falls back
            with pytest.raises(va.BackendUnavailableError, match="needs a packable mask"):
                _run(f, Entry(policy, checks=checks), q, k, v, mask)
            continue
        got = _run(f, Entry(policy, checks=checks), q, k, v, mask)
        if mode == "deferred":
            assert len(checks.flags) == 1 and bool(checks.flags[0]), checks.flags
        elif mode == "read":
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        else:
            assert got[0].isnan().all(), mode


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_kernel_refusal_in_the_op_reroutes_on_the_outer_plan_with_exact_gradients(fake_flash, monkeypatch):  # noqa: F811
    """FA4 refuses the op's call (its forward's own check): auto runs it again on the next
    backend, on the same plan of the outer product (the route chosen again with the keys' mask),
    its check still deferred; the backward takes that route."""
    monkeypatch.setitem(kernels.PRIORITY, "cpu", ("flash_attn_4", *kernels.PRIORITY["cpu"]))
    iface = sys.modules["flash_attn.cute.interface"]

    def refuse(*args, **kwargs):
        raise AssertionError("Unsupported compute capability. Supported: 9.x")

    monkeypatch.setattr(iface, "_flash_attn_fwd", refuse)
    q, k, v = _qkv(KEEP, True)
    mask = KEEP[:, None, :, None] & KEEP[:, None, None, :]
    ref = _out_and_grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
                         q, k, v)
    policy = Policy("auto", model=True)
    checks = Deferred(KEEP, [])
    va.reset_stats()
    got = _run(_compiled_sdpa(policy, True), Entry(policy, checks=checks), q, k, v, mask)
    st = va.stats()
    assert st["backends"] == {"split_sdpa": 1} and st["host_syncs"] == 0 and len(checks.flags) == 1, st
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- the model


def _compiled(stock, checkpointing=False, **options):
    torch._dynamo.reset()  # dynamo does not guard on a compiled block's submodules' hooks
    model = va.enable_varlen(copy.deepcopy(stock), **options)
    if checkpointing:
        model.enable_gradient_checkpointing()
    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        block.compile(fullgraph=True, backend="aot_eager")
    return model


def _broadcast(inputs):
    """The model's mask given once for the whole batch ([1, S]), which stock broadcasts."""
    return {**inputs, "attention_mask": inputs["attention_mask"][:1].clone()}


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("compiled", [False, True])
def test_a_model_mask_broadcast_over_the_batch_equals_stock(compiled):
    """Chroma called with one mask for every sample (``[1, S]``, batch 3): its blocks' outer
    products are ``[1, 1, S, S]``, which SDPA broadcasts. The model's factors are of batch 1:
    a call of batch 3 must not run on their plan (the call's own factors, expanded, do). Eagerly
    and compiled, it raised (the plan of one element for a query of three)."""
    stock = tiny_chroma()
    model = _compiled(stock) if compiled else va.enable_varlen(copy.deepcopy(stock))
    for lengths, dtype in (((5, 5, 5), torch.bool), ((3, 3, 3), torch.float64)):
        va.reset_stats()
        assert_model_close(step(model, _broadcast(chroma_inputs(lengths, mask_dtype=dtype))),
                           step(stock, _broadcast(chroma_inputs(lengths))), what=f"broadcast mask {dtype}")
        # Bool: each call's own factors, checked with the forward's read; float: read in each call.
        assert not va.stats()["fallbacks"] and (va.stats()["host_syncs"] == 1 or dtype != torch.bool), va.stats()


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_blocks_without_grad_with_float_masks_dead_elements_on_a_thread_and_after_a_raise():
    """One model, every block compiled, diffusers' checkpointing on: the pipeline's float 0/1
    mask (read as bool), no_grad and inference_mode forwards, an element whose mask keeps
    nothing, a training step on another thread, and a forward that raised inside a compiled
    block: each equals stock, with one host read a forward, and nothing is left on the stack."""
    stock = tiny_chroma()
    model = _compiled(stock, checkpointing=True)

    def counted(what, got, want, reads=1):
        assert_model_close(got, want, what=what)
        st_ = va.stats()
        assert st_["host_syncs"] == reads and not st_["fallbacks"], (what, st_)
        assert execution.current() is None, what

    va.reset_stats()
    counted("float 0/1", step(model, chroma_inputs(mask_dtype=torch.float64)), step(stock, chroma_inputs()))
    inputs = chroma_inputs((7, 1, 3), seed=3)
    with torch.no_grad():
        want = stock(**inputs)[0]
        va.reset_stats()
        counted("no_grad", model(**inputs)[0], want)
    with torch.inference_mode():
        va.reset_stats()
        counted("inference_mode", model(**inputs)[0], want)
    dead = chroma_inputs((2, 0, 4), seed=4)
    dead["attention_mask"][1] = False  # an element that keeps nothing at all (its rows: zeros)
    va.reset_stats()
    counted("dead element", step(model, dead), step(stock, dead))

    found = {}

    def other_thread():
        va.reset_stats()
        found["got"] = step(model, chroma_inputs((1, 6, 2), seed=5))
        found["stats"], found["top"] = va.stats(), execution.current()

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert_model_close(found["got"], step(stock, chroma_inputs((1, 6, 2), seed=5)), what="thread")
    assert found["top"] is None and found["stats"]["host_syncs"] == 1, found["stats"]

    # The op raises inside the second block's compiled call (a plan freed under it): its boundary
    # and the model's hook take their entries off.
    real = execution.outer_in_op
    calls = []

    def raising(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    execution.outer_in_op = raising
    try:
        with pytest.raises(RuntimeError, match="boom"):
            model(**inputs)
    finally:
        execution.outer_in_op = real
    assert execution.current() is None
    va.reset_stats()
    counted("after a raise", step(model, inputs), step(stock, inputs))


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_blocks_under_a_float_bias_policy_read_the_float_mask_as_stock():
    """float_mask="bias": the pipeline's float mask is an additive bias, as stock reads it; no
    block treats it as a keep-mask (its outer product is not packed on the model's plan)."""
    stock = tiny_chroma()
    model = _compiled(stock, checkpointing=True, float_mask="bias")
    inputs = chroma_inputs(mask_dtype=torch.float64)
    va.reset_stats()
    assert_model_close(step(model, inputs), step(stock, inputs), what="float bias")
    st_ = va.stats()
    assert st_["backends"] == {"sdpa": 2 * CHROMA_ATTN_LAYERS} and st_["fallbacks"], st_


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_compiled_blocks_checkpointed_by_the_caller_with_a_float_mask(use_reentrant):
    """The caller's torch.utils.checkpoint around compiled blocks, the pipeline's float mask:
    the recomputation, outside the forward, is unread (UNREAD: no model mask, so a float mask
    is read in its call), and torch's checkpoint finds what its forward saved."""
    stock = checkpoint_blocks(tiny_chroma(), use_reentrant, False)
    model = va.enable_varlen(checkpoint_blocks(tiny_chroma(), use_reentrant, True))
    va.reset_stats()
    assert_model_close(step(model, chroma_inputs(mask_dtype=torch.float64)), step(stock, chroma_inputs()),
                       what="caller's checkpoint, float 0/1")
    assert not va.stats()["fallbacks"], va.stats()


@pytest.mark.usefixtures("fresh_dynamo")
def test_two_models_on_one_thread_each_check_their_own_forward():
    """Two enabled Chromas with compiled blocks (other weights, checkpointing), a forward of
    each, then one backward: each forward's checks are its own (the second's float mask is no
    0/1 mask: only that forward runs again), and both equal stock."""
    stock_a, stock_b = tiny_chroma(seed=0), tiny_chroma(seed=1)
    model_a = _compiled(stock_a, checkpointing=True)
    model_b = va.enable_varlen(copy.deepcopy(stock_b))
    model_b.enable_gradient_checkpointing()
    for block in [*model_b.transformer_blocks, *model_b.single_transformer_blocks]:
        block.compile(fullgraph=True, backend="aot_eager")
    inputs_a = chroma_inputs()
    inputs_b = chroma_inputs((3, 7, 1), seed=2, mask_dtype=torch.float64)
    inputs_b["attention_mask"] = inputs_b["attention_mask"] * 0.5  # a bias, not a keep-mask

    def both(a, b):
        for m in (a, b):
            m.zero_grad(set_to_none=True)
        (loss(a(**inputs_a)[0]) + loss(b(**inputs_b)[0])).backward()
        return [{n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None} for m in (a, b)]

    va.reset_stats()
    got = both(model_a, model_b)
    assert any("not the outer product of the model's mask" in r for r in va.stats()["fallbacks"]), va.stats()
    want = both(stock_a, stock_b)
    assert_model_close(got[0], want[0], what="model a")
    assert_model_close(got[1], want[1], what="model b")


@pytest.mark.usefixtures("fresh_dynamo")
def test_peft_lora_chroma_with_compiled_blocks():
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"], init_lora_weights="gaussian")
    stock = peft.get_peft_model(tiny_chroma(), cfg)
    enabled = copy.deepcopy(stock)
    inner = va.enable_varlen(enabled.base_model.model)
    inner.enable_gradient_checkpointing()
    for block in [*inner.transformer_blocks, *inner.single_transformer_blocks]:
        block.compile(fullgraph=True, backend="aot_eager")
    for inputs in (chroma_inputs(), chroma_inputs((3, 7, 1), seed=2, mask_dtype=torch.float64)):
        va.reset_stats()
        assert_model_close(step(enabled, inputs), step(stock, {**inputs, "attention_mask": inputs["attention_mask"] != 0}),
                           what="LoRA")
        assert va.stats()["host_syncs"] == 1 and not va.stats()["fallbacks"], va.stats()


def _regional(attend):
    """diffusers' attention dispatch ([B, S, H, D]) replaced by a user's that attends with a mask of
    its own, the block's outer product with its first query attending every key (no outer
    product), through ``attend(q, k, v, mask)``: varlen_attn's functional entry, or torch's SDPA."""
    def dispatch(query, key, value, attn_mask=None, **kwargs):
        mask = attn_mask.clone()
        mask[:, :, 0, :] = True
        return attend(query, key, value, mask)
    return dispatch


def _va_attention(q, k, v, mask):
    return va.attention(q, k, v, attn_mask=mask)


def _torch_attention(q, k, v, mask):
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask).transpose(1, 2)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("case", ["caller's checkpoint", "strict"])
def test_a_direct_functional_call_inside_a_compiled_block_is_read_in_its_call_as_eagerly(case, compiled, monkeypatch):
    """A call of varlen_attn's functional API that the user makes inside a compiled block of an
    enabled Chroma (not the model's SDPA call, which the hook routes with the forward's checks)
    is read in its call, as it is eagerly: its mask, no outer product of the model's, must not be
    checked against the model's mask (which, deferred, ran the forward again, or raised under the
    model's strict=True, and, unread in the caller's checkpoint's recomputation, made it NaN)."""
    from diffusers.models.transformers import transformer_flux

    ckpt = case == "caller's checkpoint"
    stock, model = tiny_chroma(), tiny_chroma()
    if ckpt:
        stock = checkpoint_blocks(stock, False, False if compiled else None)
        model = checkpoint_blocks(model, False, True if compiled else None)
    elif compiled:
        for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
            block.compile(fullgraph=True, backend="aot_eager")
    va.enable_varlen(model, strict=case == "strict")
    inputs = chroma_inputs()
    monkeypatch.setattr(transformer_flux, "dispatch_attention_fn", _regional(_torch_attention))
    want = step(stock, inputs)
    monkeypatch.setattr(transformer_flux, "dispatch_attention_fn", _regional(_va_attention))
    va.reset_stats()
    assert_model_close(step(model, inputs), want, what=case)
    assert not va.stats()["fallbacks"] or "outer product" not in str(va.stats()["fallbacks"]), va.stats()


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float64])
def test_compiled_blocks_leave_calls_to_stocks_cudnn_as_their_keys_mask_with_its_rows_scaled(monkeypatch, stock_cheaper, mask_dtype):
    """Where stock's kernel is cuDNN's attention (it fails on masks with rows) and stock costs less
    than packing, a compiled block's call runs in the op as attend_outer runs it eagerly: stock's
    SDPA on the keys' mask of the model's, the rows scaled, its check read once a forward; equal to
    the stock model, outputs and gradients (the recomputation's too), no mask with rows reaching
    SDPA. Before, the op packed every such call, the dearer route."""
    stock_cheaper("cudnn")
    seen = _masks_seen(monkeypatch)
    stock = tiny_chroma()
    ref = step(stock, chroma_inputs())
    enabled = _enabled_compiled(stock)
    for _ in range(2):  # the second step on the graphs the first traced
        va.reset_stats()
        seen.clear()
        assert_model_close(step(enabled, chroma_inputs(mask_dtype=mask_dtype)), ref,
                           what="keys' mask on stock")
        st_ = va.stats()
        assert st_["backends"] == {"sdpa": 2 * CHROMA_ATTN_LAYERS} and not st_["fallbacks"], st_
        assert st_["host_syncs"] == 1, st_
        assert all("key_padding mask, stock on cudnn" in r for r in st_["routes"]), st_
        assert seen and all(s is not None and s[-2] == 1 for s in seen), seen  # no rows reached SDPA


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_keys_route_in_the_graph_traces_once_and_redoes_a_failed_check_exactly(stock_cheaper, checkpointing):
    """The route above runs in the graph, not in the op (no call reaches the op's outer route): its
    check made there and read once a forward; the graphs traced once, also after this thread's
    stats were muted (by another model's op backward, say). A mask that is no outer
    product of its rows and keys is caught by that read and the forward run again exactly, its
    calls then read in the op (dynamo retraces for a forward with no checks); strict raises."""
    from test_outer import corrupt_one_block
    from torch._dynamo.utils import counters
    from varlen_attn import _stats
    from varlen_attn._errors import NotPackableError

    in_op = stock_cheaper("cudnn")

    def enabled_copy(stock, **options):
        torch._dynamo.reset()  # a graph traced for another model's blocks would serve this one's
        return _enabled_compiled(stock, checkpointing, **options)

    stock = tiny_chroma()
    enabled = enabled_copy(stock)
    for i in range(3):
        va.reset_stats()
        assert_model_close(step(enabled, chroma_inputs()), step(stock, chroma_inputs()), what="keys in the graph")
        st_ = va.stats()
        assert st_["host_syncs"] == 1 and not st_["fallbacks"] and not in_op, (st_, in_op)
        assert st_["backends"] == {"sdpa": CHROMA_ATTN_LAYERS * (2 if checkpointing else 1)}, st_
        if i == 0:
            traced = counters["stats"]["unique_graphs"]
            with _stats.quiet():  # as another model's op backward leaves this thread's stats
                pass
    assert counters["stats"]["unique_graphs"] == traced  # no graph traced after the first step

    corrupt_one_block(stock, every=True)
    enabled = enabled_copy(stock)
    for _ in range(2):
        va.reset_stats()
        assert_model_close(step(enabled, chroma_inputs()), step(stock, chroma_inputs()), what="no outer product")
        st_ = va.stats()
        assert any("not the outer product of the model's mask" in r for r in st_["fallbacks"]), st_
        assert in_op, st_  # the forward run again: its calls in the op, each read there
    with pytest.raises(NotPackableError, match="not the outer product of the model's mask"):
        step(enabled_copy(stock, strict=True), chroma_inputs())


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_blocks_with_symbolic_lengths_leave_calls_to_stock_as_they_came_in_the_op(monkeypatch, stock_cheaper):
    """Where stock's kernel takes rows and costs less than packing, but the graph cannot prove the
    call's lengths below the crossover (compiled with symbolic shapes), the op weighs the call at
    run time and sends it to stock's SDPA as it came: the mask with its rows, no check, no read,
    the route counted once a call; equal to the stock model, outputs and gradients."""
    stock_cheaper("efficient")
    seen = _masks_seen(monkeypatch)
    stock = tiny_chroma()
    ref = step(stock, chroma_inputs())
    enabled = _enabled_compiled(stock, dynamic=True)
    for _ in range(2):  # the second step on the graphs the first traced
        va.reset_stats()
        seen.clear()
        assert_model_close(step(enabled, chroma_inputs()), ref, what="as it came, in the op")
        st_ = va.stats()
        assert st_["backends"] == {"sdpa": 2 * CHROMA_ATTN_LAYERS} and not st_["fallbacks"], st_
        assert st_["host_syncs"] == 0 and st_["plan_builds"] == 0, st_
        assert sum(st_["routes"].values()) == 2 * CHROMA_ATTN_LAYERS, st_
        assert all("outer mask, stock on efficient" in r for r in st_["routes"]), st_
        assert seen and all(s is not None and s[-2] > 1 for s in seen), seen  # the rows reached SDPA


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float64])
@pytest.mark.parametrize("cheaper", ["stock", "packed"])
@pytest.mark.parametrize("checkpoint", ["traced into the block", "around the compiled block"])
def test_a_compiled_blocks_recomputation_takes_its_forwards_route_and_reads_nothing(cpu_costs, checkpoint, cheaper,
                                                                                   mask_dtype):
    """Compiled blocks the caller checkpoints, where stock's kernel is cuDNN's attention: the
    checkpoint traced into the graph (the block's forward wrapped, then compiled: its
    recomputation in the compiled backward, where no entry is on the thread) or around the
    compiled call (the recomputation's entry without the model's mask, UNREAD). Either way the
    recomputation takes its forward's route on the call's own rows, unread (one read a step, the
    forward's): stock's SDPA on the keys' mask, or packed on the outer product's plan, the
    pipeline's float 0/1 mask too; the step equals stock checkpointed the same way. Before, each
    recomputed call read its check or its plan (1 + one per block a step), and a float mask's
    packed where its forward left it to stock (H200, tests/test_gpu_models.py)."""
    cpu_costs("cudnn", stock_cheaper=cheaper == "stock")
    if checkpoint == "traced into the block":
        stock = checkpoint_blocks(tiny_chroma())
        enabled = va.enable_varlen(checkpoint_blocks(tiny_chroma()))
        for block in [*enabled.transformer_blocks, *enabled.single_transformer_blocks]:
            block.compile(fullgraph=True, backend="aot_eager")
    else:
        stock = checkpoint_blocks(tiny_chroma(), False, False)
        enabled = va.enable_varlen(checkpoint_blocks(tiny_chroma(), False, True))
    for i, lengths in enumerate([(5, 2, 0), (7, 1, 3)]):
        va.reset_stats()
        got = step(enabled, chroma_inputs(lengths, seed=i, mask_dtype=mask_dtype))
        assert_model_close(got, step(stock, chroma_inputs(lengths, seed=i)), what=f"{lengths}")
        st_ = va.stats()
        backend = "sdpa" if cheaper == "stock" else "split_sdpa"
        assert st_["backends"] == {backend: 2 * CHROMA_ATTN_LAYERS} and not st_["fallbacks"], st_
        assert st_["host_syncs"] == 1, st_
        if cheaper == "stock":
            assert st_["plan_builds"] == 0, st_
            assert all("key_padding mask, stock on cudnn" in r for r in st_["routes"]), st_
