"""The ``flex`` backend's own parts on the CPU: segment ids and the block mask made from a plan.

FlexAttention has no backward on the CPU, so here its forward (the eager implementation) is
compared with masked SDPA in float64; outputs and gradients of the compiled kernel are compared
on a GPU (``tests/test_gpu.py`` runs every CUDA backend)."""

import warnings

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import varlen_attn as va
from _testing import assert_matches, cases, effective_keep, is_segment_pattern, sdpa_fn
from varlen_attn.kernels import flex

pytest.importorskip("torch.nn.attention.flex_attention")


def plan_of(case):
    return va.build_plan(case.mask, batch_size=case.q.shape[0], num_heads=case.q.shape[1],
                         seqlen_q=case.q.shape[2], seqlen_k=case.k.shape[2], convention="torch")


def packable(case) -> bool:
    keep = effective_keep(case)
    return keep is not None and is_segment_pattern(keep)


@given(case=cases(max_s=300))
def test_flex_forward_equals_sdpa_float64(case):
    note(repr(case))
    if not packable(case):
        return
    plan = plan_of(case)
    q, k, v = (t.transpose(1, 2) for t in (case.q, case.k, case.v))
    with warnings.catch_warnings():  # the eager kernel warns that it is slow, once
        warnings.simplefilter("ignore", UserWarning)
        out = flex.flex_padded(q, k, v, plan, q.shape[-1] ** -0.5, compiled=False).transpose(1, 2)
    ref = sdpa_fn(case, torch.float64, exact=True)(case.q, case.k, case.v)
    baseline = sdpa_fn(case, torch.float64)(case.q, case.k, case.v)
    assert_matches([out], [ref], [baseline], torch.float64, names=("out",))


@given(case=cases(max_s=300))
def test_segment_ids_say_which_positions_attend_each_other(case):
    """Two padded positions share a segment id exactly where the mask lets the query see the
    key; the id is -1 exactly where a query sees no key, or no query sees the key."""
    note(repr(case))
    if not packable(case):
        return
    plan = plan_of(case)
    keep = effective_keep(case)[:, 0]  # [B, Sq, Sk], equal in every head for a packable mask
    seg_q, seg_k = flex.segment_ids(plan, "q"), flex.segment_ids(plan, "k")
    same = (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_q[:, :, None] >= 0)
    assert torch.equal(same, keep)
    assert torch.equal(seg_q < 0, ~keep.any(2))
    assert torch.equal(seg_k < 0, ~keep.any(1))


def dense(num, idx):
    """A BlockMask table (counts ``[B, 1, n]``, ordered indices ``[B, 1, n, m]``) as a dense
    ``[B, n, m]`` boolean."""
    b, _, n, m = idx.shape
    take = torch.arange(m)[None, None] < num[:, 0, :, None]  # the first num entries of each row count
    hits = torch.zeros(b, n, m, dtype=torch.int64).scatter_add_(2, idx[:, 0].long(), take.long())
    return hits > 0


@given(b=st.integers(1, 3), sq=st.integers(1, 600), sk=st.integers(1, 600), nseg=st.integers(1, 5),
       seed=st.integers(0, 2**31 - 1), runs=st.booleans())
