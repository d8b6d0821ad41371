"""The in-graph route (varlen_attn.op, "In the graph"): in compiled code of an enabled model, a
boolean key-padding mask's attention runs inside the graph itself: the plan traced from the mask
(no host read), the keys and values gathered, the queries in place, the kernel traced (or, for
a kernel with its own entry points, in its opaque op). Every other mask takes the custom op.

On the CPU the ``reference`` backend's dense form stands in for the GPU kernel (the ``torch``
backend's aten forward, run in tests/test_gpu_models.py); the plan, the permutations, the
padding rows and the autograd around the kernel are the code that runs on the GPU."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import varlen_attn_ref
import varlen_attn as va
from _testing import BlocksInARow, Recording, assert_model_close, ran_in_graph

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "unwritten_rows")  # conftest.py, below


class _Unwritten(torch.autograd.Function):
    """The identity, whose gradient is NaN on the rows ``past``: what the GPU kernel's backward
    leaves in rows no segment covers (unwritten memory)."""

    @staticmethod
    def forward(ctx, x, past):
        ctx.save_for_backward(past)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (past,) = ctx.saved_tensors
        return torch.where(past, float("nan"), grad), None


@pytest.fixture
def unwritten_rows(monkeypatch):
    """The CPU stand-in behaves as the GPU kernel does on the rows past the last segment: its
    output and its gradients there are NaN, not the zeros the dense oracle gives, so a test
    fails unless the route itself keeps those rows out of the results."""

    def traced_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        past_q = (torch.arange(q.shape[0]) >= cu_q[-1])[:, None, None]
        past_k = (torch.arange(k.shape[0]) >= cu_k[-1])[:, None, None]
        q, k, v = _Unwritten.apply(q, past_q), _Unwritten.apply(k, past_k), _Unwritten.apply(v, past_k)
        return torch.where(past_q, float("nan"), varlen_attn_ref.varlen_attention_dense(q, k, v, cu_q, cu_k, scale))

    monkeypatch.setattr(va.kernels.BACKENDS["reference"].__class__, "traced_forward", traced_forward)

GENERAL_OP = f"varlen_attn.attention{va.op._CONTRACT}.default"


B, T, N, H, D = 3, 6, 10, 2, 8
S = T + N


class _Block(torch.nn.Module):
    """Self-attention over a joint [text; image] row whose mask is made inside the block: the
    padding outer product, key padding alone (``[B, 1, 1, S]``, "keys"), or the outer product
    restricted to two segments ("segments", packable but not one segment per batch element), or
    a float bias on top ("bias", not packable)."""

    def __init__(self, kind: str, dropout: float = 0.0):
        super().__init__()
        self.kind, self.dropout = kind, dropout
        self.qkv = torch.nn.Linear(H * D, 3 * H * D, dtype=torch.float64)

    def forward(self, x, mask):
        x = F.dropout(x, self.dropout) if self.dropout else x  # as peft's lora_dropout, before attention
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(B, S, 3, H, D).unbind(2))
        m = mask[:, None, None, :] & mask[:, None, :, None]
        if self.kind == "keys":
            m = mask[:, None, None, :]
        elif self.kind == "segments":
            half = (torch.arange(S) >= S // 2).to(torch.int64)
            m = m & (half[:, None] == half[None, :])
        elif self.kind == "bias":
            m = torch.where(m, torch.linspace(0, 1, S, dtype=torch.float64), float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        return out.transpose(1, 2).reshape(B, S, H * D)


class _Model(BlocksInARow):
    """Blocks of ``kinds`` in a row (:class:`_testing.BlocksInARow`), seeded."""

    def __init__(self, kinds, checkpointing=False, dropout=0.0):
        torch.manual_seed(0)
        super().__init__([_Block(kind, dropout) for kind in kinds], checkpointing)


def _mask(lengths, image=N):
    return torch.cat([torch.arange(T)[None] < torch.tensor(lengths)[:, None],
                      torch.arange(N)[None].expand(B, N) < image], 1)


def _x(seed):
    return torch.randn(B, S, H * D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


LENGTHS = [((3, 6, 1), N), ((0, 2, 5), N), ((2, 0, 4), 0)]  # the last: an element with no key at all


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_key_padding_mask_runs_in_the_graph_with_no_host_read(checkpointing):
    """Key padding (every query of an element sees the same keys): the in-graph route moves only
    the keys and values, reads nothing on the host and equals stock, also for a batch element
    with no key at all (its queries attend nothing: zeros, as SDPA), and with checkpointing
    (the recomputation runs the same graph); the outer-product block takes the custom op, one
    host read a call, one plan a mask. No step recompiles."""
    stock = _Model(["keys", "padding"], checkpointing)
    model = va.enable_varlen(_Model(["keys", "padding"], checkpointing), backend="reference")
    backend = Recording()
    for block in model.blocks:
        block.compile(fullgraph=True, backend=backend)
    calls = 2 if checkpointing else 1
    for i, (lengths, image) in enumerate(LENGTHS):
        mask = _mask(lengths, image)
        va.reset_stats()
        assert_model_close(_out_and_grads(model, _x(i), mask), _out_and_grads(stock, _x(i), mask), what=f"{lengths} {image}")
        st = va.stats()
        # Only the custom op's calls are counted (the traced kernel runs no Python of ours): one
        # plan for the step's outer product, one read a call, and in a later step one more (the
        # new mask compared with the kept copy of the last).
        assert st["plan_builds"] == 1 and st["host_syncs"] == calls + (i > 0), st
        assert st["backends"] == {"reference": calls}, st
        if i == 0:
            graphs = len(backend.graphs)
    assert len(backend.graphs) == graphs, "a new mask recompiled"
    assert [ran_in_graph(g) for g in backend.graphs] == [True, False], backend.graphs


@pytest.mark.parametrize("kind", ["segments", "bias"])
def test_a_mask_that_is_not_key_padding_takes_the_custom_op(kind, monkeypatch):
    """A block whose mask is not key padding runs in the custom op (several segments: packed; a
    bias: masked SDPA, the fallback recorded with its reason under auto), the key-padding blocks
    stay in the graph, every step equals stock, and no step recompiles."""
    monkeypatch.setitem(va.kernels.PRIORITY, "cpu", ("reference",))
    kinds = ["keys", kind, "keys"]
    stock, model = _Model(kinds), va.enable_varlen(_Model(kinds))
    backend = Recording()
    for block in model.blocks:
        block.compile(fullgraph=True, backend=backend)
    for i, lengths in enumerate([(3, 6, 1), (0, 2, 5), (6, 6, 6)]):
        mask = _mask(lengths)
        va.reset_stats()
        got = _out_and_grads(model, _x(i), mask)
        stats = va.stats()
        assert_model_close(got, _out_and_grads(stock, _x(i), mask), what=f"{kind} {lengths}")
        assert bool(stats["fallbacks"]) == (kind == "bias"), stats
        if i == 0:
            graphs = len(backend.graphs)
    assert len(backend.graphs) == graphs, "a later step recompiled"
    assert [ran_in_graph(g) for g in backend.graphs] == [True, False], backend.graphs


def test_an_explicit_backend_refuses_an_unpackable_mask_in_compiled_blocks_as_eagerly():
    """backend="reference" asked for explicitly, a mask it cannot run: the compiled block raises
    the error the eager forward raises (never a silent fallback), not the route's own signal."""
    model = va.enable_varlen(_Model(["bias"]), backend="reference")
    mask = torch.ones(B, S, dtype=torch.bool)
    x = torch.randn(B, S, H * D, dtype=torch.float64)
    with pytest.raises(va.BackendUnavailableError, match="needs a packable mask") as eager:
        model(x, mask)
    model.blocks[0].compile(fullgraph=True, backend=Recording())
    with pytest.raises(va.BackendUnavailableError, match="needs a packable mask") as compiled:
        model(x, mask)
    assert str(compiled.value) == str(eager.value)


