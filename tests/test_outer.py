"""A boolean mask with rows runs as the key-padding call it is when it is an outer product
(``execution.attend_outer``): checked on the device, read in the call, or once per forward of a
model in ``model.OUTER_MASKS`` (Chroma), whose failed check runs the forward again exactly, or
raises under strict. CPU, float64, against masked SDPA."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import varlen_attn as va
from varlen_attn import NotPackableError, masks
from varlen_attn.execution import UNREAD, Deferred
from varlen_attn.functional import sdpa_with_policy
from varlen_attn.policy import Policy

from _models import CHROMA_ATTN_LAYERS, chroma_inputs, step, tiny_chroma
from _testing import assert_model_close, checkpoint_blocks


@st.composite
def masks_with_rows(draw):
    """``[B, 1, Sq, Sk]`` bool: an outer product of drawn query and key masks (empty rows and
    empty elements included), sometimes with one bit flipped, or random bits."""
    b, sq, sk = draw(st.integers(1, 3)), draw(st.integers(2, 9)), draw(st.integers(1, 9))
    kind = draw(st.sampled_from(["outer", "flipped", "random"]))
    if kind == "random":
        bits = draw(st.lists(st.booleans(), min_size=b * sq * sk, max_size=b * sq * sk))
        return torch.tensor(bits).view(b, 1, sq, sk)
    rows = torch.tensor(draw(st.lists(st.booleans(), min_size=b * sq, max_size=b * sq))).view(b, sq)
    cols = torch.tensor(draw(st.lists(st.booleans(), min_size=b * sk, max_size=b * sk))).view(b, sk)
    mask = (rows[:, :, None] & cols[:, None, :])[:, None].clone()
    if kind == "flipped":
        i, j, e = draw(st.integers(0, sq - 1)), draw(st.integers(0, sk - 1)), draw(st.integers(0, b - 1))
        mask[e, 0, i, j] = ~mask[e, 0, i, j]
    return mask


def is_outer(mask: torch.Tensor) -> bool:
    """Brute-force oracle: every element's mask is the product of its row and column supports."""
    rows, cols = mask[:, 0].any(2), mask[:, 0].any(1)
    return all(torch.equal(mask[e, 0], rows[e][:, None] & cols[e][None, :]) for e in range(mask.shape[0]))


@settings(max_examples=200, deadline=None)
@given(masks_with_rows())
def test_outer_factors_flag_exactly_the_masks_that_are_no_outer_product(mask):
    keep_q, keep_k, bad = masks.outer_factors(mask)
    assert bool(bad) == (not is_outer(mask))
    assert torch.equal(keep_q, mask[:, 0].any(2))
    # The keys some query attends; all keys of an element none of whose queries attends one.
    empty = ~mask[:, 0].any((1, 2))
    assert torch.equal(keep_k, mask[:, 0].any(1) | empty[:, None])


def inputs(mask, d=8, h=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, _, sq, sk = mask.shape
    q = torch.randn(b, h, sq, d, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, h, sk, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    return q, k, v


def out_and_grads(fn, q, k, v):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    (out * w).nan_to_num(0.0).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


@settings(max_examples=120, deadline=None)
@given(masks_with_rows(), st.sampled_from(["read", "deferred", "unread"]))
def test_a_mask_with_rows_equals_masked_sdpa_or_is_loud(mask, mode):
    """Read in the call, any mask gives masked SDPA's results. Deferred (a model's forward), an
    outer product gives them and a mask that is none sets the flag the forward's one read finds;
    not read (a recomputation), such a mask makes the whole output NaN."""
    q, k, v = inputs(mask)
    checks = {"read": None, "deferred": Deferred(None, []), "unread": UNREAD}[mode]
    policy = Policy("auto", model=True)
    va.reset_stats()
    got = out_and_grads(lambda q, k, v: sdpa_with_policy(q, k, v, mask, policy=policy, checks=checks), q, k, v)
    ref = out_and_grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), q, k, v)
    outer = is_outer(mask)
    if mode == "deferred":
        assert len(checks.flags) == 1 and bool(checks.flags[0]) == (not outer)
    syncs = va.stats()["host_syncs"]  # the check, read in the call; a failed one's own plan reads more
    assert (syncs == 1 if outer else syncs > 1) if mode == "read" else syncs == 0, (mode, outer, syncs)
    if outer or mode == "read":
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    elif mode == "unread":
        assert got[0].isnan().all(), "a failed check that is not read must not leave a finite result"


