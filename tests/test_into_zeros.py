"""FA4's writes into zeros (``Backend.INTO_ZEROS``) and the outer-product plan (``plan.outer_plan``),
against masked SDPA in float64 on the CPU, with FA4 emulated by ``test_backends.fake_fa4_interface``
(fixture ``fake_flash``): it writes only the rows it computes into the buffers it is handed, skips
queries past ``seqused_q``, and leaves NaN in any row it neither computes nor was handed a buffer
for. Every path that hands it buffers is covered: the eager fused route (key padding, outer
products, general padding plans, several segments), the compiled custom op, the static op of
the CUDA-graph path, the in-graph route, and an enabled Chroma (its forward's outer plan,
``execution.Deferred.plan``), with batch elements whose queries attend nothing (dead elements)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _testing import assert_matches, assert_model_close, static_attention
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from test_backends import fake_flash  # noqa: F401  (the fixture, wrapped as fa4 below)

import varlen_attn as va
from varlen_attn import kernels
from varlen_attn.execution import UNREAD, Deferred
from varlen_attn.functional import sdpa_with_policy
from varlen_attn.policy import Policy

F64 = torch.float64
FA4 = "flash_attn_4"
FIXTURE = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


@pytest.fixture
def fa4(fake_flash):  # noqa: F811
    """``test_backends.fake_flash``: FA4 emulated on the CPU; its calls recorded in ``fa4[FA4].calls``."""
    return fake_flash


# ---------------------------------------------------------------------------------------- masks

def _bits(draw, shape, dead_rows=True):
    """``[B, n]`` bool drawn bit by bit; with ``dead_rows`` some rows are forced all False."""
    b, n = shape
    rows = torch.tensor(draw(st.lists(st.booleans(), min_size=b * n, max_size=b * n))).view(b, n)
    if dead_rows:
        dead = torch.tensor(draw(st.lists(st.booleans(), min_size=b, max_size=b)))
        rows = rows & ~dead[:, None]
    return rows


MASK_KINDS = ("key_padding", "outer", "outer_cross", "outer_2d", "heads", "float_outer", "segments",
              "all_masked")


@st.composite
def fa4_cases(draw, kinds=MASK_KINDS, causal=None):
    """``(q, k, v [B, H, S, D] float64, mask in SDPA's convention, keep [B, 1|H, Sq, Sk] bool, gqa,
    causal, kind)``: a mask kind FA4's fused route runs, with dead elements drawn often."""
    kind = draw(st.sampled_from(kinds))
    b = draw(st.integers(1, 3))
    sk = draw(st.integers(1, 10))
    sq = draw(st.integers(1, 10)) if kind in ("key_padding", "outer_cross", "outer_2d") else sk
    if kind == "outer_2d":
        sq = max(sq, 2)  # a mask with rows
    hkv = draw(st.integers(1, 2))
    gqa = draw(st.booleans())
    hq = hkv * (draw(st.integers(2, 3)) if gqa else 1)
    d = draw(st.sampled_from([32, 40, 64]))
    is_causal = draw(st.booleans()) if causal is None else causal
    is_causal = is_causal and sq == sk and kind in ("outer", "heads", "float_outer", "all_masked")
    if kind == "key_padding":
        keep = _bits(draw, (b, sk))[:, None, None, :].expand(b, 1, sq, sk)
        mask = keep[:, :, :1]
    elif kind in ("outer", "heads", "float_outer"):
        m = _bits(draw, (b, sk))
        keep = m[:, None, :, None] & m[:, None, None, :]
        mask = keep.expand(b, hq, sq, sk).contiguous() if kind == "heads" else keep
    elif kind == "outer_cross":
        keep = _bits(draw, (b, sq))[:, None, :, None] & _bits(draw, (b, sk))[:, None, None, :]
        mask = keep
    elif kind == "outer_2d":  # one [Sq, Sk] mask for every element
        keep = (_bits(draw, (1, sq), False)[0][:, None] & _bits(draw, (1, sk), False)[0][None, :])
        mask, keep = keep, keep.expand(b, 1, sq, sk)
    elif kind == "segments":  # several segments per element: the plan with host lengths
        ids = torch.tensor(draw(st.lists(st.integers(-1, 2), min_size=b * sk, max_size=b * sk))).view(b, sk)
        ids[torch.tensor(draw(st.lists(st.booleans(), min_size=b, max_size=b)))] = -1  # dead elements
        keep = ((ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0))[:, None]
        mask = keep
    else:  # all_masked
        keep = torch.zeros(b, 1, sq, sk, dtype=torch.bool)
        mask = keep if draw(st.booleans()) else keep[:, :, :1]
    if kind == "float_outer":
        mask = torch.zeros(mask.shape, dtype=F64).masked_fill(~mask, float("-inf"))
    dv = d
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g, dtype=F64)
    k = torch.randn(b, hkv, sk, d, generator=g, dtype=F64)
    v = torch.randn(b, hkv, sk, dv, generator=g, dtype=F64)
    w = torch.randn(b, hq, sq, dv, generator=g, dtype=F64)
    return Case(q=q, k=k, v=v, w=w, mask=mask, keep=keep, gqa=gqa, causal=is_causal, kind=kind)