def _out_and_grads(model, x, mask, params=None):
    """Output and gradients (of x and of the parameters of ``params``, default ``model``)."""
    params = model if params is None else params
    params.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = model(x, mask.clone())
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return {"out": out.detach(), "grad x": x.grad, **{f"grad {n}": p.grad for n, p in params.named_parameters()}}


@given(st.lists(st.integers(0, 5), min_size=1, max_size=4), st.lists(st.integers(0, 5), min_size=1, max_size=4),
       st.integers(0, 3), st.integers(0, 3))
def test_the_dense_oracle_equals_the_looping_oracle(lens_q, lens_k, spare_q, spare_k):
    """``varlen_attn_ref.varlen_attention_dense`` (the traced form) equals ``flash_attn_varlen_func``
    on every sequence, outputs and gradients, and gives zeros and zero gradients on the spare
    rows past the last sequence (whatever they hold)."""
    n = min(len(lens_q), len(lens_k))
    lens_q, lens_k = lens_q[:n], lens_k[:n]
    cu_q = torch.tensor([0, *lens_q]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lens_k]).cumsum(0).to(torch.int32)
    g = torch.Generator().manual_seed(sum(lens_q) + 7 * sum(lens_k))
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq + spare_q, 4, 8, dtype=torch.float64, generator=g).requires_grad_()
    k = torch.randn(tk + spare_k, 2, 8, dtype=torch.float64, generator=g).requires_grad_()
    v = torch.randn(tk + spare_k, 2, 8, dtype=torch.float64, generator=g).requires_grad_()
    w = torch.randn(tq + spare_q, 4, 8, dtype=torch.float64, generator=g)

    def grads(fn, *inputs):
        out = fn(*inputs)
        return [out, *torch.autograd.grad((out * w[: out.shape[0]]).sum(), inputs, allow_unused=True)]

    dense = grads(lambda q, k, v: varlen_attn_ref.varlen_attention_dense(q, k, v, cu_q, cu_k, 0.3), q, k, v)
    looping = grads(lambda q, k, v: varlen_attn_ref.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), softmax_scale=0.3), q[:tq], k[:tk], v[:tk])
    for got, want in zip(dense, looping):
        rows = want.shape[0]
        torch.testing.assert_close(got[:rows], want, rtol=0, atol=1e-12)
        assert torch.equal(got[rows:], torch.zeros_like(got[rows:]))