def corrupt_one_block(model, every: bool = False):
    """A pre-hook on the model's first attention module (``every``: on each) that gives every
    query key 0 (as HunyuanVideo's token refiner does): its mask has rows and is no outer
    product."""
    for attn in [m for m in model.modules() if hasattr(m, "processor")][: None if every else 1]:
        _corrupt(attn)
    return model


def _corrupt(attn):

    def pre(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is not None:
            mask = mask.clone()
            mask[..., 0] = True
            kwargs = {**kwargs, "attention_mask": mask}
        return args, kwargs

    attn.register_forward_pre_hook(pre, with_kwargs=True)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_chroma_reads_its_checks_once_per_forward_and_redoes_a_failed_one_exactly(checkpointing, compiled):
    """Eager, or every block compiled (its calls run in the custom op, on the same checks)."""
    batch = chroma_inputs()
    calls = CHROMA_ATTN_LAYERS * (2 if checkpointing else 1)

    def enabled_copy(stock, **options):
        # Dynamo does not guard on a compiled block's submodules' hooks: a graph traced for another
        # model's blocks would serve this one's.
        torch._dynamo.reset()
        model = va.enable_varlen(copy.deepcopy(stock), **options)
        if checkpointing:
            model.enable_gradient_checkpointing()
        for block in [*model.transformer_blocks, *model.single_transformer_blocks] if compiled else ():
            block.compile(fullgraph=True, backend="aot_eager")
        return model

    stock = tiny_chroma()
    enabled = enabled_copy(stock)
    va.reset_stats()
    assert_model_close(step(enabled, batch), step(stock, batch), what="outer products")
    st_ = va.stats()
    assert st_["host_syncs"] == 1 and not st_["fallbacks"], st_  # one read for the forward's checks
    assert sum(st_["backends"].values()) == calls, st_

    # Compiled, every block: a hook on one block's submodule alone is lost from the second step on
    # in stock's compiled blocks too (torch 2.13), for the same reason.
    corrupt_one_block(stock, every=compiled)
    enabled = enabled_copy(stock)
    va.reset_stats()
    assert_model_close(step(enabled, batch), step(stock, batch), what="one mask no outer product")
    st_ = va.stats()
    assert any("not the outer product of the model's mask" in r for r in st_["fallbacks"]), st_
    # The forward's read, then each call of the forward run again checked in the call (the
    # recomputation too: its forward was run again).
    assert st_["host_syncs"] > 1 + calls, st_
    with pytest.raises(NotPackableError, match="not the outer product of the model's mask"):
        step(enabled_copy(stock, strict=True), batch)


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_a_call_checked_against_the_models_mask_runs_with_its_factors_or_flags_it(data):
    """Inside a Chroma forward each call's mask is compared on the device with the outer product
    of the model's own [B, S] mask (execution.Deferred): equal, the call runs with that mask's
    factors and equals masked SDPA; any other mask (an outer product of other factors included)
    raises the flag the forward's one read finds, and the forward is run again."""
    b, s = data.draw(st.integers(1, 3)), data.draw(st.integers(2, 9))
    keep = torch.tensor(data.draw(st.lists(st.booleans(), min_size=b * s, max_size=b * s))).view(b, s)
    mask = (keep[:, None, :, None] & keep[:, None, None, :]).clone()
    if data.draw(st.booleans()):
        e, i, j = data.draw(st.integers(0, b - 1)), data.draw(st.integers(0, s - 1)), data.draw(st.integers(0, s - 1))
        mask[e, 0, i, j] = ~mask[e, 0, i, j]
    q, k, v = inputs(mask)
    checks = Deferred(keep, [])
    va.reset_stats()
    got = out_and_grads(lambda q, k, v: sdpa_with_policy(q, k, v, mask, policy=Policy("auto", model=True),
                                                          checks=checks), q, k, v)
    equal = torch.equal(mask, keep[:, None, :, None] & keep[:, None, None, :])
    assert len(checks.flags) == 1 and bool(checks.flags[0]) == (not equal) and va.stats()["host_syncs"] == 0
    if equal:
        ref = out_and_grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), q, k, v)
        for a, b_ in zip(got, ref):
            torch.testing.assert_close(a, b_, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float64])