class Case(dict):
    """A drawn case; hypothesis reports it by shapes, not tensor dumps."""

    def __repr__(self):
        shapes = {n: tuple(t.shape) for n, t in self.items() if isinstance(t, torch.Tensor)}
        rest = {n: x for n, x in self.items() if not isinstance(x, torch.Tensor)}
        keep = self["keep"]
        return f"Case({shapes}, {rest}, keep={keep.flatten(2).any(-1).any(1).int().tolist()})"

    _repr_pretty_ = lambda self, p, cycle: p.text(repr(self))


def _grads(fn, case, q=None, k=None, v=None, w=None):
    """``[out, dq, dk, dv]`` of ``fn(q, k, v)`` under the loss ``sum(out * w)``."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (case["q"] if q is None else q,
                                                             case["k"] if k is None else k,
                                                             case["v"] if v is None else v))
    out = fn(q, k, v)
    ((case["w"] if w is None else w) * out).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def _sdpa(case):
    """Masked SDPA on the case's boolean meaning (causal: top-left, the mask's & tril)."""
    keep = case["keep"]
    if case["causal"]:
        sq, sk = keep.shape[-2:]
        keep = keep & torch.ones(sq, sk, dtype=torch.bool).tril()
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=case["gqa"])


def _ours(case, backend=FA4):
    return lambda q, k, v: va.scaled_dot_product_attention(q, k, v, case["mask"], is_causal=case["causal"],
                                                           enable_gqa=case["gqa"], backend=backend)


def _dead(case) -> torch.Tensor:
    """``[B]``: the elements none of whose queries attends a key (causal doesn't change that for
    self-aligned masks: each valid query attends itself)."""
    return ~case["keep"].flatten(1).any(1)


def _check(got, ref):
    assert_matches(got, ref, ref, F64)


# ------------------------------------------------------------------------ (a) the eager fused route

@settings(max_examples=150, deadline=None, suppress_health_check=FIXTURE)
@given(case=fa4_cases())
def test_fa4_fused_route_equals_masked_sdpa_with_dead_elements(fa4, case):
    """Every mask kind FA4 packs: outputs and gradients equal masked SDPA's, the kernel runs once
    forward and once backward, each handed zero buffers to write into (the rows it skips, dead
    elements and padding, stay the zeros SDPA gives), and ``seqused_q`` goes with any static plan
    that holds a dead element."""
    note(f"kind={case['kind']} q={tuple(case['q'].shape)} k={tuple(case['k'].shape)} gqa={case['gqa']} "
         f"causal={case['causal']} dead={_dead(case).tolist()}")
    ref = _grads(_sdpa(case), case)
    before = len(fa4[FA4].calls)
    got = _grads(_ours(case), case)
    _check(got, ref)
    calls = fa4[FA4].calls[before:]
    if not case["keep"].any() and calls == []:
        return  # a plan with host lengths and no segment (every query masked): nothing for a kernel
    assert [(c["entry"], c.get("out", c.get("grads"))) for c in calls] == [("fwd", True), ("bwd", True)], calls
    if _dead(case).any() and case["kind"] != "segments" and not case["causal"]:  # static plans
        assert all(c["seqused_q"] for c in calls), calls


@settings(max_examples=40, deadline=None, suppress_health_check=FIXTURE)
@given(case=fa4_cases(kinds=("key_padding", "outer", "outer_cross", "float_outer")), dv=st.sampled_from([32, 48]))
def test_fa4_zero_buffers_take_the_value_head_dim(fa4, case, dv):
    """FA4 declares no value head dim other than the query's (an explicit call refuses it clearly);
    where a kernel takes one, the zero output buffer is ``[total_q, Hq, Dv]`` and the results equal
    masked SDPA's."""
    g = torch.Generator().manual_seed(7)
    case = Case(case, v=torch.randn(*case["v"].shape[:-1], dv, generator=g, dtype=F64),
                w=torch.randn(*case["w"].shape[:-1], dv, generator=g, dtype=F64))
    if dv != case["q"].shape[-1]:
        with pytest.raises(va.BackendUnavailableError, match="head dim|v dim|value"):
            _grads(_ours(case), case)
    with pytest.MonkeyPatch.context() as m:  # per example: hypothesis runs them all in one test
        m.setattr(kernels.BACKENDS[FA4], "SUPPORTS_DIFFERENT_V_DIM", True)
        va.execution._selected.clear()  # selections are cached by what they read of a call
        before = len(fa4[FA4].calls)
        _check(_grads(_ours(case), case), _grads(_sdpa(case), case))
        calls = [c["entry"] for c in fa4[FA4].calls[before:]]
    va.execution._selected.clear()
    assert calls == ["fwd", "bwd"] or (calls == [] and not case["keep"].any()), calls


