"""Several processes on the CPU (gloo, world size 2): Ulysses context parallelism
(``varlen_attn.parallel``) and data parallelism (DDP, FSDP2) of an enabled model.

Each test spawns two processes once and runs all its cases inside them; a failed assertion in a
worker fails the test with the worker's traceback. References are computed in each worker by a
single process on the whole data (float64): masked SDPA for the expected values, and the
tolerance is :func:`_testing.assert_model_close`'s, with single-process varlen as the baseline
where one is given.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import varlen_attn as va
from _testing import assert_model_close

WORLD = 2
F64 = torch.float64
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _entry(rank: int, fn, store: str, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        fn(rank, *args)
        dist.barrier()  # both ranks are past every collective before either tears down
    finally:
        dist.destroy_process_group()
    # Every assertion passed and the group is destroyed: leave without the interpreter's
    # finalization. Once in CI (2 cores, torch 2.13, FSDP2 eager) rank 0 died there with SIGABRT,
    # "terminate called without an active exception", no Python traceback; it did not recur in 24
    # runs of the test on a machine like CI's. A failure inside ``fn`` still takes the normal path
    # (mp.spawn reports its traceback).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(tmp_path, fn, *args):
    """Run ``fn(rank, *args)`` in ``WORLD`` fresh processes joined by a gloo group."""
    mp.spawn(_entry, args=(fn, str(tmp_path / "store"), args), nprocs=WORLD, join=True)


# ------------------------------------------------------------------------------------------------
# Ulysses

def _sdpa_ref(q, k, v, keep4, gqa=False):
    """Masked SDPA on [B, S, H, D] with a bool [B, 1|H, Sq, Sk] mask."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=keep4, enable_gqa=gqa)
    return out.transpose(1, 2)


