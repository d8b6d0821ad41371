"""GPU: tiny diffusers models in bf16 with enable_varlen on the best GPU backend vs stock, both
measured against a float64 CPU run of the same weights. Run with ``python -m pytest -m gpu``."""

import pytest
import torch

import varlen_attn as va
from _models import CHROMA_ATTN_LAYERS, chroma_inputs, loss, own_names, step, tiny_chroma
from _testing import (BlocksInARow, Recording, assert_model_close, checkpoint_blocks, ran_in_graph,
                      synchronising_calls)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("no_cost_table"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none found)"),
]


@pytest.mark.parametrize("lengths", [(5, 2, 0), (7, 7, 7), (1, 3, 6)])
def test_chroma_bf16_on_gpu_within_stock_error(lengths):
    torch.backends.cuda.enable_cudnn_sdp(False)  # docs/versions.md: cuDNN SDPA failed inside diffusers models
    ref = step(tiny_chroma(), chroma_inputs(lengths))  # float64, CPU
    model = tiny_chroma(dtype=torch.bfloat16, device="cuda")  # the same weights, rounded to bf16
    inputs = chroma_inputs(lengths, dtype=torch.bfloat16, device="cuda")
    stock = step(model, inputs)
    va.enable_varlen(model)
    try:
        va.reset_stats()
        ours = step(model, inputs)
        st = va.stats()
    finally:
        va.disable_varlen(model)
    # one plan for the forward, the outer product of the model's mask built on the device and shared
    # by every block (each block's mask checked on the device to be that product); one host read
    # for the forward's checks
    assert st["plan_builds"] == 1 and st["host_syncs"] == 1 and st["fallbacks"] == {}
    assert "sdpa" not in st["backends"]
    # Output and every gradient: within 2x stock's own bf16 error, or the bf16 floor.
    assert_model_close(ours, ref, baseline=stock, what=f"chroma bf16/{lengths}")


@pytest.mark.parametrize("backend,checkpointing", [("auto", False), ("torch", True), ("torch", False)])
def test_chroma_compiled_blocks_with_a_new_mask_each_step(backend, checkpointing):
    """Every block compiled (inductor), the mask new every step at the same shapes (an empty
    prompt and a batch of empty prompts among them): each step equals the float64 reference
    within 2x stock's own bf16 error, with one plan a step (the outer product of the model's mask,
    in the custom op: key padding alone runs in the graph,
    test_blocks_compiled_alone_run_attention_in_the_graph), one host read (the forward's checks)
    and no recompilation. Chroma's tiny
    head dim (16) is below FA4's, so auto runs ``torch`` here with FA4 installed too."""
    torch.backends.cuda.enable_cudnn_sdp(False)
    stock = tiny_chroma(dtype=torch.bfloat16, device="cuda")
    model = va.enable_varlen(tiny_chroma(dtype=torch.bfloat16, device="cuda"), backend=backend)
    if checkpointing:  # not stock's: its checkpointed single blocks drop the mask (diffusers)
        model.enable_gradient_checkpointing()
    compiler = Recording()
    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        block.compile(fullgraph=True, backend=compiler)
    calls = CHROMA_ATTN_LAYERS * (2 if checkpointing else 1)
    try:
        for i, lengths in enumerate([(5, 2, 0), (7, 1, 3), (0, 0, 0), (3, 3, 3), (1, 7, 4)]):
            ref = step(tiny_chroma(), chroma_inputs(lengths, seed=i))  # float64, CPU
            inputs = chroma_inputs(lengths, seed=i, dtype=torch.bfloat16, device="cuda")
            va.reset_stats()
            ours = step(model, inputs)
            st = va.stats()
            assert st["plan_builds"] == 1 and st["host_syncs"] == 1 and st["fallbacks"] == {}, (lengths, st)
            assert sum(st["backends"].values()) == calls and "sdpa" not in st["backends"], (lengths, st)
            assert_model_close(ours, ref, baseline=step(stock, inputs), what=f"{lengths}")
        assert len(compiler.graphs) == 2 and not any(ran_in_graph(g) for g in compiler.graphs), compiler.graphs
    finally:
        torch.compiler.reset()