def test_fa4_skips_a_dead_element_whose_rows_would_otherwise_be_computed(fa4, monkeypatch):
    """A dead element keeps one full segment (no kernel sees an empty one): were its queries not
    skipped, the kernel would attend every key there. Its rows and its keys' gradients must be
    exactly zero, key padding and outer products alike, and the live elements untouched."""
    g = torch.Generator().manual_seed(3)
    b, h, s, d = 3, 2, 6, 32
    keep = torch.tensor([[1, 0, 1, 1, 0, 1], [0] * 6, [1] * 6], dtype=torch.bool)
    for mask in (keep[:, None, None, :], keep[:, None, :, None] & keep[:, None, None, :]):
        case = Case(q=torch.randn(b, h, s, d, generator=g, dtype=F64), k=torch.randn(b, h, s, d, generator=g, dtype=F64),
                    v=torch.randn(b, h, s, d, generator=g, dtype=F64), w=torch.randn(b, h, s, d, generator=g, dtype=F64),
                    mask=mask, keep=mask.expand(b, 1, s, s), gqa=False, causal=False)
        got = _grads(_ours(case), case)
        _check(got, _grads(_sdpa(case), case))
        for t in got:
            assert torch.equal(t[1], torch.zeros_like(t[1]))


def test_an_explicit_fa4_refuses_causal_key_padding_clearly(fa4):
    """Causal key padding is not self-aligned: an explicit FA4 refuses it (never a silent
    fallback), and auto runs it on masked SDPA, equal to it."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 5, 32, generator=g, dtype=F64) for _ in range(3))
    keep = torch.tensor([[1, 1, 0, 1, 1], [0] * 5], dtype=torch.bool)[:, None, None, :]
    with pytest.raises(va.BackendUnavailableError):
        va.scaled_dot_product_attention(q, k, v, keep, is_causal=True, backend=FA4)
    tri = torch.ones(5, 5, dtype=torch.bool).tril()
    torch.testing.assert_close(va.scaled_dot_product_attention(q, k, v, keep, is_causal=True),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=keep & tri), rtol=0, atol=1e-12)


# ------------------------------------------------------------ (a) the functional route with checks

@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURE)
@given(data=st.data())
def test_fa4_on_the_plan_of_a_models_mask_equals_masked_sdpa_or_poisons(fa4, data):
    """Inside an enabled model's forward (``Deferred``: the model's ``[B, S]`` mask, dead elements
    included) a call whose mask is that mask's outer product runs on its plan, equal to masked
    SDPA; any other mask raises the forward's flag, and in a recomputation (not read) makes the
    output NaN. With the recomputation's own factors (``UNREAD``), an outer product equals SDPA."""
    b, s = data.draw(st.integers(1, 3)), data.draw(st.integers(2, 8))
    keep = _bits(data.draw, (b, s))
    mask = (keep[:, None, :, None] & keep[:, None, None, :]).clone()
    flipped = data.draw(st.booleans())
    if flipped:
        e, i, j = data.draw(st.integers(0, b - 1)), data.draw(st.integers(0, s - 1)), data.draw(st.integers(0, s - 1))
        mask[e, 0, i, j] = ~mask[e, 0, i, j]
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    case = Case(q=torch.randn(b, 2, s, 32, generator=g, dtype=F64), k=torch.randn(b, 2, s, 32, generator=g, dtype=F64),
                v=torch.randn(b, 2, s, 32, generator=g, dtype=F64), w=torch.randn(b, 2, s, 32, generator=g, dtype=F64),
                mask=mask, keep=mask, gqa=False, causal=False)
    policy = Policy(FA4, model=True)
    ref = _grads(_sdpa(case), case)
    for mode in ("deferred", "forward_unread", "own_unread"):
        checks = {"deferred": Deferred(keep, []), "forward_unread": Deferred(keep, []).unread(),
                  "own_unread": UNREAD}[mode]
        va.reset_stats()
        got = _grads(lambda q, k, v, c=checks: sdpa_with_policy(q, k, v, mask, policy=policy, checks=c), case)
        assert va.stats()["host_syncs"] == 0 and va.stats()["backends"] == {FA4: 1}, (mode, va.stats())
        if mode == "deferred":
            assert len(checks.flags) == 1 and bool(checks.flags[0]) == flipped
        poisoned = flipped and (mode == "forward_unread" or (mode == "own_unread" and masks_bad(mask)))
        if poisoned:
            assert got[0].isnan().all(), "a failed check not read must make the whole output NaN"
        elif not flipped or mode == "own_unread":
            _check(got, ref)


