"""Plan invariants, mask classification, build_plan's cache, and the host reads each call costs."""

import contextlib
import threading

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, note
from hypothesis import strategies as st

import varlen_attn as va
from _testing import (PACKABLE_KINDS, UNPACKABLE_KINDS, CountSyncs, cases, effective_keep, is_segment_pattern,
                      one_segment)

ALL_KINDS = PACKABLE_KINDS + UNPACKABLE_KINDS


def torch_plan(case):
    b, hq, sq, _ = case.q.shape
    return va.build_plan(case.mask, batch_size=b, seqlen_q=sq, seqlen_k=case.k.shape[2],
                         num_heads=hq, convention="torch")


@given(case=cases(kinds=ALL_KINDS))
def test_classification_matches_bruteforce_oracle(case):
    """packable <=> every head equal and query key-sets equal or disjoint (after shift invariance)."""
    note(repr(case))
    if case.mask is None:
        return
    plan = torch_plan(case)
    keep = effective_keep(case)
    if case.kind == "bias01":
        # A 0/1 float mask is a bias unless every row is constant (then shift invariance).
        rows_const = bool((case.mask == case.mask[..., :1]).all())
        assert plan.packable == rows_const
        return
    assert plan.packable == is_segment_pattern(keep), plan.reason


@given(case=cases(kinds=PACKABLE_KINDS))
def test_plan_invariants(case):
    """cu_seqlens are int32 prefix sums of the host lengths; indices are unique, in range, and
    reproduce the mask: query i and key j share a segment iff the mask keeps (i, j)."""
    note(repr(case))
    assume(case.mask is not None and is_segment_pattern(effective_keep(case)))
    p = torch_plan(case)
    assert p.packable
    b, sq, sk = p.batch_size, p.seqlen_q, p.seqlen_k
    for cu, lens, idx, total, mx, s in (
        (p.cu_seqlens_q, p.seqlens_q, p.indices_q, p.total_q, p.max_seqlen_q, sq),
        (p.cu_seqlens_k, p.seqlens_k, p.indices_k, p.total_k, p.max_seqlen_k, sk),
    ):
        assert cu.dtype == torch.int32 and idx.dtype == torch.int64
        assert cu.tolist() == [0] + torch.tensor(lens).cumsum(0).tolist()
        assert total == sum(lens) == idx.numel() and mx == max(lens, default=0)
        assert all(n > 0 for n in lens)
        assert idx.unique().numel() == idx.numel()
        assert idx.numel() == 0 or (0 <= idx.min().item() and idx.max().item() < b * s)
        # Within a segment tokens keep their order.
        for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
            assert (idx[lo:hi].diff() > 0).all()
    seg_q = torch.full((b * sq,), -1)
    seg_k = torch.full((b * sk,), -1)
    for s, (lo, hi, klo, khi) in enumerate(zip(p.cu_seqlens_q[:-1].tolist(), p.cu_seqlens_q[1:].tolist(),
                                               p.cu_seqlens_k[:-1].tolist(), p.cu_seqlens_k[1:].tolist())):
        seg_q[p.indices_q[lo:hi]] = s
        seg_k[p.indices_k[klo:khi]] = s
        assert (p.indices_q[lo:hi] // sq == p.segment_batch[s]).all()
    rebuilt = (seg_q.view(b, sq, 1) == seg_k.view(b, 1, sk)) & (seg_q.view(b, sq, 1) >= 0)
    assert torch.equal(rebuilt, effective_keep(case)[:, 0])


def test_additive_rows_follow_shift_invariance():
    # Row 0: keys 0,1 at 0 and key 2 at -10000 -> keys {0,1}; row 1: all -10000 -> all keys;
    # row 2: all -inf -> no key (zeros); row 3: shifted by a constant 5 -> same as row 0.
    m = torch.tensor([[0.0, 0.0, -1e4], [-1e4, -1e4, -1e4], [-float("inf")] * 3, [5.0, 5.0, -9995.0]])
    p = va.build_plan(m[None, None], convention="torch")
    assert not p.packable  # rows 0 and 1 overlap: different key sets sharing keys
    p = va.build_plan(m[None, None, [0, 2, 3]], convention="torch")
    assert p.packable and p.seqlens_q == (2,) and p.seqlens_k == (2,)
    assert p.indices_q.tolist() == [0, 2]


@pytest.mark.parametrize("value", [torch.finfo(torch.float64).min, torch.finfo(torch.float32).min, -1e9, -1e5])
def test_a_row_of_keys_under_a_swamping_negative_runs_on_masked_sdpa(value):
    """A batch element with no valid key, masked with ``finfo.min`` (the Hugging Face convention)
    or another value that swamps the scores: SDPA rounds ``score + value`` (a uniform row at
    ``finfo.min``), which no varlen kernel computes, so the call runs on masked SDPA with the
    reason recorded. ``-10000`` rows stay packed (``test_additive_rows_follow_shift_invariance``)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    keep = torch.arange(6)[None] < torch.tensor([6, 3, 0])[:, None]  # element 2: no valid key
    mask = torch.zeros(3, 6, dtype=torch.float64).masked_fill(~keep, value)[:, None, None, :]
    va.reset_stats()
    got = va.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=0, atol=1e-12)
    assert not va.build_plan(mask, convention="torch").packable
    assert va.stats()["backends"] == {"sdpa": 1} and any("large negative" in r for r in va.stats()["fallbacks"])


def test_float01_mask_is_a_bias():
    m = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    p = va.build_plan(m)
    assert not p.packable and "bias" in p.reason
    with pytest.raises(va.NotPackableError, match="bias"):
        va.build_plan(m, strict=True)


def test_diffusers_prepared_mask_layout():
    """[B*H, 1, Sk] from diffusers' prepare_attention_mask reads as [B, H, 1, Sk]."""
    keep = torch.tensor([[True, True, False], [True, False, True]])
    m = torch.zeros(2, 3).masked_fill(~keep, -10000.0).repeat_interleave(4, dim=0)[:, None]
    p = va.build_plan(m, batch_size=2, num_heads=4, seqlen_q=5)
    assert p.packable and p.seqlens_k == (2, 2) and p.indices_k.tolist() == [0, 1, 3, 5]
    with pytest.raises(va.InputValueError, match="ambiguous"):
        va.build_plan(m, num_heads=4)


def test_plan_from_seqlens_matches_mask_plan():
    lens = [3, 0, 5]
    mask = torch.arange(6)[None] < torch.tensor(lens)[:, None]
    a = va.plan_from_seqlens(lens, seqlen_q=6, seqlen_k=6)
    b = va.build_plan(mask[:, None, :, None] & mask[:, None, None, :])
    for f in ("seqlens_q", "seqlens_k", "segment_batch", "max_seqlen_q", "total_q"):
        assert getattr(a, f) == getattr(b, f), f
    assert torch.equal(a.indices_q, b.indices_q) and torch.equal(a.cu_seqlens_k, b.cu_seqlens_k)


def test_each_functional_call_builds_its_own_plan_and_build_plan_caches():
    """Functional calls plan from their own mask: the same boolean key-padding mask object in ten
    calls gives ten builds and no host read at all (a static plan on the device); a boolean
    outer-product mask runs as key padding, one build per call and one host read per call (its
    check, one ``.item()``); one written in place, no outer product any more, fails its check and
    is planned from the whole mask; the backward adds nothing. The explicit :func:`varlen_attn.build_plan` caches by mask object (one
    read per build, one per hit to confirm the values), and a prebuilt plan (``plan=``) costs no
    sync at all."""
    torch.manual_seed(0)
    b, h, s, d = 3, 2, 40, 16
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[0, 5:12] = False  # a gap in the middle of the row (joint text+image)
    keep[2, :] = False  # caption dropout: no valid key
    mask = keep[:, None, None, :]
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    va.reset_stats()
    with CountSyncs() as first:
        va.scaled_dot_product_attention(q, k, v, mask)
    assert va.stats()["plan_builds"] == 1 and va.stats()["host_syncs"] == 0
    assert first.ops == []
    with CountSyncs() as layers:
        for _ in range(10):  # ten "layers" handed the same mask object
            out = va.scaled_dot_product_attention(q, k, v, mask)
        out.sum().backward()
    assert layers.ops == []
    assert va.stats()["plan_builds"] == 11 and va.stats()["host_syncs"] == 0
    outer = mask & keep[:, None, :, None]  # [B, 1, S, S]: one read per call, its check's .item()
    va.reset_stats()
    with CountSyncs() as outer_calls:
        for _ in range(3):
            va.scaled_dot_product_attention(q, k, v, outer.clone())
    assert outer_calls.ops == ["_local_scalar_dense.default"] * 3
    # each call: its check read, then key padding on a plan built on the device
    assert va.stats()["plan_builds"] == 3 and va.stats()["host_syncs"] == 3
    outer[1, 0, 3, 3] = ~outer[1, 0, 3, 3]  # written in place: the same object, other values
    va.reset_stats()
    got = va.scaled_dot_product_attention(q, k, v, outer)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=outer), rtol=0, atol=1e-5)
    # its check (a read) fails, then built from the whole mask: read as a padding mask (a read),
    # which it no longer is, so the general plan (a read)
    assert va.stats()["plan_builds"] == 1 and va.stats()["host_syncs"] == 3
    va.reset_stats()
    plan = va.build_plan(keep)
    assert va.stats()["plan_builds"] == 1 and va.stats()["host_syncs"] == 1
    assert va.build_plan(keep) is plan
    assert va.stats()["plan_builds"] == 1 and va.stats()["host_syncs"] == 2
    va.reset_stats()
    with CountSyncs() as with_plan:
        for _ in range(10):
            va.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), plan=plan)
    assert with_plan.ops == [] and va.stats()["host_syncs"] == 0 and va.stats()["plan_builds"] == 0