@pytest.mark.parametrize("checkpointing", [True, False])
def test_chroma_whole_model_compiled_plans_once_per_step(checkpointing):
    """The whole enabled model compiled (inductor, fullgraph), gradient checkpointing on or off, a
    new mask each step: each step equals the float64 reference within 2x the error of stock
    compiled the same way, with a plan and a host read per attention call (forward and
    recomputation)."""
    torch.backends.cuda.enable_cudnn_sdp(False)
    stock = torch.compile(tiny_chroma(dtype=torch.bfloat16, device="cuda"), fullgraph=True)
    model = va.enable_varlen(tiny_chroma(dtype=torch.bfloat16, device="cuda"))
    if checkpointing:
        model.enable_gradient_checkpointing()
    run = torch.compile(model, fullgraph=True)
    _compiled_steps_plan_once(run, stock, [(5, 2, 0), (7, 1, 3), (0, 0, 0), (1, 7, 4)],
                              CHROMA_ATTN_LAYERS * (2 if checkpointing else 1))


@pytest.mark.usefixtures("fresh_dynamo")  # reset also where the warm-up fails
def test_chroma_whole_model_compiled_around_compiled_blocks_plans_once_per_step():
    """Blocks compiled on their own (inductor), an eager forward first (it installs their
    wrappers), then the whole model compiled around them with checkpointing: each step equals the
    float64 reference within 2x the error of stock compiled the same way, with a plan and a host
    read per attention call."""
    torch.backends.cuda.enable_cudnn_sdp(False)

    def compiled(model):
        model.enable_gradient_checkpointing()
        for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
            block.compile(fullgraph=True)
        step(model, chroma_inputs((1, 1, 1), seed=9, dtype=torch.bfloat16, device="cuda"))
        return torch.compile(model, fullgraph=True)

    stock = compiled(tiny_chroma(dtype=torch.bfloat16, device="cuda"))
    run = compiled(va.enable_varlen(tiny_chroma(dtype=torch.bfloat16, device="cuda")))
    # the eager warm-up planned on its model's mask and kept none: from the second step on, the
    # first call compares its new mask with the kept copy of the last
    _compiled_steps_plan_once(run, stock, [(5, 2, 0), (7, 1, 3), (2, 2, 2)], 2 * CHROMA_ATTN_LAYERS)


def _compiled_steps_plan_once(run, stock, lengths_per_step, calls):
    """Steps of a whole model compiled (``run``, and ``stock`` compiled the same way) with a new
    mask each: each equals the float64 reference within 2x stock's error, with ``calls``
    attention calls on a varlen backend, each with a host read, one plan a step (and one more read
    in a step whose new mask is compared with a kept copy: every step after the first). Resets
    dynamo afterwards."""
    try:
        for i, lengths in enumerate(lengths_per_step):
            ref = step(tiny_chroma(), chroma_inputs(lengths, seed=i))  # float64, CPU
            inputs = chroma_inputs(lengths, seed=i, dtype=torch.bfloat16, device="cuda")
            va.reset_stats()
            ours = own_names(step(run, inputs))
            st = va.stats()
            assert st["plan_builds"] == 1 and st["host_syncs"] == calls + (i > 0), (lengths, st)
            assert st["fallbacks"] == {}, (lengths, st)
            assert sum(st["backends"].values()) == calls and "sdpa" not in st["backends"], (lengths, st)
            assert_model_close(ours, ref, baseline=own_names(step(stock, inputs)), what=f"{lengths}")
    finally:
        torch.compiler.reset()