@pytest.mark.parametrize("in_graph", [True, False])
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_dropout_before_attention_with_checkpointing_equals_stock(compiler, in_graph):
    """Dropout before attention and checkpointing: forward and recomputation draw the same dropout
    mask on either route, so the step equals stock's (inductor told to draw as eager does)."""

    def run(enabled):
        torch._dynamo.reset()
        model = _Model(["keys"], True, dropout=0.5)
        if enabled:
            model = va.enable_varlen(model, backend="reference", in_graph=in_graph)
            model.blocks[0].compile(fullgraph=True, backend=compiler)
        torch.manual_seed(7)
        return _out_and_grads(model, _x(0), _mask((0, 2, 5), image=0))

    # The config's own patch: monkeypatch's undo deletes a config entry of torch's config modules.
    with torch._inductor.config.patch(fallback_random=True):
        assert_model_close(run(True), run(False), what=f"{compiler} in_graph={in_graph}")


def test_the_route_runs_without_fullgraph_and_in_a_whole_model_compiled():
    """The route needs no ``fullgraph``, and a whole model compiled (around compiled blocks or
    not) runs its key-padding attention in the graph too; equal to stock everywhere."""
    mask = _mask((0, 2, 5), image=0)
    stock = _Model(["keys"])
    partial = va.enable_varlen(_Model(["keys"]), backend="reference")
    compiler = Recording()
    partial.blocks[0].compile(backend=compiler)
    assert_model_close(_out_and_grads(partial, _x(0), mask), _out_and_grads(stock, _x(0), mask), what="no fullgraph")
    assert compiler.graphs and all(ran_in_graph(g) for g in compiler.graphs), compiler.graphs
    for inner in (False, True):
        whole = va.enable_varlen(_Model(["keys"]), backend="reference")
        if inner:
            whole.blocks[0].compile(fullgraph=True, backend="aot_eager")
        compiler = Recording()
        compiled = torch.compile(whole, backend=compiler)
        va.reset_stats()
        assert_model_close(_out_and_grads(compiled, _x(0), mask, whole), _out_and_grads(stock, _x(0), mask),
                           what=f"whole, inner compiled {inner}")
        assert va.stats()["host_syncs"] == 0 and all(ran_in_graph(g) for g in compiler.graphs), compiler.graphs