@pytest.mark.parametrize("write", ["data", "numpy", "storage", "inference"])
def test_writes_the_version_counter_misses_never_give_a_stale_plan(write):
    """A mask edited without a version bump (``.data``, numpy, its storage, or an inference
    tensor) gets a new plan: the cache compares values, not only identity and version."""
    q = torch.randn(2, 2, 6, 8, dtype=torch.float64)
    ctx = torch.inference_mode() if write == "inference" else contextlib.nullcontext()
    with ctx:
        mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
        first = va.build_plan(mask)
        version = None if write == "inference" else mask._version
        if write == "data":
            mask.data[0, ..., 2:] = False
        elif write == "numpy":
            mask.numpy()[0, ..., 2:] = False
        elif write == "storage":
            view = torch.empty(0, dtype=torch.bool).set_(mask.untyped_storage()).view(2, 6)
            view.detach().numpy()[0, 2:] = False
        else:
            mask[0, ..., 2:] = False
        assert version is None or mask._version == version, "the write was meant to bypass the counter"
        va.reset_stats()
        plan = va.build_plan(mask)
        assert plan is not first and plan.seqlens_k == (2, 6) and va.stats()["plan_builds"] == 1
        assert va.build_plan(mask) is plan, "an unchanged mask keeps its plan"
        got = va.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        torch.testing.assert_close(got, F.scaled_dot_product_attention(q, q, q, attn_mask=mask),
                                   rtol=0, atol=1e-12)