@pytest.mark.parametrize("compiled", [None, True, "whole"])
def test_chroma_blocks_checkpointed_by_the_caller(compiled):
    """Blocks the caller checkpoints with torch.utils.checkpoint itself (OneTrainer's way), eager
    or around blocks compiled by inductor: the recomputation runs the attention modules (whose
    hooks, or the compiled block's boundary, put the policy back on the thread), so each step
    equals the float64 reference within 2x stock's bf16 error (stock checkpointed the same way),
    with one read a step, the forward's checks (eager or blocks compiled). ``whole``: the whole
    model compiled by inductor around the checkpoints, every attention call routed, a read a call."""
    torch.backends.cuda.enable_cudnn_sdp(False)
    whole = compiled == "whole"
    compiled = None if whole else compiled
    stock = checkpoint_blocks(tiny_chroma(dtype=torch.bfloat16, device="cuda"), False,
                              None if compiled is None else False)
    model = va.enable_varlen(checkpoint_blocks(tiny_chroma(dtype=torch.bfloat16, device="cuda"), False, compiled,
                                               compiler="inductor"))
    if whole:
        stock = torch.compile(stock, fullgraph=True)
        model = torch.compile(model, fullgraph=True)
    # float64 on the CPU, its blocks wrapped the same way (the same parameter names)
    reference = checkpoint_blocks(tiny_chroma(), False, None if compiled is None else False)
    try:
        for i, lengths in enumerate([(5, 2, 0), (7, 1, 3), (3, 3, 3)]):
            ref = step(reference, chroma_inputs(lengths, seed=i))
            inputs = chroma_inputs(lengths, seed=i, dtype=torch.bfloat16, device="cuda")
            va.reset_stats()
            ours = own_names(step(model, inputs))
            st = va.stats()
            if not whole:
                # the forward's one device plan, and one per recomputed call (the recomputation has
                # no model mask: each call plans from its own mask); one read for the forward's
                # checks (the recomputation's are not read)
                builds, reads = 1 + CHROMA_ATTN_LAYERS, 1
            else:  # traced whole: the custom op, a read a call, one more to compare a later step's mask
                builds, reads = 1, 2 * CHROMA_ATTN_LAYERS + (i > 0)
            assert st["plan_builds"] == builds and st["host_syncs"] == reads and st["fallbacks"] == {}, (lengths, st)
            assert sum(st["backends"].values()) == 2 * CHROMA_ATTN_LAYERS and "sdpa" not in st["backends"], (lengths, st)
            assert_model_close(ours, ref, baseline=own_names(step(stock, inputs)), what=f"{lengths}")
    finally:
        torch.compiler.reset()


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("compiled", [None, True])
def test_chroma_checkpointed_by_the_caller_on_pytorchs_default_kernels(compiled, mask_dtype):
    """PyTorch's default kernel choice (cuDNN's attention on an H100/H200) and the packaged cost
    table: the caller's checkpoint recomputes each block without the model's mask, and each such
    call takes its forward's route (stock's SDPA on the keys' mask at these lengths, where a
    table applies), so backward raises no CheckpointError and each step equals the float64
    reference within 2x stock's bf16 error (stock with cuDNN off: on cuDNN it fails on Chroma's
    mask, docs/versions.md), with one read a step. ChromaPipeline's float 0/1 mask is read as
    boolean (``float_mask="bool"``), as stock cannot (it reads a bias): its baseline is the bool mask."""
    va.costs.use(None)  # the packaged table, over the module's no_cost_table
    table = va.costs.table_for(torch.device("cuda"), torch.bfloat16) is not None
    model = va.enable_varlen(checkpoint_blocks(tiny_chroma(dtype=torch.bfloat16, device="cuda"), False, compiled,
                                               compiler="inductor"), float_mask="bool")
    stock = checkpoint_blocks(tiny_chroma(dtype=torch.bfloat16, device="cuda"), False,
                              None if compiled is None else False)
    reference = checkpoint_blocks(tiny_chroma(), False, None if compiled is None else False)
    try:
        for i, lengths in enumerate([(5, 2, 0), (7, 1, 3)]):
            ref = step(reference, chroma_inputs(lengths, seed=i))
            inputs = chroma_inputs(lengths, seed=i, dtype=torch.bfloat16, device="cuda")
            torch.backends.cuda.enable_cudnn_sdp(False)
            baseline = own_names(step(stock, inputs))
            torch.backends.cuda.enable_cudnn_sdp(True)
            va.reset_stats()
            ours = own_names(step(model, {**inputs, "attention_mask": inputs["attention_mask"].to(mask_dtype)}))
            st = va.stats()
            assert st["host_syncs"] == 1 and st["fallbacks"] == {}, (lengths, st)
            if table and compiled is None:  # compiled, the route runs in the graph, uncounted
                assert set(st["backends"]) == {"sdpa"}, (lengths, st)
            assert_model_close(ours, ref, baseline=baseline, what=f"{lengths}")
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
        torch.compiler.reset()