def _grads(fn, q, k, v, w):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    (out * w).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _ulysses_cases(b=3, h=4, d=8):
    """``(name, sq, sk, hkv, model mask, bool [B, 1|H, Sq, Sk] meaning, use_plan)``; structure
    fixed, values seeded (the same on every rank)."""
    g = torch.Generator().manual_seed(0)
    cases = []
    s = 10
    keep = torch.rand(b, s, generator=g) > 0.4
    cases.append(("key_padding_even", s, s, h, keep, keep[:, None, None], False))
    s, t = 13, 6  # joint [text; image], text padded: the gap sits in the middle of the row
    text = torch.arange(t)[None] < torch.tensor([3, 0, 6])[:, None]
    keep = torch.cat([text, torch.ones(b, s - t, dtype=torch.bool)], 1)
    cases.append(("joint_text_image_uneven", s, s, h, keep, keep[:, None, None], False))
    s = 7  # uneven, row 1 has no valid key at all (zeros out, zero gradients)
    keep = torch.tensor([[1, 1, 0, 1, 0, 0, 1], [0] * 7, [1] * 7], dtype=torch.bool)
    add = torch.zeros(b, 1, 1, s, dtype=F64).masked_fill(~keep[:, None, None], float("-inf"))
    cases.append(("additive_empty_row_uneven", s, s, h, add, keep[:, None, None], False))
    cases.append(("plan_gqa_uneven", s, s, h // 2, keep, keep[:, None, None], True))
    s = 9  # a per-head mask (not packable: masked SDPA on this rank's heads)
    keep = torch.rand(b, h, 1, s, generator=g) > 0.5
    keep[..., 0] = True
    cases.append(("per_head_fallback", s, s, h, keep.expand(b, h, s, s), keep, False))
    sq, sk = 9, 6  # cross-attention: queries all valid, keys padded
    keep = torch.arange(sk)[None] < torch.tensor([6, 1, 4])[:, None]
    cases.append(("cross_attention", sq, sk, h, keep, keep[:, None, None], True))
    cases.append(("no_mask", 8, 8, h, None, None, False))
    return cases


def _ulysses_worker(rank: int):
    from varlen_attn.parallel import shard_sequence, ulysses_attention

    b, h, d = 3, 4, 8
    for name, sq, sk, hkv, mask, keep4, use_plan in _ulysses_cases(b, h, d):
        g = torch.Generator().manual_seed(len(name))
        q = torch.randn(b, sq, h, d, generator=g, dtype=F64)
        k, v = (torch.randn(b, sk, hkv, d, generator=g, dtype=F64) for _ in range(2))
        w = torch.randn(b, sq, h, d, generator=g, dtype=F64)
        gqa = hkv != h
        kv_keep = None if keep4 is None else keep4
        ref = _grads(lambda q, k, v: _sdpa_ref(q, k, v, kv_keep, gqa), q, k, v, w)
        single = _grads(lambda q, k, v: va.attention(q, k, v, mask, enable_gqa=gqa), q, k, v, w)
        plan = va.build_plan(mask, seqlen_q=sq) if use_plan else None
        va.reset_stats()
        got = _grads(lambda q, k, v: ulysses_attention(q, k, v, mask, plan=plan, enable_gqa=gqa),
                     *(shard_sequence(t) for t in (q, k, v)), shard_sequence(w))
        st = va.stats()
        local = {n: shard_sequence(t) for n, t in ref.items()}
        assert got["out"].shape == local["out"].shape, name
        assert_model_close(got, local, baseline={n: shard_sequence(t) for n, t in single.items()},
                           what=f"rank {rank}/{name}")
        if name == "per_head_fallback":
            assert st["backends"] == {"sdpa": 1} and len(st["fallbacks"]) == 1, (name, st)
        elif mask is not None:
            assert st["fallbacks"] == {}, (name, st)
            assert st["backends"] == {"split_sdpa": 1}, (name, st)
            # A bool key-padding mask: a plan of its own, no host read; the additive one: one read,
            # which finds it equal to the kept copy of the single-process call's, whose plan it
            # takes; a prebuilt plan: neither.
            additive = mask.is_floating_point() and not use_plan
            assert st["plan_builds"] == (0 if use_plan or additive else 1), (name, st)
            assert st["host_syncs"] == (1 if additive else 0), (name, st)


def test_ulysses_equals_single_process_attention(tmp_path):
    spawn(tmp_path, _ulysses_worker)


def _exchanges(calls: dict[str, int]) -> int:
    """All-to-alls among the ops :class:`CountCollectives` counted: the functional collective's
    and ``dist.all_to_all_single``'s."""
    return sum(n for op, n in calls.items() if op.split(".")[0] in ("all_to_all_single", "alltoall_base_"))


def _ulysses_exchanges_worker(rank: int):
    from varlen_attn.parallel import shard_sequence, ulysses_attention

    b, h, d = 3, 4, 8
    for name, sq, sk, hkv, mask, _, use_plan in _ulysses_cases(b, h, d):
        g = torch.Generator().manual_seed(len(name))
        q = shard_sequence(torch.randn(b, sq, h, d, generator=g, dtype=F64)).requires_grad_()
        k, v = (shard_sequence(torch.randn(b, sk, hkv, d, generator=g, dtype=F64)).requires_grad_()
                for _ in range(2))
        plan = va.build_plan(mask, seqlen_q=sq) if use_plan else None
        with CountCollectives() as forward:
            out = ulysses_attention(q, k, v, mask, plan=plan, enable_gqa=hkv != h)
        with CountCollectives() as backward:
            out.sum().backward()
        # q, k and v in one exchange, the output in one; cross-attention's q has splits of its own
        expected = 2 if sq == sk else 3
        assert _exchanges(forward.calls) == expected, (name, forward.calls)
        assert _exchanges(backward.calls) == expected, (name, backward.calls)
    # a value head dim unlike the key's shares the exchange too (slices of other widths)
    g = torch.Generator().manual_seed(5)
    keep = torch.rand(b, 7, generator=g) > 0.3
    q, k = (torch.randn(b, 7, h, d, generator=g, dtype=F64) for _ in range(2))
    v = torch.randn(b, 7, h, 2 * d, generator=g, dtype=F64)
    w = torch.randn(b, 7, h, 2 * d, generator=g, dtype=F64)
    ref = _grads(lambda q, k, v: _sdpa_ref(q, k, v, keep[:, None, None]), q, k, v, w)
    single = _grads(lambda q, k, v: va.attention(q, k, v, keep), q, k, v, w)
    with CountCollectives() as calls:
        got = _grads(lambda q, k, v: ulysses_attention(q, k, v, keep), *(shard_sequence(t) for t in (q, k, v)),
                     shard_sequence(w))
    assert _exchanges(calls.calls) == 4, calls.calls  # forward and backward
    assert_model_close(got, {n: shard_sequence(t) for n, t in ref.items()},
                       baseline={n: shard_sequence(t) for n, t in single.items()}, what=f"rank {rank}/value dim")


def test_ulysses_exchanges_qkv_at_once(tmp_path):
    spawn(tmp_path, _ulysses_exchanges_worker)


def _ulysses_compile_worker(rank: int, compiler: str):
    import torch._dynamo.testing as dynamo_testing
    from torch._dynamo.utils import counters

    from varlen_attn.parallel import shard_sequence

    b, s, h, d = 3, 7, 4, 8  # uneven: 4 and 3 tokens
    keep = torch.tensor([[1, 1, 0, 1, 0, 0, 1], [0] * 7, [1] * 7], dtype=torch.bool)
    plan = va.build_plan(keep)
    calls = {"plan": lambda q, k, v: va.ulysses_attention(q, k, v, keep, plan=plan),
             "mask": lambda q, k, v: va.ulysses_attention(q, k, v, keep)}
    g = torch.Generator().manual_seed(4)
    q, k, v, w = (shard_sequence(torch.randn(b, s, h, d, generator=g, dtype=F64)) for _ in range(4))
    for name, fn in calls.items():
        torch._dynamo.reset()
        counters.clear()
        cnt = dynamo_testing.CompileCounterWithBackend(compiler)
        got = _grads(torch.compile(fn, fullgraph=True, backend=cnt), q, k, v, w)
        assert cnt.frame_count == 1, (name, cnt.frame_count)
        assert not counters["graph_break"], (name, dict(counters["graph_break"]))
        eager = _grads(fn, q, k, v, w)
        for n in eager:
            assert torch.equal(got[n], eager[n]), (rank, name, n, (got[n] - eager[n]).abs().max())


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_ulysses_compiles_without_graph_breaks(tmp_path, compiler):
    spawn(tmp_path, _ulysses_compile_worker, compiler)


def _ulysses_errors_worker(rank: int):
    from varlen_attn.parallel import ulysses_attention

    x = torch.zeros(1, 4, 3, 8, dtype=F64)
    try:
        ulysses_attention(x, x, x)
    except va.InputValueError as e:
        assert "query has 3 heads" in str(e) and "divisible by 2" in str(e), str(e)
    else:
        raise AssertionError("3 heads over 2 ranks must raise")
    x = torch.zeros(1, 5, 2, 8, dtype=F64)  # 5 local tokens on each rank, but the mask says 7 in all
    try:
        ulysses_attention(x, x, x, torch.ones(1, 7, dtype=torch.bool))
    except va.InputValueError as e:
        assert re.search(r"key: rank \d of 2 must hold [34] of the 7 tokens given by attn_mask.*got 5", str(e)), str(e)
    else:
        raise AssertionError("a slice that does not fit the mask must raise")
    try:  # checked before q, k and v are packed into one buffer (torch.cat would promote)
        ulysses_attention(x, x.float(), x.float())
    except va.InputTypeError as e:
        assert "must share a dtype" in str(e), str(e)
    else:
        raise AssertionError("q, k and v of different dtypes must raise")


def test_ulysses_refuses_heads_not_divisible_and_wrong_slices(tmp_path):
    spawn(tmp_path, _ulysses_errors_worker)


def test_ulysses_needs_a_process_group():
    from varlen_attn.parallel import ulysses_attention

    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    x = torch.zeros(1, 4, 2, 8)
    with pytest.raises(va.InputValueError, match="group: ulysses_attention needs an initialized"):
        ulysses_attention(x, x, x)


# ------------------------------------------------------------------------------------------------
# Data parallel: DDP and FSDP2 around an enabled tiny Chroma with gradient checkpointing.

class CountCollectives(TorchDispatchMode):
    """Counts the collective ops that reach torch's dispatcher while active (``c10d`` and
    ``_c10d_functional``: how ``torch.distributed``'s functions, DDP's Python side and FSDP2
    launch them)."""

    def __enter__(self):
        self.calls: dict[str, int] = {}
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            self.calls[func.__name__] = self.calls.get(func.__name__, 0) + 1
        return func(*args, **(kwargs or {}))


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _data_parallel_worker(rank: int, mode: str, compiled: bool = False):
    from _models import CHROMA_ATTN_LAYERS, chroma_inputs, step, tiny_chroma

    # Each rank trains on its own batch; one process running both is the reference (stock,
    # without checkpointing: diffusers' checkpointed Chroma drops the mask of its single blocks,
    # which enable_varlen gives back).
    batches = [chroma_inputs(lengths=(5, 2, 0), seed=1), chroma_inputs(lengths=(7, 1, 3), seed=2)]
    reference = tiny_chroma()
    refs = [step(reference, batch) for batch in batches]
    ref_grads = {n: (refs[0][1][n] + refs[1][1][n]) / WORLD for n in refs[0][1]}

    model = tiny_chroma()
    model.enable_gradient_checkpointing()
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped, prefix = DistributedDataParallel(model), "module."
    else:
        from torch.distributed.fsdp import fully_shard

        for block in (*model.transformer_blocks, *model.single_transformer_blocks):
            fully_shard(block)
        wrapped, prefix = fully_shard(model), ""
    if compiled:  # OneTrainer / diffusers' regional compilation, inside the wrapper
        for block in (*model.transformer_blocks, *model.single_transformer_blocks):
            block.compile(backend="aot_eager")
    for _ in range(2):  # DDP rebuilds its buckets (broadcasts) at the second forward: past that
        step(wrapped, batches[rank])
    with CountCollectives() as stock_calls:
        step(wrapped, batches[rank])
    va.enable_varlen(model)
    va.reset_stats()
    with CountCollectives() as varlen_calls:
        out, grads = step(wrapped, batches[rank])
    st = va.stats()
    grads = {n.removeprefix(prefix): _full(g) for n, g in grads.items()}
    assert_model_close((out, grads), (refs[rank][0], ref_grads), what=f"{mode} rank {rank}")
    assert varlen_calls.calls == stock_calls.calls, (varlen_calls.calls, stock_calls.calls)
    # Chroma's outer-product masks, packed: one plan per rank, the outer product of the model's mask
    # built on the device once in the forward and shared by every attention call, forward and
    # diffusers' recomputation. Eager: one host read per rank, the forward's checks (the
    # recomputation's are not read). Compiled blocks run eagerly under CountCollectives' dispatch
    # mode, each call under its block's boundary entry, which carries the forward's checks.
    assert st["plan_builds"] == 1 and st["host_syncs"] == 1, st
    assert st["fallbacks"] == {}, st
    assert st["backends"] == {"split_sdpa": 2 * CHROMA_ATTN_LAYERS}, st  # forward + recomputation


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "blocks compiled"])
def test_ddp_trains_like_one_process(tmp_path, compiled):
    spawn(tmp_path, _data_parallel_worker, "ddp", compiled)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "blocks compiled"])