def test_cache_sees_in_place_changes_and_new_objects():
    keep = torch.ones(2, 8, dtype=torch.bool)
    p1 = va.build_plan(keep)
    assert va.build_plan(keep) is p1
    keep[0, 3:] = False  # in place: version counter changes, plan must be rebuilt
    p2 = va.build_plan(keep)
    assert p2 is not p1 and p2.seqlens_k == (3, 8)
    assert va.build_plan(keep.clone()) is not p2  # equal values, another object: rebuilt


def test_cache_is_thread_safe():
    masks = [torch.rand(2, 16) > 0.3 for _ in range(8)]
    errors = []

    def work(m):
        try:
            for _ in range(20):
                p = va.build_plan(m)
                assert p.seqlens_k == tuple(n for n in m.sum(-1).tolist() if n)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(m,)) for m in masks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_explicit_env_backend(monkeypatch):
    q = k = v = torch.randn(1, 1, 4, 8)
    mask = torch.tensor([True, True, False, True])
    monkeypatch.setenv("VARLEN_ATTN_BACKEND", "reference")
    va.reset_stats()
    va.scaled_dot_product_attention(q, k, v, mask)
    assert va.stats()["backends"] == {"reference": 1}
    monkeypatch.setenv("VARLEN_ATTN_BACKEND", "nonsense")
    with pytest.raises(va.InputValueError, match="VARLEN_ATTN_BACKEND"):
        va.scaled_dot_product_attention(q, k, v, mask)