@pytest.mark.parametrize("checkpointing", [True, False])
def test_chroma_under_save_on_cpu_runs_and_equals_the_reference(checkpointing):
    """Activation offloading (``torch.autograd.graph.save_on_cpu(pin_memory=True)``: every saved
    tensor copied to pinned CPU memory and back), eagerly, with and without checkpointing, several
    steps with new masks: every attention call routed, each step within 2x stock's own bf16 error
    of the float64 reference. Stock is the baseline without offloading: under it, stock's masked
    SDPA fails in backward on torch 2.11 ("attn_bias is not correctly aligned": the copy drops the
    mask's aligned strides). Compiled blocks are not run here: inductor's stride asserts refuse
    the contiguous copies for stock and varlen alike (docs/troubleshooting.md)."""
    torch.backends.cuda.enable_cudnn_sdp(False)
    stock = tiny_chroma(dtype=torch.bfloat16, device="cuda")
    model = va.enable_varlen(tiny_chroma(dtype=torch.bfloat16, device="cuda"))
    if checkpointing:
        model.enable_gradient_checkpointing()
    for i, lengths in enumerate([(5, 2, 0), (7, 1, 3), (0, 6, 2)]):
        ref = step(tiny_chroma(), chroma_inputs(lengths, seed=i))  # float64, CPU
        inputs = chroma_inputs(lengths, seed=i, dtype=torch.bfloat16, device="cuda")
        va.reset_stats()
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            ours = step(model, inputs)
        st = va.stats()
        calls = CHROMA_ATTN_LAYERS * (2 if checkpointing else 1)
        # one device plan a forward, shared by its calls and diffusers' recomputation of them
        assert st["plan_builds"] == 1 and sum(st["backends"].values()) == calls, (lengths, st)
        assert st["host_syncs"] == 1 and st["fallbacks"] == {} and "sdpa" not in st["backends"], (lengths, st)
        assert_model_close(ours, ref, baseline=step(stock, inputs), what=f"{lengths}")


def _cuda_graph_blocks(model, checkpointing):
    if checkpointing:
        model.enable_gradient_checkpointing()
    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        block.compile(fullgraph=True, mode="reduce-overhead")
    return model


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_chroma_blocks_under_cuda_graphs_with_a_new_mask_each_step(backend, monkeypatch):
    """mode="reduce-overhead": every block captured in CUDA graphs and replayed with a new mask
    each step at the same shapes. Each step equals the stock model run eagerly on the same batch
    (within 2x stock's own bf16 error); once the graphs are recorded, a step runs none of
    varlen_attn's Python (no plan built on the host, no host read): attention replays inside
    the graphs. The kernel's first backward in the process runs in the graphs' warm-up, as in a
    trainer (a tensor the `torch` backend kept from there stopped the CUDA graph trees)."""
    from varlen_attn.kernels import torch_varlen

    monkeypatch.setattr(torch_varlen, "_no_dropout", {})
    torch.backends.cuda.enable_cudnn_sdp(False)
    stock = tiny_chroma(dtype=torch.bfloat16, device="cuda")
    model = _cuda_graph_blocks(va.enable_varlen(tiny_chroma(dtype=torch.bfloat16, device="cuda"), backend=backend),
                               False)
    try:
        for i, lengths in enumerate([(5, 2, 0), (7, 1, 3), (0, 6, 2), (3, 3, 3), (1, 7, 4), (0, 0, 0)]):
            ref = step(tiny_chroma(), chroma_inputs(lengths, seed=i))  # float64, CPU
            inputs = chroma_inputs(lengths, seed=i, dtype=torch.bfloat16, device="cuda")
            torch.compiler.cudagraph_mark_step_begin()
            va.reset_stats()
            ours = step(model, inputs)
            st = va.stats()
            assert not st["fallbacks"], (lengths, st)
            if i >= 3:
                assert st["plan_builds"] == 0 and st["host_syncs"] == 0, (lengths, st)
            assert_model_close(ours, ref, baseline=step(stock, inputs), what=f"{lengths}")
    finally:
        torch.compiler.reset()