def test_an_invalid_in_graph_leaves_an_enabled_model_enabled():
    model = va.enable_varlen(_Model(["keys"]))
    with pytest.raises(va.InputTypeError, match="in_graph must be a bool, got str"):
        va.enable_varlen(model, in_graph="no")
    assert model._varlen_state is not None


class _OwnEntryPoints(va.kernels.Backend):
    """A CPU backend shaped as FA4 is: its kernel's own forward and backward entry points
    (``NATIVE_BACKWARD``) and no form dynamo traces, so the in-graph route calls it through the
    opaque op ``varlen_attn::native_kernel``. It computes with the dense oracle and, as the GPU
    kernel leaves them unwritten, puts NaN in the rows past the last segment: in its output and
    in its gradients."""

    NAME = "own_entry_points"
    NATIVE_BACKWARD = True
    STATIC_PLANS = True

    @staticmethod
    def _past(t, cu):
        return (torch.arange(t.shape[0]) >= cu[-1])[:, None, None]

    def forward_lse(self, inp):
        p = inp.plan
        out = varlen_attn_ref.varlen_attention_dense(inp.q, inp.k, inp.v, p.cu_seqlens_q, p.cu_seqlens_k, inp.scale)
        return out.masked_fill(self._past(out, p.cu_seqlens_q), float("nan")), self._lse(inp).float()

    @staticmethod
    def _lse(inp):
        """``[Hq, Tq]`` log-sum-exp of each valid row's scores over its segment's keys (-inf past
        the last segment)."""
        p = inp.plan
        see = varlen_attn_ref.same_segment(inp.q.shape[0], inp.k.shape[0], p.cu_seqlens_q, p.cu_seqlens_k)
        scores = torch.einsum("qhd,khd->hqk", inp.q, inp.k) * inp.scale
        return torch.logsumexp(scores.masked_fill(~see, float("-inf")), dim=-1)

    def backward(self, inp, out, lse, dout):
        """The gradients by autograd through the oracle, once the output and log-sum-exp the
        kernel op kept for its backward are checked to be this call's (the GPU kernel's backward
        reads both; the output only as ``rowsum(dout * out)``, so rows whose gradient is zero, a
        dead element's that attention zeroed, may hold anything)."""
        p = inp.plan
        valid = slice(0, int(p.cu_seqlens_q[-1]))
        ref_out, _ = self.forward_lse(inp)
        read = (dout[valid] != 0).flatten(1).any(1)
        torch.testing.assert_close(out[valid][read], ref_out[valid][read])
        torch.testing.assert_close(lse[:, valid], self._lse(inp)[:, valid].float())
        q, k, v = (t.detach().requires_grad_() for t in (inp.q, inp.k, inp.v))
        with va.op._autograd_dispatch(), torch.enable_grad():  # autograd, below which a custom op runs
            o = varlen_attn_ref.varlen_attention_dense(q, k, v, p.cu_seqlens_q, p.cu_seqlens_k, inp.scale)
            grads = torch.autograd.grad(o, (q, k, v), dout.masked_fill(self._past(dout, p.cu_seqlens_q), 0))
        return tuple(g.masked_fill(self._past(g, cu), float("nan"))
                     for g, cu in zip(grads, (p.cu_seqlens_q, p.cu_seqlens_k, p.cu_seqlens_k)))