def test_clear_plan_cache_and_build_without_cache():
    keep = torch.arange(6)[None] < torch.tensor([2, 6])[:, None]
    va.reset_stats()
    first = va.build_plan(keep)
    assert va.build_plan(keep) is first and va.stats()["plan_builds"] == 1
    fresh = va.build_plan(keep, cache=False)
    assert fresh is not first and va.stats()["plan_builds"] == 2
    assert va.build_plan(keep) is first, "cache=False must leave the cache as it was"
    va.clear_plan_cache()
    assert va.build_plan(keep) is not first and va.stats()["plan_builds"] == 3


def test_a_copy_of_a_token_names_its_plan_while_the_plan_lives():
    """Saved-tensor hooks may hand the compiled backward a copy of a plan's token: the copy names
    the same plan (by value), each plan's token its own, and neither keeps the plan alive."""
    import gc

    from varlen_attn.plan import plan_of_token

    keep = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0]], dtype=torch.bool)
    plans = [va.build_plan(keep, cache=False), va.build_plan(~keep, cache=False)]
    copies = [p.token.clone() for p in plans]
    assert all(plan_of_token(c) is p for c, p in zip(copies, plans)) and plans[0] is not plans[1]
    assert plan_of_token(torch.zeros(1, dtype=torch.int64)) is None  # no plan has that number
    del plans
    gc.collect()
    assert all(plan_of_token(c) is None for c in copies)