def _steps_or_error(model, steps=3):
    try:
        for i in range(steps):
            torch.compiler.cudagraph_mark_step_begin()
            out = step(model, chroma_inputs((5, 2, 0), seed=i, dtype=torch.bfloat16, device="cuda"))
        return out, None
    except Exception as e:  # noqa: BLE001 - compared with stock's below
        return None, e
    finally:
        torch.compiler.reset()


def test_cuda_graphs_with_checkpointing_run_where_stock_runs():
    """Gradient checkpointing around blocks compiled with mode="reduce-overhead": where stock
    trains, the enabled model trains and matches it; where stock fails (torch 2.11's CUDA graph
    trees refused it on the H100), the enabled model fails with the same error, not another."""
    torch.backends.cuda.enable_cudnn_sdp(False)
    want, stock_error = _steps_or_error(_cuda_graph_blocks(tiny_chroma(dtype=torch.bfloat16, device="cuda"), True))
    model = _cuda_graph_blocks(va.enable_varlen(tiny_chroma(dtype=torch.bfloat16, device="cuda")), True)
    got, error = _steps_or_error(model)
    if stock_error is not None:
        assert type(error) is type(stock_error) and str(error) == str(stock_error), (stock_error, error)
        return
    assert error is None, error
    ref = step(tiny_chroma(), chroma_inputs((5, 2, 0), seed=2))
    assert_model_close(got, ref, baseline=want, what="checkpointing")


def test_a_training_step_syncs_the_host_no_more_than_stock_plus_its_plan():
    """Eager, gradient checkpointing on, a new mask every step: the enabled step makes at most the
    synchronising calls stock makes plus its reads (one a forward for Chroma's outer-product masks'
    checks; a key-padding mask reads nothing).
    (Stock's own count varies with lazy CUDA initialisation, so both models are warmed first.)"""
    torch.backends.cuda.enable_cudnn_sdp(False)
    stock = tiny_chroma(dtype=torch.bfloat16, device="cuda")
    model = va.enable_varlen(tiny_chroma(dtype=torch.bfloat16, device="cuda"))
    for m in (stock, model):
        m.enable_gradient_checkpointing()
        m.train()

    def run(m, inputs):
        return lambda: loss(m(**inputs)[0]).backward()

    # Two warm-up steps.
    for i, lengths in enumerate([(5, 2, 0), (7, 1, 3), (0, 6, 2), (3, 3, 3), (1, 7, 4)]):
        inputs = chroma_inputs(lengths, seed=i, dtype=torch.bfloat16, device="cuda")
        base = len(synchronising_calls(run(stock, inputs)))
        va.reset_stats()
        ours = len(synchronising_calls(run(model, inputs)))
        st = va.stats()
        # one read for the forward's checks; one device plan a forward (the recomputation shares it)
        assert st["host_syncs"] == 1 and st["plan_builds"] == 1, st
        assert "sdpa" not in st["backends"], st
        if i >= 2:
            assert ours <= base + st["host_syncs"], (i, ours, base)