NATIVE_KERNEL_OP = "varlen_attn.native_kernel.default"


@pytest.fixture
def own_entry_points(monkeypatch):
    monkeypatch.setitem(va.kernels.BACKENDS, _OwnEntryPoints.NAME, _OwnEntryPoints())


@pytest.mark.parametrize("checkpointing", [True, False])
def test_a_kernel_with_its_own_backward_runs_in_the_graph_through_its_op(checkpointing, own_entry_points):
    """A backend whose kernel does not trace but has its own forward and backward (FA4) takes the
    in-graph route too on a key-padding mask: the plan and the gathers in the graph, its kernel
    in the opaque op; the outer-product block takes the custom op; equal to stock on both mask
    kinds, also for a batch element with no key."""
    kinds = ["padding", "keys"]
    stock = _Model(kinds, checkpointing)
    model = va.enable_varlen(_Model(kinds, checkpointing), backend=_OwnEntryPoints.NAME)
    backend = Recording()
    for block in model.blocks:
        block.compile(fullgraph=True, backend=backend)
    for i, (lengths, image) in enumerate(LENGTHS):
        va.reset_stats()
        got = _out_and_grads(model, _x(i), _mask(lengths, image))
        assert_model_close(got, _out_and_grads(stock, _x(i), _mask(lengths, image)), what=f"{lengths} {image}")
        # Both blocks' kernels run in opaque ops and are counted: forward (and recomputation).
        assert va.stats()["backends"] == {_OwnEntryPoints.NAME: len(kinds) * (2 if checkpointing else 1)}
    assert not ran_in_graph(backend.graphs[0]) and ran_in_graph(backend.graphs[1]), backend.graphs
    assert NATIVE_KERNEL_OP in backend.graphs[1], backend.graphs[1]


def test_native_kernel_op_passes_opcheck(own_entry_points):
    """torch.library.opcheck on the kernel op: schema, fake implementation, autograd registration
    (its backward the backend's own), equal outputs eagerly and under AOTDispatcher."""
    keep = torch.arange(S)[None] < torch.tensor([5, 12, 1])[:, None]
    order, _, cu, _ = va.plan.padding_side(keep)
    q, k, v = (torch.randn(B * S, H, D, dtype=torch.float64)[order].requires_grad_() for _ in range(3))
    total = int(cu[-1])
    q, k, v = (torch.cat([t[:total], t.new_zeros(B * S - total, H, D)]).detach().requires_grad_() for t in (q, k, v))
    with pytest.MonkeyPatch.context() as m:  # opcheck compares outputs: no NaN rows here
        m.setattr(_OwnEntryPoints, "_past", staticmethod(lambda t, cu: torch.zeros(t.shape[0], 1, 1, dtype=torch.bool)))
        m.setattr(_OwnEntryPoints, "_lse", staticmethod(lambda inp: torch.zeros(H, B * S, dtype=torch.float64)))
        torch.library.opcheck(va.op.native_kernel_op, (q, k, v, cu, cu, S, S, D ** -0.5, _OwnEntryPoints.NAME))


@pytest.mark.parametrize("name", sorted(va.kernels.BACKENDS))
def test_the_routes_choice_of_kernel_is_a_constant_while_tracing(name):
    """Which way the route calls a backend's kernel is decided while tracing without tracing the
    capability itself (``torch``'s reads its entry points through an import dynamo cannot trace),
    for every backend, installed on this machine or not."""
    def f(x):
        va.op._traced_kernel(name)
        return x + 1

    x = torch.zeros(2)
    assert torch.equal(torch.compile(f, fullgraph=True, backend="eager")(x), x + 1)