def test_plan_copies_and_pickles_are_plans_of_their_own():
    """A plan is plain data: copy, deepcopy and pickle give an equal plan, whose token names the
    copy (the custom op finds a plan through its token)."""
    import copy
    import pickle

    from varlen_attn.plan import plan_of_token

    keep = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    plan = va.build_plan(keep)
    q, k, v = (torch.randn(3, 4, 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    want = va.attention(q, k, v, plan=plan)
    for other in (copy.copy(plan), copy.deepcopy(plan), pickle.loads(pickle.dumps(plan))):
        assert other is not plan and plan_of_token(other.token) is other
        assert plan_of_token(plan.token) is plan
        for name in ("seqlens_q", "seqlens_k", "segment_batch", "total_q", "max_seqlen_k", "packable"):
            assert getattr(other, name) == getattr(plan, name), name
        for name in ("cu_seqlens_q", "cu_seqlens_k", "indices_q", "indices_k", "inverse_q", "padding_k"):
            assert torch.equal(getattr(other, name), getattr(plan, name)), name
        assert torch.equal(va.attention(q, k, v, plan=other), want)


def _valid_grids():
    return st.integers(1, 5).flatmap(lambda b: st.integers(1, 9).flatmap(
        lambda s: st.lists(st.booleans(), min_size=b * s, max_size=b * s).map(
            lambda bits: torch.tensor(bits).view(b, s))))


@given(valid=_valid_grids())
def test_static_order_is_valid_rows_by_element_then_padding(valid):
    """A static plan's order (plan._static_side, counted rather than sorted): every valid position
    of element 0 in order, then element 1's, ..., then every padding position in order; the
    inverse inverts it and cu_seqlens counts each element's valid positions."""
    from varlen_attn.plan import _static_side

    b, s = valid.shape
    flat = valid.reshape(-1).tolist()
    want = [i for i in range(b * s) if flat[i]] + [i for i in range(b * s) if not flat[i]]
    order, inverse, cu = _static_side(valid)
    assert order.tolist() == want
    assert torch.equal(order[inverse], torch.arange(b * s))
    counts = valid.sum(1).tolist()
    assert cu.tolist() == [sum(counts[:i]) for i in range(b + 1)]


@given(case=cases(kinds=tuple(k for k in ALL_KINDS if k != "bias01")))
def test_padding_reading_matches_bruteforce_oracle(case):
    """masks.read_padding, the reading static plans are built from: a mask passes (no flag) iff
    every head is equal and each element's query rows that attend something attend the same keys
    (the brute-force oracle), and then its valid queries and keys are the rows and columns that
    keep anything. (Float 0/1 biases are the general reading's, tested above.)"""
    from varlen_attn.masks import PADDING_FLAG_NAMES, canonical_mask, read_padding

    note(repr(case))
    if case.mask is None:
        return
    b, hq, sq, _ = case.q.shape
    sk = case.k.shape[2]
    mask4 = canonical_mask(case.mask, batch_size=b, num_heads=hq, seqlen_q=sq, seqlen_k=sk, convention="torch")
    valid_q, valid_k, flags = read_padding(mask4, batch_size=b, seqlen_q=sq, seqlen_k=sk)
    flags = dict(zip(PADDING_FLAG_NAMES, flags.tolist()))
    keep = effective_keep(case)
    assert flags["nan"] == flags["posinf"] == flags["bias"] == 0, flags
    assert flags["per_head"] == int(not bool((keep == keep[:, :1]).all())), flags
    assert (sum(flags.values()) == 0) == one_segment(keep), flags
    if one_segment(keep):
        assert torch.equal(valid_q, keep[:, 0].any(dim=-1)) and torch.equal(valid_k, keep[:, 0].any(dim=-2))


def test_a_plan_kept_under_inference_mode_is_not_taken_by_a_training_call():
    """A validation pass under ``torch.inference_mode`` and then a training step with a mask of
    equal values: the training call builds its own plan (a kept plan's tensors made under
    inference mode cannot be saved for backward), and its output and gradients equal stock's."""
    torch.manual_seed(0)
    b, h, s, d = 3, 2, 12, 8
    keep = torch.arange(s)[None] < torch.tensor([12, 5, 0])[:, None]
    outer = keep[:, None, :, None] & keep[:, None, None, :]
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64) for _ in range(3))
    with torch.inference_mode():
        va.scaled_dot_product_attention(q, k, v, outer.clone())
    got = [t.clone().requires_grad_() for t in (q, k, v)]
    want = [t.clone().requires_grad_() for t in (q, k, v)]
    va.reset_stats()
    va.scaled_dot_product_attention(*got, outer.clone()).sum().backward()
    F.scaled_dot_product_attention(*want, attn_mask=outer).sum().backward()
    assert va.stats()["plan_builds"] == 1, va.stats()
    for a, w in zip(got, want):
        torch.testing.assert_close(a.grad, w.grad, rtol=0, atol=1e-12)