def masks_bad(mask) -> bool:
    """Brute force: ``mask`` is no outer product of its rows' and columns' supports."""
    rows, cols = mask[:, 0].any(2), mask[:, 0].any(1)
    return not torch.equal(mask[:, 0], rows[:, :, None] & cols[:, None, :])


# ------------------------------------------------------------------------ (a) the compiled custom op

COMPILED_KINDS = {
    # kind: (B, Hq, Hkv, Sq, Sk, D, causal)
    "key_padding": (3, 2, 2, 7, 9, 32, False),
    "outer": (3, 4, 2, 8, 8, 32, False),
    "outer_cross": (2, 2, 1, 6, 9, 40, False),
    "heads": (3, 2, 2, 7, 7, 32, True),
    "float_outer": (3, 2, 2, 7, 7, 32, False),
    "segments": (2, 2, 2, 8, 8, 32, False),
    "all_masked": (2, 2, 2, 6, 6, 32, False),
}


@st.composite
def compiled_case(draw, kind):
    """A case of ``kind`` at the fixed shapes of :data:`COMPILED_KINDS`: only the bits change,
    so the compiled function never recompiles."""
    b, hq, hkv, sq, sk, d, causal = COMPILED_KINDS[kind]
    if kind == "key_padding":
        keep = _bits(draw, (b, sk))[:, None, None, :]
        mask = keep
    elif kind == "outer_cross":
        keep = _bits(draw, (b, sq))[:, None, :, None] & _bits(draw, (b, sk))[:, None, None, :]
        mask = keep
    elif kind == "segments":
        ids = torch.tensor(draw(st.lists(st.integers(-1, 2), min_size=b * sk, max_size=b * sk))).view(b, sk)
        keep = ((ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0))[:, None]
        mask = keep
    elif kind == "all_masked":  # the whole batch: every element dead
        keep = mask = torch.zeros(b, 1, sq, sk, dtype=torch.bool)
    else:
        m = _bits(draw, (b, sk))
        keep = m[:, None, :, None] & m[:, None, None, :]
        mask = keep.expand(b, hq, sq, sk).contiguous() if kind == "heads" else keep
        if kind == "float_outer":
            mask = torch.zeros(mask.shape, dtype=F64).masked_fill(~mask, float("-inf"))
    g = torch.Generator().manual_seed(draw(st.integers(0, 1000)))
    return Case(q=torch.randn(b, hq, sq, d, generator=g, dtype=F64), k=torch.randn(b, hkv, sk, d, generator=g, dtype=F64),
                v=torch.randn(b, hkv, sk, d, generator=g, dtype=F64), w=torch.randn(b, hq, sq, d, generator=g, dtype=F64),
                mask=mask, keep=keep.expand(b, 1 if keep.shape[1] == 1 else hq, sq, sk), gqa=hq != hkv,
                causal=causal, kind=kind)