class _Attend(torch.nn.Module):
    """Self-attention over a joint ``[text; image]`` row whose mask the block makes itself, as a
    diffusers transformer block does: the padding outer product, or key padding alone."""

    def __init__(self, kind, heads=4, dim=64):
        super().__init__()
        self.kind, self.heads, self.dim = kind, heads, dim
        self.qkv = torch.nn.Linear(heads * dim, 3 * heads * dim)

    def forward(self, x, keep):
        b, s, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(b, s, 3, self.heads, self.dim).unbind(2))
        mask = keep[:, None, None, :] if self.kind == "keys" else keep[:, None, None, :] & keep[:, None, :, None]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, s, -1)


def _blocks(kind, checkpointing):
    torch.manual_seed(0)
    return BlocksInARow([_Attend(kind) for _ in range(3)], checkpointing)


def _in_graph_backends():
    return [b for b in va.kernels.PRIORITY["cuda_sm90"] if b != "reference"
            and (va.kernels.BACKENDS[b].TRACEABLE or va.kernels.BACKENDS[b].NATIVE_BACKWARD)]


@pytest.mark.parametrize("backend", _in_graph_backends())
@pytest.mark.parametrize("kind,checkpointing", [("outer", True), ("keys", False)])
def test_blocks_compiled_alone_run_attention_in_the_graph(backend, kind, checkpointing):
    """Blocks compiled alone (inductor, fullgraph) in an enabled model, with each backend the
    in-graph route takes (its kernel traced, ``torch``; or its own forward and backward in an
    opaque op, FA4), head dim 64: key padding runs inside the graphs (queries kept in place, no
    host read), the padding outer product (with checkpointing) in the custom op (a host read per
    call, one plan a step); a new mask every step (an empty prompt among them), each step within 2x
    stock bf16's error of the float64 reference."""
    if not va.kernels.BACKENDS[backend].is_installed():
        pytest.skip(f"backend {backend!r} is not installed here")
    torch.backends.cuda.enable_cudnn_sdp(False)
    dev, t, n = torch.device("cuda"), 64, 192
    ref_model = _blocks(kind, checkpointing).double()
    stock = _blocks(kind, checkpointing).to(dev, torch.bfloat16)
    model = va.enable_varlen(_blocks(kind, checkpointing).to(dev, torch.bfloat16), backend=backend)
    compiler = Recording()
    for block in model.blocks:
        block.compile(fullgraph=True, backend=compiler)

    def run(m, x, keep):
        m.zero_grad(set_to_none=True)
        x = x.clone().requires_grad_()
        out = m(x, keep)
        out.float().pow(2).mean().backward()
        return {"out": out.detach(), "grad x": x.grad, **{n: p.grad for n, p in m.named_parameters()}}

    try:
        for i, lengths in enumerate([(10, 64, 0), (33, 1, 7), (64, 64, 64)]):
            g = torch.Generator().manual_seed(i)
            x = torch.randn(3, t + n, 256, generator=g, dtype=torch.float64)
            keep = torch.cat([torch.arange(t)[None] < torch.tensor(lengths)[:, None],
                              torch.ones(3, n, dtype=torch.bool)], 1)
            ref = run(ref_model, x, keep)
            va.reset_stats()
            got = run(model, x.to(dev, torch.bfloat16), keep.to(dev))
            st = va.stats()
            calls = 0 if kind == "keys" else 3 * (2 if checkpointing else 1)
            # the outer product: a read a call (one more to compare a later step's new mask), one plan
            assert st["plan_builds"] == min(calls, 1) and st["fallbacks"] == {}, (lengths, st)
            assert st["host_syncs"] == calls + (calls > 0 and i > 0), (lengths, st)
            assert set(st["backends"]) <= {backend}, st  # a traced kernel runs no Python of ours: not counted
            baseline = run(stock, x.to(dev, torch.bfloat16), keep.to(dev))
            assert_model_close(got, ref, baseline=baseline, what=f"{lengths}")
        assert all(ran_in_graph(g) == (kind == "keys") for g in compiler.graphs), compiler.graphs
    finally:
        torch.compiler.reset()