def test_masks_taking_turns_each_keep_their_plan_in_the_one_cache():
    """Masks of one shape that take turns (a conditional and an unconditional batch) each keep
    their plan: after the first call of each, every call reads once (its comparison) and builds
    nothing, on the attention path and in build_plan (there by object) alike; a fifth mask of
    that shape pushes out the least recently used."""
    b, h, s, d = 2, 2, 8, 4
    q = torch.randn(b, h, s, d, dtype=torch.float64)

    def outer(lengths):
        keep = torch.arange(s)[None] < torch.tensor(lengths)[:, None]
        return torch.where(keep[:, None, :, None] & keep[:, None, None, :], 0.0, float("-inf")).double()

    masks = [outer(lengths) for lengths in ([8, 3], [5, 8], [2, 2], [7, 1], [4, 6])]
    for m in masks[:2]:
        va.scaled_dot_product_attention(q, q, q, m)
    va.reset_stats()
    for i in range(6):
        m = masks[i % 2].clone()  # a new tensor of the same values every call
        got = va.scaled_dot_product_attention(q, q, q, m)
        torch.testing.assert_close(got, F.scaled_dot_product_attention(q, q, q, attn_mask=m), rtol=0, atol=1e-12)
    assert va.stats()["plan_builds"] == 0 and va.stats()["host_syncs"] == 6, va.stats()
    keeps = [m[:, 0, 0] == 0 for m in masks]
    plans = [va.build_plan(k) for k in keeps[:2]]
    va.reset_stats()
    assert all(va.build_plan(k) is p for k, p in zip(keeps[:2] * 2, plans * 2))
    assert va.stats()["plan_builds"] == 0 and va.stats()["host_syncs"] == 4, va.stats()
    for m in masks[2:]:  # three more of that shape, five in all: four are kept, masks[0] goes,
        va.scaled_dot_product_attention(q, q, q, m)  # used less recently than masks[1]
    va.reset_stats()
    va.scaled_dot_product_attention(q, q, q, masks[1])
    va.scaled_dot_product_attention(q, q, q, masks[0])
    assert va.stats()["plan_builds"] == 1, va.stats()


def test_a_mask_collected_while_the_plan_cache_is_locked_leaves_it():
    """A build_plan mask freed by a garbage-collection pass that runs while the cache's lock is
    held (any allocation inside it can start one) drops its entry there and then, in the same
    thread, instead of waiting forever for the lock."""
    import gc

    from varlen_attn.plan import _PLANS

    holder = {"mask": torch.tensor([[True, True, False], [True, False, False]])}
    holder["self"] = holder  # the mask is freed by the cycle collector only
    va.build_plan(holder["mask"])
    assert len(_PLANS._entries) == 1
    del holder
    done = threading.Event()

    def collect_under_the_lock():
        with _PLANS._lock:
            gc.collect()
        done.set()

    threading.Thread(target=collect_under_the_lock, daemon=True).start()
    assert done.wait(10), "the cache's lock was taken again by the same thread and never released"
    assert _PLANS._entries == []


def test_the_kept_copy_of_a_mask_expanded_over_heads_holds_one_head():
    """A mask expanded over heads (stride 0) is kept as one head's copy, and a later mask with
    those values in every head takes its plan, while one that differs in any head does not."""
    from varlen_attn.plan import _PLANS

    b, h, s, d = 2, 4, 10, 8
    keep = torch.arange(s)[None] < torch.tensor([10, 4])[:, None]
    base = torch.where(keep[:, None, :, None] & keep[:, None, None, :], 0.0, float("-inf")).double()
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64) for _ in range(3))
    va.clear_plan_cache()
    va.scaled_dot_product_attention(q, k, v, base.expand(b, h, s, s))
    (_, snapshot, _, _), = _PLANS._entries
    assert snapshot.shape == (b, 1, s, s)
    va.reset_stats()
    dense = base.expand(b, h, s, s).clone()
    va.scaled_dot_product_attention(q, k, v, dense)
    assert va.stats()["plan_builds"] == 0, va.stats()
    dense[1, 3, 0, 0] = float("-inf")  # one head differs: not the kept mask (not a padding mask either)
    got = va.scaled_dot_product_attention(q, k, v, dense)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=dense), rtol=0, atol=1e-12)
    assert va.stats()["plan_builds"] == 1, va.stats()