@pytest.mark.parametrize("kind", sorted(COMPILED_KINDS))
def test_fa4_in_the_compiled_op_equals_masked_sdpa(fa4, fresh_dynamo, kind):
    """torch.compile (aot_eager) of a function calling the drop-in with FA4: the custom op runs
    the fused route on its plan and the kernel's own backward, both handed zeros, for masks with
    dead elements; equal to masked SDPA, one compiled frame for every mask."""
    import torch._dynamo.testing as dynamo_testing

    cnt = dynamo_testing.CompileCounterWithBackend("aot_eager")
    _, hq, hkv, _, _, _, causal = COMPILED_KINDS[kind]
    compiled = torch.compile(lambda q, k, v, m: va.scaled_dot_product_attention(
        q, k, v, m, is_causal=causal, enable_gqa=hq != hkv, backend=FA4), fullgraph=True, backend=cnt)

    @settings(max_examples=12, deadline=None, suppress_health_check=FIXTURE, database=None)
    @given(case=compiled_case(kind))
    def check(case):
        note(f"dead={_dead(case).tolist()}")
        before = len(fa4[FA4].calls)
        got = _grads(lambda q, k, v: compiled(q, k, v, case["mask"]), case)
        _check(got, _grads(_sdpa(case), case))
        calls = fa4[FA4].calls[before:]
        assert [(c["entry"], c.get("out", c.get("grads"))) for c in calls] == [("fwd", True), ("bwd", True)], calls

    check()
    assert cnt.frame_count == 1


# ------------------------------------------------------------ (b) the static op (CUDA graphs' path)

@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURE)
@given(case=fa4_cases(kinds=("key_padding", "outer", "outer_cross", "heads", "float_outer", "all_masked"),
                      causal=False))
def test_fa4_in_the_static_op_equals_masked_sdpa(fa4, case):
    """The op CUDA graphs capture (a plan built from the mask with no host read, empty segments
    for elements with nothing valid) with FA4: handed zeros, equal to masked SDPA, forward and
    backward, and its lse zero past the valid rows."""
    note(f"kind={case['kind']} dead={_dead(case).tolist()}")
    t = lambda x: x.transpose(1, 2)
    lses = []

    def ours(q, k, v):
        out, lse = static_attention(t(q), t(k), t(v), case["mask"], backend=FA4, gqa=case["gqa"])
        lses.append(lse)
        return t(out)

    before = len(fa4[FA4].calls)
    _check(_grads(ours, case), _grads(_sdpa(case), case))
    calls = fa4[FA4].calls[before:]
    assert [(c["entry"], c.get("out", c.get("grads"))) for c in calls] == [("fwd", True), ("bwd", True)], calls
    assert not lses[0].isnan().any()


# --------------------------------------------------------------------- (a) the in-graph route

def test_fa4_in_the_graph_equals_stock_with_a_dead_element(fa4, fresh_dynamo, monkeypatch):
    """Compiled blocks of an enabled model with a key-padding mask run FA4 in the graph (its
    kernel op, handed no buffers: NaN in the rows it leaves), an element with no key included;
    the outer-product block takes the custom op. Both equal stock, with checkpointing too."""
    from test_in_graph import LENGTHS, _mask, _Model, _out_and_grads, _x

    monkeypatch.setattr(kernels.BACKENDS[FA4], "MIN_HEAD_DIM", 8)  # the blocks' heads: 8 wide; emulated exactly
    for checkpointing in (False, True):
        kinds = ["keys", "padding"]
        stock = _Model(kinds, checkpointing)
        model = va.enable_varlen(_Model(kinds, checkpointing), backend=FA4)
        for block in model.blocks:
            block.compile(fullgraph=True, backend="aot_eager")
        for i, (lengths, image) in enumerate(LENGTHS):
            got = _out_and_grads(model, _x(i), _mask(lengths, image))
            assert_model_close(got, _out_and_grads(stock, _x(i), _mask(lengths, image)), what=f"{lengths} {image}")


# ------------------------------------------------------------------------- (c), (d) enabled Chroma