@pytest.mark.parametrize("case", ["short", "long", "explicit"])
def test_auto_takes_the_traced_kernel_first_in_the_graph_at_short_rows(case, monkeypatch):
    """auto in compiled code at rows of at most ``kernels.TRACED_FIRST_MAX_KEYS`` keys takes the
    device class's traced kernels first (``kernels.TRACED_FIRST``; measured on Hopper: ``torch``
    before FA4), though its general order puts another first; at longer rows, the general order;
    and a backend asked for by name is never replaced. On the CPU: ``reference`` (traced) made the
    short-row pick, ahead of ``split_sdpa`` (which runs in the custom op). Equal to stock in
    every case; the outer-product block takes the custom op in every case."""
    short = case != "long"
    monkeypatch.setattr(va.kernels, "TRACED_FIRST", {"cpu": ("reference",)})
    monkeypatch.setattr(va.kernels, "TRACED_FIRST_MAX_KEYS", S if short else S - 1)
    backend = "split_sdpa" if case == "explicit" else None
    stock, model = _Model(["padding", "keys"]), va.enable_varlen(_Model(["padding", "keys"]), backend=backend)
    compiler = Recording()
    for block in model.blocks:
        block.compile(fullgraph=True, backend=compiler)
    traced = case == "short"
    for i, (lengths, image) in enumerate(LENGTHS):
        mask = _mask(lengths, image)
        va.reset_stats()
        assert_model_close(_out_and_grads(model, _x(i), mask), _out_and_grads(stock, _x(i), mask),
                           what=f"{lengths} {image}")
        # The traced kernel runs no Python of ours: only the custom op's calls are counted.
        assert va.stats()["backends"] == {"split_sdpa": 1 if traced else 2}, (lengths, image, va.stats())
    assert [ran_in_graph(g) for g in compiler.graphs[:2]] == [False, traced], compiler.graphs


def test_key_padding_plan_op_passes_opcheck():
    """torch.library.opcheck on the in-graph route's plan op: schema, fake implementation, equal
    outputs eagerly and under AOTDispatcher, for a batch-broadcast mask and one with a dead row."""
    keep = torch.arange(S)[None] < torch.tensor([5, 0, 1])[:, None]
    torch.library.opcheck(va.op.key_padding_plan_op, (keep, B))
    torch.library.opcheck(va.op.key_padding_plan_op, (keep[:1], B))


@pytest.mark.parametrize("stock_cheaper", [True, False])
def test_auto_routes_a_key_padding_block_by_cost_in_the_graph(monkeypatch, stock_cheaper):
    """Under auto, the in-graph route is routed by cost while tracing (varlen_attn.costs): where
    stock's curve is the cheaper at this length, stock's masked SDPA is traced into the graph (no
    plan op, nothing counted); where packing is, the route stays in the graph. Both equal stock."""
    from varlen_attn import costs

    monkeypatch.setitem(va.kernels.PRIORITY, "cpu", ("reference",))
    stock_ms, packed_ms = ((1.0, 10.0), (2.0, 20.0)) if stock_cheaper else ((2.0, 20.0), (1.0, 10.0))
    lay = {"tokens": [8, 64], "routes": {"sdpa:cpu": {"cost": list(stock_ms)}, "reference": {"cost": list(packed_ms)}}}
    costs.use([{"gpu": "cpu", "capability": None, "dtype": "float64", "layouts": {"key_padding": lay}}])
    try:
        stock = _Model(["keys"])
        model = va.enable_varlen(_Model(["keys"]))
        backend = Recording()
        for block in model.blocks:
            block.compile(fullgraph=True, backend=backend)
        mask = _mask((3, 6, 1))
        va.reset_stats()
        assert_model_close(_out_and_grads(model, _x(0), mask), _out_and_grads(stock, _x(0), mask), what="step")
        st = va.stats()
    finally:
        costs.use(None)
    assert st["plan_builds"] == 0 and st["host_syncs"] == 0 and not st["fallbacks"], st
    (ops,) = backend.graphs
    assert ran_in_graph(ops) is not stock_cheaper, ops
    assert any("scaled_dot_product" in o for o in ops) is stock_cheaper, ops