def test_fsdp2_trains_like_one_process(tmp_path, compiled):
    spawn(tmp_path, _data_parallel_worker, "fsdp2", compiled)


def test_only_the_parallel_adapter_uses_torch_distributed():
    """The rest of the library calls no collective: data parallel wrappers see the same
    communication with and without varlen (the workers above also count the Python calls)."""
    root = pathlib.Path(va.__file__).parent
    users = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if "torch.distributed" in p.read_text())
    assert users == ["parallel.py"], users


# ------------------------------------------------------------------------------------------------
# diffusers' own context parallelism (Ulysses, native backend) with enable_varlen: the recipe of
# docs/multi_gpu.md. diffusers 0.42.1 cannot set it up without an accelerator (it computes
# ``rank % torch.accelerator.device_count()``, a ZeroDivisionError on the CPU): the worker
# reports one device, which is all that computation is used for on the CPU.

def _diffusers_cp_worker(rank: int):
    from diffusers import ContextParallelConfig
    from _models import QF_B, QWEN_ATTN_LAYERS, prefix_keep, qwen_flux_inputs, qwen_model, step

    torch.accelerator.device_count = lambda: 1
    inputs = qwen_flux_inputs()
    inputs.pop("pooled_projections")
    # diffusers shards text and image tokens evenly: 8 text tokens, 20 image tokens.
    inputs["encoder_hidden_states"] = torch.randn(QF_B, 8, 32, generator=torch.Generator().manual_seed(3),
                                                  dtype=F64)
    inputs.update(encoder_hidden_states_mask=prefix_keep([5, 2, 8], length=8), img_shapes=[(1, 4, 5)] * QF_B)
    model = qwen_model()
    ref = step(model, inputs)  # one process, stock, whole sequence
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=WORLD))
    va.enable_varlen(model)
    va.reset_stats()
    out, grads = step(model, inputs)
    st = va.stats()
    for g in grads.values():  # each rank holds the gradient of its part of the sequence
        dist.all_reduce(g)
    assert_model_close((out, grads), ref, what=f"diffusers CP rank {rank}")
    assert st["fallbacks"] == {} and st["backends"] == {"split_sdpa": QWEN_ATTN_LAYERS}, st
    # one plan per attention call, from the mask diffusers all-gathers in every layer
    assert st["plan_builds"] == QWEN_ATTN_LAYERS and st["host_syncs"] == 0, st


def test_diffusers_context_parallel_with_enable_varlen(tmp_path):
    pytest.importorskip("diffusers", reason="the diffusers extra is not installed")
    spawn(tmp_path, _diffusers_cp_worker)