@pytest.fixture
def fa4_at_head_dim_16(fa4, monkeypatch):
    """The tiny Chroma's heads are 16 wide, under FA4's declared floor (wrong dq measured on an
    H200 at 16): the emulation computes exactly there, so the floor is lowered for these tests."""
    monkeypatch.setattr(kernels.BACKENDS[FA4], "MIN_HEAD_DIM", 16)
    return fa4


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("lengths", [(5, 2, 0), (7, 0, 0)])
def test_chroma_on_fa4_equals_stock(fa4_at_head_dim_16, checkpointing, lengths):
    """An enabled Chroma on FA4 (its forward's outer plan: padded text queries packed away, never
    computed), with an element whose text keeps nothing, with and without diffusers' gradient
    checkpointing: equal to stock; one plan and one host read a step, every call on FA4, each
    handed zero buffers."""
    from _models import CHROMA_ATTN_LAYERS, chroma_inputs, step, tiny_chroma

    stock = tiny_chroma()
    enabled = va.enable_varlen(copy.deepcopy(stock), backend=FA4)
    if checkpointing:  # stock unchecked: its checkpointed single blocks drop the mask (varlen_attn restores it)
        enabled.enable_gradient_checkpointing()
    batch = chroma_inputs(lengths)
    ref = step(stock, batch)
    va.reset_stats()
    before = len(fa4_at_head_dim_16[FA4].calls)
    assert_model_close(step(enabled, batch), ref, what=f"FA4 {lengths}")
    stats = va.stats()
    calls = CHROMA_ATTN_LAYERS * (2 if checkpointing else 1)
    assert stats["backends"] == {FA4: calls} and not stats["fallbacks"], stats
    assert stats["plan_builds"] == 1 and stats["host_syncs"] == 1, stats
    seen = fa4_at_head_dim_16[FA4].calls[before:]
    assert len(seen) == calls + CHROMA_ATTN_LAYERS and all(c.get("out", c.get("grads")) for c in seen), seen


@pytest.mark.parametrize("checkpointing", [False, True])
def test_chroma_on_fa4_with_an_element_that_keeps_nothing_equals_stock(fa4_at_head_dim_16, checkpointing):
    """A mask row all False (text and image): that element is dead in the forward's plan, its
    queries skipped by FA4 (``seqused_q``); stock's rows there are zeros. Equal to stock."""
    from _models import chroma_inputs, step, tiny_chroma

    stock = tiny_chroma()
    enabled = va.enable_varlen(copy.deepcopy(stock), backend=FA4)
    if checkpointing:  # stock unchecked: its checkpointed single blocks drop the mask (varlen_attn restores it)
        enabled.enable_gradient_checkpointing()
    batch = chroma_inputs((5, 2, 0))
    batch["attention_mask"] = batch["attention_mask"].clone()
    batch["attention_mask"][2] = False
    ref = step(stock, batch)
    before = len(fa4_at_head_dim_16[FA4].calls)
    assert_model_close(step(enabled, batch), ref, what="a dead element")
    assert all(c["seqused_q"] for c in fa4_at_head_dim_16[FA4].calls[before:])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_chroma_plans_each_forward_from_its_own_mask(fa4_at_head_dim_16, checkpointing):
    """The plan a forward builds (``Deferred.plan``) serves that forward and its recomputation
    only: two forwards with different masks, then one backward through both (each checkpointed
    block recomputed after the second forward ran), equal stock; one plan per forward. Then a
    third forward with the first mask builds a plan of its own."""
    from _models import chroma_inputs, loss, tiny_chroma

    stock = tiny_chroma()
    enabled = va.enable_varlen(copy.deepcopy(stock), backend=FA4)
    if checkpointing:  # stock unchecked: its checkpointed single blocks drop the mask (varlen_attn restores it)
        enabled.enable_gradient_checkpointing()
    first, second = chroma_inputs((5, 2, 0), seed=1), chroma_inputs((1, 7, 3), seed=2)

    def two_forwards(model):
        model.zero_grad(set_to_none=True)
        a = model(**first)[0]
        b = model(**second)[0]
        (loss(a) + 2 * loss(b)).backward()
        return {"out a": a.detach(), "out b": b.detach(),
                **{f"grad {n}": p.grad for n, p in model.named_parameters() if p.grad is not None}}

    ref = two_forwards(stock)
    va.reset_stats()
    assert_model_close(two_forwards(enabled), ref, what="two forwards, one backward")
    stats = va.stats()
    assert stats["plan_builds"] == 2 and stats["host_syncs"] == 2 and not stats["fallbacks"], stats

    from _models import step

    va.reset_stats()
    assert_model_close(step(enabled, first), step(stock, first), what="the first mask again")
    assert va.stats()["plan_builds"] == 1, va.stats()