def test_block_mask_skips_only_empty_blocks_and_calls_full_only_full_ones(b, sq, sk, nseg, seed, runs):
    g = torch.Generator().manual_seed(seed)
    if runs:  # segments as runs of positions, as padding makes them
        seg_q = torch.randint(-1, nseg, (b, -(-sq // 50)), generator=g).repeat_interleave(50, 1)[:, :sq]
        seg_k = torch.randint(-1, nseg, (b, -(-sk // 70)), generator=g).repeat_interleave(70, 1)[:, :sk]
    else:
        seg_q, seg_k = torch.randint(-1, nseg, (b, sq), generator=g), torch.randint(-1, nseg, (b, sk), generator=g)
    bm = flex.block_mask_of(seg_q, seg_k)
    partial, full = dense(bm.kv_num_blocks, bm.kv_indices), dense(bm.full_kv_num_blocks, bm.full_kv_indices)
    n = flex.BLOCK
    nq, nk = -(-sq // n), -(-sk // n)
    pq = torch.nn.functional.pad(seg_q, (0, nq * n - sq), value=-1)
    pk = torch.nn.functional.pad(seg_k, (0, nk * n - sk), value=-2)  # padding never matches
    keep = (pq[:, :, None] == pk[:, None, :]) & (pq[:, :, None] >= 0)
    blocks = keep.view(b, nq, n, nk, n)
    anywhere, everywhere = blocks.any(4).any(2), blocks.all(4).all(2)
    q_partial, q_full = dense(bm.q_num_blocks, bm.q_indices), dense(bm.full_q_num_blocks, bm.full_q_indices)
    assert torch.equal(q_partial, partial.transpose(1, 2)) and torch.equal(q_full, full.transpose(1, 2))
    assert not (partial & full).any()
    assert torch.equal(anywhere & ~(partial | full), torch.zeros_like(anywhere))  # no needed block skipped
    assert torch.equal(full & ~everywhere, torch.zeros_like(full))  # full only where every pair attends


def test_flex_runs_on_cuda_only():
    """FlexAttention has no backward on the CPU: the backend declares CUDA, and an explicit
    request on the CPU says so."""
    q = k = v = torch.randn(1, 1, 4, 16)
    with pytest.raises(va.BackendUnavailableError, match=r"backend 'flex' cannot run .*device cpu not in \['cuda'\]"):
        va.scaled_dot_product_attention(q, k, v, torch.tensor([True, False, True, True]), backend="flex")
    assert "flex" not in va.available_backends("cpu")


@torch.library.custom_op("varlen_attn_tests::flex_block_count", mutates_args=())
def _block_count(seg: torch.Tensor) -> torch.Tensor:
    bm = flex.block_mask_of(seg, seg)
    return bm.kv_num_blocks + bm.full_kv_num_blocks


@_block_count.register_fake
def _(seg):
    return seg.new_empty((seg.shape[0], 1, -(-seg.shape[1] // flex.BLOCK)), dtype=torch.int32)


def test_block_mask_is_made_inside_a_compiled_graph():
    """Under torch.compile the backend runs inside varlen_attn's custom op, called from the
    compiled graph: BlockMask.from_kv_blocks' vmap failed there ("Cannot access storage of
    BatchedTensorImpl", first seen on an H100 with compiled blocks); the tables are made
    without it."""
    seg = torch.tensor([[0] * 200 + [-1] * 56, [1] * 256])
    counts = torch.compile(lambda s: _block_count(s), backend="aot_eager", fullgraph=True)(seg)
    assert torch.equal(counts, torch.tensor([[[2, 2]], [[2, 2]]], dtype=torch.int32))


def test_flex_declines_inside_a_compiled_graph():
    """Inside a running compiled graph (varlen_attn's custom op) dynamo compiles nothing and
    FlexAttention's eager path fails: the backend says so, so an explicit request raises with
    the reason and auto takes the next backend."""
    q = k = v = torch.randn(1, 4, 1, 16)
    keep = torch.tensor([[True, False, True, True]])
    compiled = torch.compile(lambda q, k, v: va.attention(q, k, v, keep, backend="flex"), backend="aot_eager",
                             fullgraph=True)
    with pytest.raises(va.BackendUnavailableError, match="called from a torch.compile graph"):
        compiled(q, k, v)
    with pytest.raises(va.BackendUnavailableError) as eager:
        va.attention(q, k, v, keep, backend="flex")
    assert "torch.compile graph" not in str(eager.value)


def _padded_inputs(b=2, s=200, h=2, d=16, seed=0):
    """Padded ``[B, S, H, D]`` q, k, v and the plan of a key-padding mask (the last quarter of
    the first row padding)."""
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[0, 3 * s // 4:] = False
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=g) for _ in range(3))
    return q, k, v, va.build_plan(keep, num_heads=h)


def test_compiled_flex_refuses_to_run_eagerly():
    """Where dynamo runs compiled code eagerly (here a stance; past its recompile limit likewise),
    the compiled path raises instead of running FlexAttention's dense eager form."""
    q, k, v, plan = _padded_inputs()
    with torch.compiler.set_stance("force_eager"):
        with pytest.raises(va.BackendUnavailableError,
                           match=r"backend 'flex' cannot run this call \(dtype torch.float32, batch 2, 200 queries / "
                                 r"200 keys, 2 query / 2 key heads, head dim 16 .*FlexAttention did not compile "
                                 r"\(.*force_eager.*Run it where torch.compile compiles .*raise "
                                 r"torch._dynamo.config.recompile_limit .*or pick another backend"):
            flex.flex_padded(q, k, v, plan, 0.25)


def test_call_classes_compile_apart():
    """Each call class (dtype, head dims, heads, device, scale, grad, shapes) gets its own compiled
    function with its own code object, so dynamo's recompile limit counts per class; one class
    gets the same function every time."""
    q, k, v = (t.transpose(1, 2) for t in _padded_inputs()[:3])
    key = flex._call_class(q, k, v, 0.25, False)
    others = [flex._call_class(q.double(), k.double(), v.double(), 0.25, False),
              flex._call_class(q, k, v, 0.5, False),
              flex._call_class(q.detach().requires_grad_(), k, v, 0.25, False),
              flex._call_class(q, k[:, :, :100], v[:, :, :100], 0.25, False)]  # another key length
    assert len({key, *others}) == 5
    fns = [flex._compiled(c) for c in (key, *others)]
    codes = {fn._torchdynamo_orig_callable.__code__ for fn in fns}
    assert len(codes) == 5 and flex._compiled_flex_attention.__code__ not in codes
    assert flex._compiled(key) is fns[0]


def _double(x):
    return x * 2


def test_own_code_gives_a_copy_its_own_recompile_limit():
    """The mechanism behind the call classes: dynamo keeps graphs and counts recompiles per code
    object. With a limit of one graph, a copy past its limit runs eagerly (dynamo compiles
    nothing more) while the other copy still compiles."""
    from torch._dynamo.testing import CompileCounter

    count_a, count_b = CompileCounter(), CompileCounter()
    a = torch.compile(flex._own_code(_double, "double_a"), backend=count_a)
    b = torch.compile(flex._own_code(_double, "double_b"), backend=count_b)
    assert a._torchdynamo_orig_callable.__code__.co_name == "double_a"
    with torch._dynamo.config.patch(recompile_limit=1):
        assert torch.equal(a(torch.ones(2)), torch.full((2,), 2.0))
        assert torch.equal(a(torch.ones(2, dtype=torch.float64)), torch.full((2,), 2.0, dtype=torch.float64))
        assert count_a.frame_count == 1  # the second dtype ran eagerly: a's limit reached
        b(torch.ones(2, dtype=torch.float64))
        assert count_b.frame_count == 1  # b compiled all the same


def test_compiled_flex_equals_eager_and_refuses_past_the_recompile_limit(fresh_dynamo):
    """FlexAttention compiled by inductor on the CPU (forward; 16 s on 2 cores with a cold inductor
    cache) equals its eager form; a call that would compile it once more past dynamo's recompile
    limit raises."""
    flex._forget_classes()
    q, k, v, plan = _padded_inputs()
    got = flex.flex_padded(q, k, v, plan, 0.25)
    with warnings.catch_warnings():  # the eager kernel warns that it is slow, once
        warnings.simplefilter("ignore", UserWarning)
        want = flex.flex_padded(q, k, v, plan, 0.25, compiled=False)
    torch.testing.assert_close(got, want)
    # The same class (shapes included) with other strides: dynamo would compile again.
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    with torch._dynamo.config.patch(recompile_limit=1):
        with pytest.raises(va.BackendUnavailableError,
                           match=r"FlexAttention did not compile \(dynamo's recompile limit"):
            flex.flex_padded(q, k, v, plan, 0.25)


def test_two_threads_meeting_a_new_call_class_compile_it_once(fresh_dynamo):
    """Two threads whose first flex call is of the same new class (a model shared between
    threads): one compiled function, one graph, equal results (the class's first call runs under
    a lock; without it each thread made and compiled its own copy)."""
    import threading

    from torch._dynamo.utils import counters

    flex._forget_classes()
    q, k, v, plan = _padded_inputs(b=1, s=96, seed=3)
    start, outs = threading.Barrier(2), [None, None]

    def run(i):
        start.wait()
        outs[i] = flex.flex_padded(q, k, v, plan, 0.25)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(flex._classes) == 1 and counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_a_call_class_that_does_not_compile_is_refused_clearly(fresh_dynamo, monkeypatch):
    """Where the compiler fails on a call class (on an H200 inductor found no kernel configuration
    for one), the call raises BackendUnavailableError naming the class and the compiler's
    message, not the compiler's own exception. The class keeps its failure: a later call raises
    the same error without compiling again."""
    compile_ = torch.compile
    tries = []

    def no_kernel(gm, example_inputs):
        tries.append(1)
        raise RuntimeError("No choices to select")  # as inductor's NoValidChoicesError

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": no_kernel}))
    flex._forget_classes()
    q, k, v, plan = _padded_inputs(b=1, s=65, seed=5)
    said = r"backend 'flex' cannot run .*batch 1, 65 queries.*could not compile this call class.*No choices to select"
    with pytest.raises(va.BackendUnavailableError, match=said):
        flex.flex_padded(q, k, v, plan, 0.25)
    assert len(tries) == 1
    with pytest.raises(va.BackendUnavailableError, match=said):
        flex.flex_padded(q, k, v, plan, 0.25)
    assert len(tries) == 1  # not compiled again
    flex._forget_classes()