@pytest.mark.parametrize("kernel", ["cudnn", "cpu"])
def test_chroma_calls_left_to_stock_see_rows_only_where_stock_takes_them(monkeypatch, cpu_costs, kernel, mask_dtype):
    """Where stock costs less than packing: if stock's kernel cannot take the outer product itself
    (cuDNN's attention), the hook hands stock the model's keys' mask and scales the rows, its check
    kept for the forward's one read; where it can, a boolean call goes to stock as it came: no
    check, no read, the mask with its rows. ChromaPipeline's float 0/1 mask, read as boolean, is
    checked against the model's mask: on cuDNN it takes the keys' mask, elsewhere stock gets the
    boolean outer product of the model's mask in its place (as it came, stock would read a bias)."""
    from varlen_attn import hook

    cpu_costs(kernel)
    seen = []
    batch = chroma_inputs()
    stock = tiny_chroma()
    ref = step(stock, batch)
    enabled = va.enable_varlen(copy.deepcopy(stock))
    enabled.enable_gradient_checkpointing()
    # Spied once installed: the first install in a process writes what it replaced into the list.
    replaced = hook._replaced[0]

    def spy(*a, **kw):
        seen.append((tuple(kw["attn_mask"].shape), kw["attn_mask"].dtype))
        return replaced(*a, **kw)

    monkeypatch.setattr(hook, "_replaced", [spy])
    va.reset_stats()
    seen.clear()
    assert_model_close(step(enabled, chroma_inputs(mask_dtype=mask_dtype)), ref,
                       what=f"stock, its kernel {kernel}")
    st_ = va.stats()
    as_keys = kernel == "cudnn"
    assert st_["backends"] == {"sdpa": 2 * CHROMA_ATTN_LAYERS}, st_
    assert st_["host_syncs"] == (1 if as_keys or mask_dtype != torch.bool else 0), st_
    assert len(seen) == 2 * CHROMA_ATTN_LAYERS, seen
    assert all((s[-2] == 1) == as_keys and d == torch.bool for s, d in seen), seen


@pytest.mark.parametrize("cheaper", ["stock", "packed"])
@pytest.mark.parametrize("kernel", ["cudnn", "efficient"])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float64])
@pytest.mark.parametrize("checkpointing", ["diffusers, restore_checkpoint_mask=False", "caller", "caller, reentrant"])
def test_chroma_recomputed_without_its_models_mask_takes_its_forwards_route(cpu_costs, checkpointing, mask_dtype,
                                                                            kernel, cheaper):
    """A Chroma forward runs its calls on the model's mask's factors: where stock costs less, on
    cuDNN's attention as the keys' mask with the rows scaled (a kernel that takes rows: a float 0/1
    mask as the model's boolean outer product), else packed on the outer product's plan. A
    recomputation in backward that has no model mask (blocks the caller checkpoints, OneTrainer's
    way, or diffusers' checkpointing with ``restore_checkpoint_mask=False``) takes the same route
    on the call's own rows: torch's checkpoint finds the tensors the forward saved, and the step
    equals stock checkpointed the same way. Before, the recomputation of a call on cuDNN's
    attention, or of a float mask, took another route, which saves other tensors (a rows factor
    of another layout; a float mask's own plan): CheckpointError (non-reentrant) in backward, or
    (reentrant) a host read and another kernel for each call."""
    cpu_costs(kernel, stock_cheaper=cheaper == "stock")
    if checkpointing.startswith("caller"):
        reentrant = checkpointing.endswith("reentrant")
        stock = checkpoint_blocks(tiny_chroma(), reentrant)
        enabled = va.enable_varlen(checkpoint_blocks(tiny_chroma(), reentrant))
    else:
        stock = tiny_chroma()
        stock.enable_gradient_checkpointing()
        enabled = va.enable_varlen(copy.deepcopy(stock), restore_checkpoint_mask=False)
    calls = 2 * (CHROMA_ATTN_LAYERS if checkpointing.startswith("caller") else 2)  # diffusers: 2 double blocks masked
    for i, lengths in enumerate([(5, 2, 0), (7, 1, 3)]):
        va.reset_stats()
        got = step(enabled, chroma_inputs(lengths, seed=i, mask_dtype=mask_dtype))
        assert_model_close(got, step(stock, chroma_inputs(lengths, seed=i)), what=f"{checkpointing} {lengths}")
        st_ = va.stats()
        assert st_["backends"] == {"sdpa" if cheaper == "stock" else "split_sdpa": calls}, st_
        assert not st_["fallbacks"], st_
        if cheaper == "packed":  # one plan for the forward, one for each recomputed call
            assert st_["host_syncs"] == 1 and st_["plan_builds"] == 1 + calls // 2, st_
            continue
        checked = kernel == "cudnn" or mask_dtype != torch.bool  # else stock takes the mask as it came
        layout = "key_padding" if kernel == "cudnn" else "outer"
        assert all(f"{layout} mask, stock on {kernel}" in r for r in st_["routes"]), st_
        assert st_["host_syncs"] == checked and st_["plan_builds"] == 0, st_  # the forward's checks only