def test_a_models_deferred_plan_is_its_own_masks():
    """``Deferred.plan`` is built once per Deferred (the forward's calls and its recomputation
    share it) from that Deferred's mask: another forward's Deferred, of another mask, gets
    another plan with that mask's segments."""
    from varlen_attn.plan import outer_plan

    a = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0]], dtype=torch.bool)
    b = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    da, db = Deferred(a, []), Deferred(b, [])
    va.reset_stats()
    pa, pb = da.plan(), db.plan()
    assert da.plan() is pa and da.unread().plan() is pa and pb is not pa
    assert va.stats()["plan_builds"] == 2
    for p, keep in ((pa, a), (pb, b)):
        want = outer_plan(keep, keep)
        for name in ("cu_seqlens_q", "cu_seqlens_k", "indices_q", "indices_k", "dead"):
            assert torch.equal(getattr(p, name), getattr(want, name)), name


@pytest.mark.parametrize("mask_dtype", [torch.bool, F64])
def test_chroma_on_fa4_with_compiled_blocks_or_a_float_mask_equals_stock(fa4_at_head_dim_16, fresh_dynamo, mask_dtype):
    """Blocks compiled (aot_eager): each outer product takes the custom op, FA4 fused in it; the
    pipeline's float 0/1 mask read as boolean in the eager forward's plan. Both equal stock
    given the boolean mask, with checkpointing (the recomputation on the forward's plan)."""
    from _models import chroma_inputs, step, tiny_chroma

    stock = tiny_chroma()
    ref = step(stock, chroma_inputs((5, 2, 0)))
    enabled = va.enable_varlen(copy.deepcopy(stock), backend=FA4, float_mask="bool")
    enabled.enable_gradient_checkpointing()
    assert_model_close(step(enabled, chroma_inputs((5, 2, 0), mask_dtype=mask_dtype)), ref, what="eager")
    if mask_dtype is torch.bool:
        for block in [*enabled.transformer_blocks, *enabled.single_transformer_blocks]:
            block.compile(fullgraph=True, backend="aot_eager")
        for lengths in ((5, 2, 0), (0, 7, 1)):
            va.reset_stats()
            assert_model_close(step(enabled, chroma_inputs(lengths)), step(stock, chroma_inputs(lengths)),
                               what=f"compiled blocks {lengths}")
            assert set(va.stats()["backends"]) == {FA4}, va.stats()


# ------------------------------------------------- what FA4 leaves in the rows it skips: its lse

@pytest.fixture
def stale_lse(fa4, monkeypatch):
    """FA4 allocates its lse with ``torch.empty`` and writes only the rows it computes: the rows of
    skipped queries (past ``seqused_q``) and past the last segment hold what the allocator left
    (on an H200 a freed NaN buffer comes back: tests/test_gpu.py). Emulated: NaN there."""
    import sys

    iface = sys.modules["flash_attn.cute.interface"]
    forward = iface._flash_attn_fwd

    def fwd(q, k, v, *, cu_seqlens_q, seqused_q=None, lse=None, **kw):
        res = forward(q, k, v, cu_seqlens_q=cu_seqlens_q, seqused_q=seqused_q, lse=lse, **kw)
        if lse is not None:  # a buffer handed in keeps its zeros where FA4 writes nothing
            return res
        rows = torch.arange(q.shape[0])
        seg = (torch.searchsorted(cu_seqlens_q[1:].long(), rows, right=True)).clamp(max=len(cu_seqlens_q) - 2)
        used = rows < int(cu_seqlens_q[-1])
        if seqused_q is not None:
            used &= rows - cu_seqlens_q[:-1].long()[seg] < seqused_q.long()[seg]
        return (res[0], res[1].masked_fill(~used, float("nan")), *res[2:])

    monkeypatch.setattr(iface, "_flash_attn_fwd", fwd)
    return fa4


@pytest.mark.parametrize("route", ["eager", "compiled", "static"])
@pytest.mark.parametrize("kind", ["key_padding", "outer", "float_outer"])
def test_fa4s_stale_lse_reaches_no_result(stale_lse, fresh_dynamo, route, kind):
    """Whatever FA4 leaves in the lse rows it skips reaches no output or gradient, on every route
    that hands it buffers (the backward reads lse only for the rows it computes)."""
    b, hq, hkv, s, d = 3, 2, 1, 7, 32
    keep = torch.tensor([[1, 1, 0, 1, 0, 0, 1], [0] * 7, [0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    mask = keep[:, None, None, :] if kind == "key_padding" else keep[:, None, :, None] & keep[:, None, None, :]
    keep4 = mask.expand(b, 1, s, s)
    if kind == "float_outer":
        mask = torch.zeros(mask.shape, dtype=F64).masked_fill(~mask, float("-inf"))
    g = torch.Generator().manual_seed(11)
    case = Case(q=torch.randn(b, hq, s, d, generator=g, dtype=F64), k=torch.randn(b, hkv, s, d, generator=g, dtype=F64),
                v=torch.randn(b, hkv, s, d, generator=g, dtype=F64), w=torch.randn(b, hq, s, d, generator=g, dtype=F64),
                mask=mask, keep=keep4, gqa=True, causal=False, kind=kind)
    t = lambda x: x.transpose(1, 2)
    if route == "eager":
        ours = _ours(case)
    elif route == "compiled":
        ours = torch.compile(_ours(case), fullgraph=True, backend="aot_eager")
    else:
        ours = lambda q, k, v: t(static_attention(t(q), t(k), t(v), mask, backend=FA4, gqa=True)[0])
    before = len(stale_lse[FA4].calls)
    _check(_grads(ours, case), _grads(_sdpa(case), case))
    assert [c["entry"] for c in stale_lse[FA4].calls[before:]] == ["fwd", "bwd"]


@pytest.mark.parametrize("kind", ["key_padding", "outer"])
def test_the_compiled_ops_lse_output_holds_no_stale_rows_on_fa4(stale_lse, kind):
    """varlen_attn.op.attention_op's lse output (saved for its backward) holds the kernel's values
    in the rows it computed and zeros elsewhere (``_op_forward``: "an op's outputs must not
    depend on what the allocator left"; the static op zeroes the rows past the last segment).
    With FA4 on a plan with a dead element (skipped by ``seqused_q``) or padded queries (packed
    past the last segment), the rows it skips keep the zeros of the lse buffer it is handed."""
    b, h, s, d = 3, 2, 7, 32
    keep = torch.tensor([[1, 1, 0, 1, 0, 0, 1], [0] * 7, [1] * 7], dtype=torch.bool)
    mask = keep[:, None, None, :] if kind == "key_padding" else keep[:, None, :, None] & keep[:, None, None, :]
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(b, s, h, d, generator=g, dtype=F64) for _ in range(3))
    lse = va.op.attention_op(q, k, v, mask, None, None, False, False, FA4, False, "torch", "bias", False, False)[1]
    assert not lse.isnan().any(), lse


# ------------------------------------------------------------ auto: FA4 first, and when it refuses

@pytest.mark.parametrize("refuses", [False, True])
@pytest.mark.parametrize("checks", ["call", "model"])
def test_auto_runs_an_outer_plan_on_fa4_or_on_the_next_backend_when_fa4_refuses(fa4, monkeypatch, refuses,
                                                                                checks):
    """auto with FA4 first (as on Hopper): an outer product with a dead element runs on its outer
    plan on FA4, handed zeros; where FA4 refuses the call, the same plan runs on the next backend
    (split_sdpa: no zeros handed, the padded queries and the dead element zeroed by unpacking),
    equal to masked SDPA either way."""
    monkeypatch.setitem(kernels.PRIORITY, "cpu", (FA4, *kernels.PRIORITY["cpu"]))
    if refuses:
        iface = __import__("sys").modules["flash_attn.cute.interface"]
        monkeypatch.setattr(iface, "_flash_attn_fwd", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("no")))
    b, s, d = 3, 7, 32
    keep = torch.tensor([[1, 1, 0, 1, 0, 0, 1], [0] * 7, [0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    mask = keep[:, None, :, None] & keep[:, None, None, :]
    g = torch.Generator().manual_seed(4)
    case = Case(q=torch.randn(b, 2, s, d, generator=g, dtype=F64), k=torch.randn(b, 2, s, d, generator=g, dtype=F64),
                v=torch.randn(b, 2, s, d, generator=g, dtype=F64), w=torch.randn(b, 2, s, d, generator=g, dtype=F64),
                mask=mask, keep=mask, gqa=False, causal=False)
    deferred = Deferred(keep, []) if checks == "model" else None
    va.reset_stats()
    got = _grads(lambda q, k, v: sdpa_with_policy(q, k, v, mask, policy=Policy("auto", model=True), checks=deferred),
                 case)
    _check(got, _grads(_sdpa(case), case))
    assert va.stats()["backends"] == {("split_sdpa" if refuses else FA4): 1}, va.stats()
    assert va.stats()["plan_builds"] == 1, va.stats()