def test_chroma_with_the_pipelines_float_mask_reads_once_per_forward():
    """ChromaPipeline passes a float 0/1 mask (read as keep/drop, float_mask="bool"): its values
    are checked on the device with the forward's other checks, and each block's float outer
    product runs with its factors, one read a step, equal to the model given the bool mask. A
    float mask of other values fails that check: the forward runs again and reads it as stock
    does (an additive bias)."""
    stock = tiny_chroma()
    enabled = va.enable_varlen(copy.deepcopy(stock))
    enabled.enable_gradient_checkpointing()
    ref = step(stock, chroma_inputs())  # the bool mask
    va.reset_stats()
    assert_model_close(step(enabled, chroma_inputs(mask_dtype=torch.float64)), ref, what="float 0/1")
    st_ = va.stats()
    assert st_["host_syncs"] == 1 and not st_["fallbacks"], st_
    assert sum(st_["backends"].values()) == 2 * CHROMA_ATTN_LAYERS, st_

    biased = chroma_inputs(mask_dtype=torch.float64)
    biased["attention_mask"] = biased["attention_mask"] * 0.5  # 0 / 0.5: a bias, not a keep-mask
    ref = step(stock, biased)
    va.reset_stats()
    assert_model_close(step(enabled, biased), ref, what="float bias")
    assert any("not the outer product of the model's mask" in r for r in va.stats()["fallbacks"]), va.stats()


def corrupt_when(model, when):
    """As :func:`corrupt_one_block`, for the masks ``when`` selects only."""
    attn = next(m for m in model.modules() if hasattr(m, "processor"))

    def pre(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is not None and when(mask):
            mask = mask.clone()
            mask[..., 0] = True
            kwargs = {**kwargs, "attention_mask": mask}
        return args, kwargs

    attn.register_forward_pre_hook(pre, with_kwargs=True)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_forward_run_again_recomputes_with_each_call_read_whatever_ran_between(reentrant):
    """A forward whose check failed runs again; its checkpointed blocks' recomputation then reads
    each call's check, also where another forward of the model (a no-grad sampling step) ran
    before the backward."""
    import functools

    from _models import loss

    stock = tiny_chroma()
    enabled = va.enable_varlen(copy.deepcopy(stock))
    enabled.enable_gradient_checkpointing(gradient_checkpointing_func=functools.partial(
        torch.utils.checkpoint.checkpoint, use_reentrant=reentrant))
    for m in (stock, enabled):
        corrupt_when(m, lambda mask: mask.shape[0] == 2)  # the first forward's masks only
    first = {k: (v[:2] if isinstance(v, torch.Tensor) and k not in ("img_ids", "txt_ids") else v)
             for k, v in chroma_inputs().items()}

    def run(m):
        m.zero_grad(set_to_none=True)
        out = m(**first)[0]
        with torch.no_grad():
            m(**chroma_inputs())
        loss(out).backward()
        return out.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}

    assert_model_close(run(enabled), run(stock), what="run again, then another forward")


def test_a_forward_hook_of_the_users_sees_the_output_of_a_forward_run_again():
    stock = tiny_chroma()
    stock.register_forward_hook(lambda mod, args, out: (out[0] * 2,) + tuple(out[1:]))
    enabled = va.enable_varlen(copy.deepcopy(stock))
    batch = chroma_inputs(mask_dtype=torch.float64)
    batch["attention_mask"] = batch["attention_mask"] * 0.5  # not 0/1: the forward runs again
    va.reset_stats()
    assert_model_close(step(enabled, batch), step(stock, batch), what="user hook after a rerun")
    assert va.stats()["fallbacks"], va.stats()
