"""Backend plumbing on the CPU: the FA2/FA3/FA4 and torch-builtin adapters are exercised by
injecting varlen_attn_ref under their module names; selection and diagnostics."""

import inspect
import logging
import subprocess
import sys
import types

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import varlen_attn_ref
import varlen_attn as va
from _testing import assert_matches, cases, run_with_grads, sdpa_fn
from varlen_attn import kernels
from varlen_attn.kernels import torch_varlen

ALL = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


class Recorder:
    """A flash_attn_varlen_func that checks what flash-attn would check, then runs varlen_attn_ref."""

    def __init__(self, returns_lse: bool):
        self.returns_lse = returns_lse
        self.calls = []

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw):
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        assert type(max_seqlen_q) is int and type(max_seqlen_k) is int
        assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
        self.calls.append(kw)
        # Rows past cu_seqlens[-1] (a static plan's padding) are read by no segment, as in flash-attn.
        tq, tk = int(cu_seqlens_q[-1]), int(cu_seqlens_k[-1])
        out = varlen_attn_ref.flash_attn_varlen_func(q[:tq], k[:tk], v[:tk], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                 max_seqlen_k, **kw)
        out = torch.cat([out, out.new_zeros((q.shape[0] - tq, *out.shape[1:]))])
        return (out, None) if self.returns_lse else out


@pytest.fixture
def fake_flash(monkeypatch):
    """flash_attn (FA2), flash_attn_interface (FA3) and flash_attn.cute (FA4) backed by varlen_attn_ref,
    with the backends' device/dtype declarations widened to the CPU and float64."""
    recs = {"flash_attn": Recorder(False), "flash_attn_3": Recorder(True), "flash_attn_4": Recorder(True)}
    fa2 = types.ModuleType("flash_attn.flash_attn_interface")
    fa2.flash_attn_varlen_func = recs["flash_attn"]
    parent = types.ModuleType("flash_attn")
    parent.__path__ = []
    fa3 = types.ModuleType("flash_attn_interface")
    fa3.flash_attn_varlen_func = recs["flash_attn_3"]
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = recs["flash_attn_4"]
    cute.__path__ = []
    iface = fake_fa4_interface(recs["flash_attn_4"])
    for name, mod in (("flash_attn", parent), ("flash_attn.flash_attn_interface", fa2),
                      ("flash_attn_interface", fa3), ("flash_attn.cute", cute),
                      ("flash_attn.cute.interface", iface)):
        mod.__spec__ = importlib_spec(name)
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(kernels.BACKENDS["flash_attn_4"], "_verdicts", {})  # refusals and checks of other tests
    for name in recs:
        b = kernels.BACKENDS[name]
        monkeypatch.setattr(b, "SUPPORTED_DEVICES", frozenset({"cpu"}))
        monkeypatch.setattr(b, "SUPPORTED_DTYPES", ALL)
        monkeypatch.setattr(b, "is_installed", lambda: True)
        monkeypatch.setattr(b, "installed", lambda: True)
    return recs


def fake_fa4_interface(recorder):
    """flash_attn.cute.interface's forward and backward entry points (what the fused path calls),
    over varlen_attn_ref: forward returns (out, lse, ...); backward differentiates varlen_attn_ref."""
    iface = types.ModuleType("flash_attn.cute.interface")

    def _used(q, cu_seqlens_q, seqused_q):
        """Which query rows the kernel computes: those in a segment, within its ``seqused_q``."""
        rows = torch.arange(q.shape[0])
        seg = torch.searchsorted(cu_seqlens_q[1:].long(), rows, right=True)
        used = rows < int(cu_seqlens_q[-1])
        if seqused_q is not None:
            start = cu_seqlens_q[:-1].long()[seg.clamp(max=len(cu_seqlens_q) - 2)]
            used &= rows - start < seqused_q.long()[seg.clamp(max=len(cu_seqlens_q) - 2)]
        return used

    def _into(buffer, like, values, rows):
        """As the real kernel writes: ``values`` into ``rows`` of the buffer it was handed, every
        other row as it was; without one, a new tensor with NaN (what it likes) elsewhere."""
        out = torch.full_like(like, float("nan")) if buffer is None else buffer
        out[rows] = values[rows]
        return out

    def _flash_attn_fwd(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                        causal, return_lse, seqused_q=None, out=None, lse=None):
        assert return_lse and cu_seqlens_q.dtype == torch.int32 and type(max_seqlen_q) is int
        assert seqused_q is None or seqused_q.dtype == torch.int32
        recorder.calls.append({"softmax_scale": softmax_scale, "causal": causal, "entry": "fwd",
                               "seqused_q": seqused_q is not None, "out": out is not None and lse is not None})
        tq, tk = int(cu_seqlens_q[-1]), int(cu_seqlens_k[-1])  # rows past them: read by no segment
        o, lse_, _ = varlen_attn_ref.flash_attn_varlen_func(
            q[:tq], k[:tk], v[:tk], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            softmax_scale=softmax_scale, causal=causal, return_attn_probs=True)
        assert lse_.shape == (q.shape[1], tq) and lse_.dtype == torch.float32
        rest = q.shape[0] - tq
        o = torch.cat([o, o.new_zeros((rest, *o.shape[1:]))])
        lse_ = torch.nn.functional.pad(lse_, (0, rest))
        used = _used(q, cu_seqlens_q, seqused_q)
        lse = _into(None if lse is None else lse.T, lse_.T, lse_.T, used).T  # rows are its columns
        return (_into(out, o, o, used), lse, None, None, None)

    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale, causal, *, cu_seqlens_q, cu_seqlens_k,
                        max_seqlen_q, max_seqlen_k, seqused_q=None, dq=None, dk=None, dv=None):
        assert out.shape == dout.shape == q.shape[:2] + v.shape[-1:] and lse.shape == (q.shape[1], q.shape[0])
        recorder.calls.append({"softmax_scale": softmax_scale, "causal": causal, "entry": "bwd",
                               "seqused_q": seqused_q is not None, "grads": dq is not None})
        # The real entry point computes gradients itself; this fake differentiates varlen_attn_ref,
        # so inside the compiled custom op it needs autograd's dispatch keys back, and under
        # inference_mode to be off, with normal copies of its inputs.
        from varlen_attn.op import _autograd_dispatch

        tq, tk = int(cu_seqlens_q[-1]), int(cu_seqlens_k[-1])
        used = _used(q, cu_seqlens_q, seqused_q)
        with torch.inference_mode(False), _autograd_dispatch(), torch.enable_grad():
            qd, kd, vd, g, cu_seqlens_q, cu_seqlens_k = (
                t.clone() for t in (q[:tq], k[:tk], v[:tk], dout.masked_fill(~used[:, None, None], 0)[:tq],
                                    cu_seqlens_q, cu_seqlens_k))
            qd, kd, vd = (t.requires_grad_() for t in (qd, kd, vd))
            o = varlen_attn_ref.flash_attn_varlen_func(qd, kd, vd, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                   max_seqlen_k, softmax_scale=softmax_scale, causal=causal)
            grads = torch.autograd.grad(o, (qd, kd, vd), g)
        # Past the last segment (and in skipped query rows) the real kernel writes nothing.
        grads = [torch.cat([g, g.new_zeros((t.shape[0] - g.shape[0], *g.shape[1:]))]) for g, t in zip(grads, (q, k, v))]
        keys = torch.arange(k.shape[0]) < tk
        return tuple(_into(buf, t, g, rows) for buf, t, g, rows in
                     zip((dq, dk, dv), (q, k, v), grads, (used, keys, keys)))

    iface._flash_attn_fwd, iface._flash_attn_bwd = _flash_attn_fwd, _flash_attn_bwd
    return iface


def importlib_spec(name):
    import importlib.machinery

    return importlib.machinery.ModuleSpec(name, None)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=cases(kinds=("key_padding", "joint_text_first", "outer", "cross", "segments", "none"),
                  reps=("bool", "neg_inf"), head_dims=(8, 16, 64)),
       name=st.sampled_from(["flash_attn", "flash_attn_3", "flash_attn_4"]))
def test_flash_adapters_equal_sdpa(fake_flash, case, name):
    note(repr(case))
    if case.v.shape[-1] != case.q.shape[-1]:
        case.v = case.v[..., : case.q.shape[-1]].contiguous() if case.v.shape[-1] > case.q.shape[-1] else \
            torch.cat([case.v] * (case.q.shape[-1] // case.v.shape[-1]), -1)
    if name == "flash_attn_4" and case.q.shape[-1] < 32:  # declared: wrong dq measured at 16
        with pytest.raises(va.BackendUnavailableError, match="head dim"):
            va.scaled_dot_product_attention(case.q, case.k, case.v, case.mask, enable_gqa=case.gqa, backend=name)
        return
    ref = run_with_grads(sdpa_fn(case, torch.float64), case, torch.float64)
    before = len(fake_flash[name].calls)
    got = run_with_grads(lambda q, k, v: va.scaled_dot_product_attention(
        q, k, v, case.mask, enable_gqa=case.gqa, backend=name, strict=True), case, torch.float64)
    assert_matches(got, ref, ref, torch.float64)
    calls = fake_flash[name].calls[before:]
    # No call at all only when every query is masked (nothing for a kernel to do).
    assert calls or (case.mask is not None and not case.keep.any())
    assert all(c["softmax_scale"] == case.q.shape[-1] ** -0.5 for c in calls)
    if name == "flash_attn_4" and calls:  # FA4 runs fused: its own forward and backward entries
        assert [c["entry"] for c in calls] == ["fwd", "bwd"]


@pytest.mark.parametrize("layout", ["key_padding", "outer"])
def test_fa4_writes_into_zeros_and_skips_dead_elements(fake_flash, layout, monkeypatch):
    """FA4 (``INTO_ZEROS``) is handed zeros to write its output and gradients into, and
    ``seqused_q`` skips the queries of an element with no valid key: that element's rows stay
    zeros, the padding's twins past the last segment stay zeros, so unpacking is gathers alone
    (no ``masked_fill`` or ``index_copy`` in the key-padding call), and every output and
    gradient equals masked SDPA. The fake leaves NaN in any row it was not handed a buffer for and
    did not write, as the real kernel leaves what it likes there."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    iface = sys.modules["flash_attn.cute.interface"]
    for entry in ("_flash_attn_fwd", "_flash_attn_bwd"):  # the kernel's own ops are not counted
        def quiet(*args, _f=getattr(iface, entry), **kwargs):
            with _disable_current_modes():
                return _f(*args, **kwargs)

        monkeypatch.setattr(iface, entry, quiet)
    keep = torch.tensor([[1, 1, 0, 1, 0, 1, 1], [0] * 7, [0, 1, 1, 1, 1, 0, 1]], dtype=torch.bool)
    mask = keep[:, None, None, :] if layout == "key_padding" else keep[:, None, :, None] & keep[:, None, None, :]
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, 2, 7, 32, dtype=torch.float64, generator=g) for _ in range(3))
    weights = torch.randn(3, 2, 7, 32, dtype=torch.float64, generator=g)

    def grads(fn):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = fn(qq, kk, vv)
        (out * weights).sum().backward()
        return [out.detach(), qq.grad, kk.grad, vv.grad]

    class Ops(TorchDispatchMode):
        names: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if args and isinstance(args[0], torch.Tensor) and args[0].dim() > 1:  # on tokens, not per element
                self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    ref = grads(lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, attn_mask=mask))
    before = len(fake_flash["flash_attn_4"].calls)
    with Ops() as ops:
        got = grads(lambda a, b, c: va.scaled_dot_product_attention(a, b, c, mask, backend="flash_attn_4", strict=True))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    calls = fake_flash["flash_attn_4"].calls[before:]
    assert [(c["entry"], c["seqused_q"], c.get("out", c.get("grads"))) for c in calls] == [
        ("fwd", True, True), ("bwd", True, True)]
    if layout == "key_padding":
        assert not [n for n in ops.names if "masked_fill" in n or "index_copy" in n], ops.names


def test_fused_equals_composed(fake_flash):
    """FA4's one-node route (varlen_attn.fused) gives the composed route's results exactly
    (pack_qkv, the backend's autograd forward, unpack: the route of backends without a backward)."""
    import dataclasses

    from varlen_attn import execution
    from varlen_attn.policy import Policy

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 9, 2, 32, dtype=torch.float64, generator=g) for _ in range(3))
    keep = torch.tensor([[1] * 9, [0, 1, 1, 0, 1, 1, 1, 1, 0], [0] * 9], dtype=torch.bool)
    opts = execution.Options()
    for mask in (keep, keep[:, None, :, None] & keep[:, None, None, :]):
        plan = va.build_plan(mask)
        fused = execution.route(q, k, v, plan, None, opts, Policy.of("flash_attn_4"))
        assert fused.fused
        results = []
        for r in (fused, dataclasses.replace(fused, fused=False)):
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            out = execution.run(qq, kk, vv, plan, None, r, opts)
            (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out).sin()).sum().backward()
            results.append([out.detach(), qq.grad, kk.grad, vv.grad])
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


def test_fused_backward_lets_each_packed_gradient_go_once_scattered(monkeypatch):
    """Peak memory: the fused backward drops each packed gradient the kernel returned as soon as
    it is scattered to its padded form, so the padded dk is made without the packed dq alive, and
    the padded dv without dq or dk; the padded gradients are the scatters of the packed ones."""
    import weakref

    from varlen_attn import fused
    from varlen_attn.kernels import VarlenInputs

    keep = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]], dtype=torch.bool)
    plan = va.build_plan(keep[:, None, :, None] & keep[:, None, None, :])
    g = torch.Generator().manual_seed(0)
    refs, copies = [], []

    class Kernel:  # a backward that returns three new packed gradients
        INTO_ZEROS = False

        def backward(self, inp, out, lse, dout):
            grads = tuple(torch.randn(plan.total_q, 2, 8, generator=g) for _ in range(3))
            refs.extend(weakref.ref(t) for t in grads)
            copies.extend(t.clone() for t in grads)
            return grads

    alive = []
    scatter = fused.scatter_packed

    def spy(y, plan_, which, zeros=False):
        alive.append([r() is not None for r in refs])
        return scatter(y, plan_, which, zeros)

    monkeypatch.setattr(fused, "scatter_packed", spy)
    packed = [torch.randn(plan.total_q, 2, 8, generator=g) for _ in range(3)]
    got = fused.packed_backward(Kernel(), VarlenInputs(*packed, plan, 1.0, False), packed[0],
                                torch.zeros(2, plan.total_q), torch.randn(2, 4, 2, 8, generator=g))
    assert alive == [[True, True, True], [False, True, True], [False, False, True]]
    assert all(r() is None for r in refs)
    for t, c, which in zip(got, copies, "qkk"):
        assert torch.equal(t, scatter(c, plan, which))


def test_flash_adapters_pass_causal_and_dropout(fake_flash):
    q = k = v = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    va.scaled_dot_product_attention(q, k, v, is_causal=True, backend="flash_attn_3")
    assert fake_flash["flash_attn_3"].calls[-1]["causal"] is True
    torch.manual_seed(0)
    va.scaled_dot_product_attention(q, k, v, dropout_p=0.25, backend="flash_attn")
    assert fake_flash["flash_attn"].calls[-1]["dropout_p"] == 0.25
    for name in ("flash_attn_3", "flash_attn_4"):  # no dropout: refuse, never ignore it
        with pytest.raises(va.BackendUnavailableError, match="dropout not supported"):
            va.scaled_dot_product_attention(q, k, v, dropout_p=0.25, backend=name)


def test_fa4_refuses_head_dims_it_cannot_run(fake_flash):
    q = k = v = torch.randn(1, 1, 4, 36, dtype=torch.float64)
    with pytest.raises(va.BackendUnavailableError, match="not a multiple of 8"):
        va.scaled_dot_product_attention(q, k, v, backend="flash_attn_4")
    q = k = v = torch.randn(1, 1, 4, 16, dtype=torch.float64)
    with pytest.raises(va.BackendUnavailableError, match="head dim 16 < 32"):
        va.scaled_dot_product_attention(q, k, v, backend="flash_attn_4")


def _fake_varlen(signature: str):
    """torch.nn.attention.varlen.varlen_attn as shipped in torch 2.11 or 2.13, over varlen_attn_ref."""
    seen = {}

    def ref(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, causal):
        tq, tk = int(cu_seq_q[-1]), int(cu_seq_k[-1])  # rows past them: read by no segment
        out = varlen_attn_ref.flash_attn_varlen_func(query[:tq], key[:tk], value[:tk], cu_seq_q, cu_seq_k, max_q, max_k,
                                                 softmax_scale=scale, causal=causal)
        return torch.cat([out, out.new_zeros((query.shape[0] - tq, *out.shape[1:]))])

    def v211(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None,
             scale=None):
        seen.update(is_causal=is_causal)
        return ref(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, is_causal)

    def v213(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
             window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        seen.update(window_size=window_size, enable_gqa=enable_gqa)
        assert query.shape[1] == key.shape[1] or enable_gqa
        return ref(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size == (-1, 0))

    fn = v211 if signature == "2.11" else v213
    return fn, frozenset(inspect.signature(fn).parameters), seen


@pytest.mark.parametrize("signature", ["2.11", "2.13"])
def test_torch_builtin_adapter_both_signatures(monkeypatch, signature):
    fn, params, seen = _fake_varlen(signature)
    monkeypatch.setattr(torch_varlen, "_api", lambda: (fn, params))
    # The public function's adapter (the kernel's own entry points run on CUDA only: GPU suite).
    monkeypatch.setattr(torch_varlen, "_entry_points", lambda: None)
    b = kernels.BACKENDS["torch"]
    # installed() caches per process: set it here so it is undone after (torch < 2.10 has no API).
    monkeypatch.setitem(b.__dict__, "_installed", True)
    monkeypatch.setattr(b, "SUPPORTED_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(b, "SUPPORTED_DTYPES", ALL)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64, generator=g)
    k = torch.randn(2, 2, 6, 8, dtype=torch.float64, generator=g)
    v = torch.randn(2, 2, 6, 8, dtype=torch.float64, generator=g)
    keep = torch.tensor([[1, 1, 0, 1, 1, 1], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    m = keep[:, None, :, None] & keep[:, None, None, :]
    for causal in (False, True):
        mask = m & torch.ones(6, 6, dtype=torch.bool).tril() if causal else m
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        if signature == "2.11":  # no GQA in 2.11's API: the backend must say so, not crash
            with pytest.raises(va.BackendUnavailableError, match="grouped-query"):
                va.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), m,
                              is_causal=causal, enable_gqa=True, backend="torch")
            kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
            out = va.attention(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), m,
                               is_causal=causal, backend="torch").transpose(1, 2)
            assert seen["is_causal"] is causal
        else:
            out = va.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), m,
                               is_causal=causal, enable_gqa=True, backend="torch").transpose(1, 2)
            assert seen["window_size"] == ((-1, 0) if causal else (-1, -1)) and seen["enable_gqa"]
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_explicit_uninstalled_backend_lists_reasons():
    q = k = v = torch.randn(1, 1, 4, 8)
    for name in ("flash_attn", "flash_attn_3", "flash_attn_4", "torch"):
        with pytest.raises(va.BackendUnavailableError, match=rf"backend '{name}' cannot run q \(4, 1, 8\)") as e:
            va.scaled_dot_product_attention(q, k, v, torch.ones(4, dtype=torch.bool), backend=name)
        assert "device cpu not in ['cuda']" in str(e.value)


def test_auto_priorities(monkeypatch):
    assert kernels.priority(torch.device("cpu"))[0] == "split_sdpa"
    hopper = kernels.PRIORITY["cuda_sm90"]
    assert hopper.index("flash_attn_4") < hopper.index("torch") < hopper.index("split_sdpa")
    assert kernels.PRIORITY["cuda"][0] == "flash_attn"
    assert set(hopper) == set(kernels.BACKENDS)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(kernels, "_cuda_class", lambda index: "cuda_sm90")
    assert kernels.priority(torch.device("cuda")) == hopper
    q = k = v = torch.randn(1, 1, 4, 8)
    va.reset_stats()
    va.scaled_dot_product_attention(q, k, v, torch.tensor([True, False, True, True]))
    assert va.stats()["backends"] == {"split_sdpa": 1}


def test_float32_routes_to_a_backend_that_supports_it():
    reasons = kernels.BACKENDS["flash_attn"].not_supported_reasons(kernels.VarlenInputs(
        torch.randn(3, 1, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8), va.plan_from_seqlens([3]), 1.0))
    assert any("dtype torch.float32" in r for r in reasons)


def test_import_never_imports_flash_attn():
    code = "import sys, varlen_attn; assert not [m for m in sys.modules if m.startswith(('flash_attn', 'varlen_attn_ref'))], sys.modules.keys()"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_one_warning_per_distinct_fallback_reason(caplog):
    va.reset_stats()
    q = k = v = torch.randn(1, 1, 4, 8)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    bias = torch.tensor([0.0, 1.0, 0.0, 1.0])
    with caplog.at_level(logging.WARNING, logger="varlen_attn"):
        for _ in range(5):
            va.scaled_dot_product_attention(q, k, v, causal)
            va.scaled_dot_product_attention(q, k, v, bias)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert sorted(va.stats()["fallbacks"].values()) == [5, 5]
    assert va.stats()["backends"] == {"sdpa": 10}


def test_compiled_op_runs_native_backward(fake_flash):
    """Under torch.compile a backend with its own backward (FA4's entry points, faked) runs them
    inside the custom op, re-gathering in backward; results equal the eager fused path."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, 9, 2, 32, dtype=torch.float64, generator=g) for _ in range(3))
    keep = torch.tensor([[1] * 9, [0, 1, 1, 0, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    plan = va.build_plan(keep)
    compiled = torch.compile(lambda a, b, c: va.attention(a, b, c, plan=plan, backend="flash_attn_4"),
                             fullgraph=True, backend="aot_eager")
    results = []
    for fn in (compiled, lambda a, b, c: va.attention(a, b, c, plan=plan, backend="flash_attn_4")):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        before = len(fake_flash["flash_attn_4"].calls)
        out = fn(qq, kk, vv)
        (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out).cos()).sum().backward()
        assert [c["entry"] for c in fake_flash["flash_attn_4"].calls[before:]] == ["fwd", "bwd"]
        results.append([out.detach(), qq.grad, kk.grad, vv.grad])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
    torch._dynamo.reset()


# ----------------------------------------------------------------- what the installed FA4 refuses


def _fa4_first(monkeypatch):
    """auto on the CPU tries flash_attn_4 (the fake) first, as on Hopper."""
    monkeypatch.setitem(kernels.PRIORITY, "cpu", ("flash_attn_4", *kernels.PRIORITY["cpu"]))


def _batch(seed=0, d=32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(3, 2, 9, d, dtype=torch.float64, generator=g) for _ in range(3))
    keep = torch.tensor([[1] * 9, [1, 1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    return q, k, v, keep[:, None, None, :]


def _refusing(monkeypatch, entry: str, message: str, head_dim: int):
    """FA4's ``entry`` ("_flash_attn_fwd" or "_flash_attn_bwd") raising its own assert for calls of
    head dim ``head_dim``, as flash-attn-4 does for a GPU or head dim it does not support."""
    iface = sys.modules["flash_attn.cute.interface"]
    real = getattr(iface, entry)
    refused = []

    def entry_point(q, *args, **kw):
        if q.shape[-1] == head_dim:
            refused.append(q.shape)
            raise AssertionError(message)
        return real(q, *args, **kw)

    monkeypatch.setattr(iface, entry, entry_point)
    return refused


FA4_SAYS = "Unsupported compute capability. Supported: 9.x, 10.x, 11.x, 12.x"


def test_auto_runs_a_call_flash_attn_4_refuses_on_the_next_backend(fake_flash, monkeypatch):
    """flash-attn-4's own check refuses a kind of call (here its forward, by head dim): under auto
    that call runs on the next backend, equal to masked SDPA; calls of that kind skip FA4 from then
    on, with FA4's words as the reason; other kinds still run on it."""
    _fa4_first(monkeypatch)
    refused = _refusing(monkeypatch, "_flash_attn_fwd", FA4_SAYS, 32)
    q, k, v, mask = _batch()
    va.reset_stats()
    for _ in range(2):  # the second call: the refusal is remembered, FA4 not asked again
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = va.scaled_dot_product_attention(*leaves, mask)
        grads = torch.autograd.grad(out.square().sum(), leaves)
        ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = torch.nn.functional.scaled_dot_product_attention(*ref_leaves, mask)
        ref_grads = torch.autograd.grad(ref.square().sum(), ref_leaves)
        for a, b in zip((out, *grads), (ref, *ref_grads)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert len(refused) == 1
    assert va.stats()["backends"] == {"split_sdpa": 2}
    from varlen_attn.kernels import VarlenInputs

    reasons = kernels.BACKENDS["flash_attn_4"].not_supported_reasons(
        VarlenInputs(q.transpose(1, 2)[0], k.transpose(1, 2)[0], v.transpose(1, 2)[0], va.plan_from_seqlens([9]),
                     32 ** -0.5))
    assert any(FA4_SAYS in r and "refused" in r for r in reasons), reasons
    q64, k64, v64, _ = _batch(d=64)  # another head dim: FA4 still runs it
    va.reset_stats()
    va.scaled_dot_product_attention(q64, k64, v64, mask)
    assert va.stats()["backends"] == {"flash_attn_4": 1}


def test_an_explicit_flash_attn_4_refused_by_flash_attn_4_raises_its_words(fake_flash, monkeypatch):
    """backend="flash_attn_4" never falls back: FA4's refusal raises KernelRefusedError (a
    BackendUnavailableError) naming the backend, the call and FA4's own message."""
    _refusing(monkeypatch, "_flash_attn_fwd", FA4_SAYS, 32)
    q, k, v, mask = _batch()
    with pytest.raises(va.KernelRefusedError, match=r"flash-attn-4 .*refused q \(27, 2, 32\).*in its forward: "
                       r"AssertionError: Unsupported compute capability") as e:
        va.scaled_dot_product_attention(q, k, v, mask, backend="flash_attn_4")
    assert isinstance(e.value, va.BackendUnavailableError)
    with pytest.raises(va.BackendUnavailableError, match="Unsupported compute capability"):  # and again, from selection
        va.scaled_dot_product_attention(q, k, v, mask, backend="flash_attn_4")


def test_a_backward_flash_attn_4_refuses_raises_clearly_and_the_next_step_skips_it(fake_flash, monkeypatch):
    """FA4 ran the forward and refuses the backward (flash-attn-4 4.0.0b36 declares its backward
    for fewer GPUs than its forward): the backward raises KernelRefusedError with FA4's words,
    and the next call of that kind under auto, with the same plan, runs on the next backend."""
    _fa4_first(monkeypatch)
    _refusing(monkeypatch, "_flash_attn_bwd", "Unsupported compute capability. Supported: 9.x", 32)
    q, k, v, mask = _batch()
    plan = va.build_plan(mask)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = va.attention(*(t.transpose(1, 2) for t in leaves), plan=plan)
    with pytest.raises(va.KernelRefusedError, match="in its backward: AssertionError: Unsupported compute"):
        out.sum().backward()
    va.reset_stats()
    out = va.attention(*(t.transpose(1, 2) for t in leaves), plan=plan)
    out.sum().backward()
    assert va.stats()["backends"] == {"split_sdpa": 1}


@pytest.mark.parametrize("caller", ["eager", "inference_mode", "compiled"])
@pytest.mark.parametrize("wrong", [None, "dq"])
def test_flash_attn_4_on_an_unmeasured_gpu_is_checked_against_float32_math_first(fake_flash, monkeypatch, wrong,
                                                                                caller):
    """Where FA4's support was not measured here (any GPU but Hopper), the first call of each kind
    first runs FA4's forward and backward on 64 tokens against float32 math: a kind it computes
    wrong (here a dq off by 2x) is a reason against it, and auto runs the next backend. The
    check needs no autograd: it holds under inference_mode and inside a compiled caller's op."""
    from varlen_attn.kernels import flash

    monkeypatch.setattr(flash, "_FORCE_CHECK", True)
    _fa4_first(monkeypatch)
    iface = sys.modules["flash_attn.cute.interface"]
    if wrong:
        real_bwd = iface._flash_attn_bwd

        def bwd(*args, **kw):
            dq, dk, dv = real_bwd(*args, **kw)
            return dq * 2, dk, dv

        monkeypatch.setattr(iface, "_flash_attn_bwd", bwd)
    q, k, v, mask = _batch()
    before = len(fake_flash["flash_attn_4"].calls)
    va.reset_stats()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask)
    call = va.scaled_dot_product_attention
    if caller == "compiled":
        torch._dynamo.reset()
        call = torch.compile(va.scaled_dot_product_attention, backend="aot_eager", fullgraph=True)
    for _ in range(2):
        if caller == "inference_mode":
            with torch.inference_mode():
                out = call(q, k, v, mask)
        else:
            out = call(q, k, v, mask)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    checks = [c["entry"] for c in fake_flash["flash_attn_4"].calls[before:]]
    if wrong:
        assert checks == ["fwd", "bwd"]  # the check, once; the calls ran elsewhere
        assert va.stats()["backends"] == {"split_sdpa": 2}
        with pytest.raises(va.BackendUnavailableError, match="computed a wrong dq in a check"):
            va.scaled_dot_product_attention(q, k, v, mask, backend="flash_attn_4")
    else:
        assert checks == ["fwd", "bwd", "fwd", "fwd"]  # the check, then both calls on FA4
        assert va.stats()["backends"] == {"flash_attn_4": 2}


def test_auto_runs_a_refused_call_on_the_next_backend_in_a_compiled_caller(fake_flash, monkeypatch):
    """The same inside a torch.compile'd caller (varlen_attn's custom op chooses the backend when
    it runs): the refused call runs on the next backend, equal to masked SDPA with gradients."""
    _fa4_first(monkeypatch)
    refused = _refusing(monkeypatch, "_flash_attn_fwd", FA4_SAYS, 32)
    q, k, v, mask = _batch(seed=1)
    plan = va.build_plan(mask)
    fn = torch.compile(lambda a, b, c: va.attention(a, b, c, plan=plan), backend="aot_eager", fullgraph=True)
    leaves = [t.transpose(1, 2).clone().requires_grad_() for t in (q, k, v)]
    va.reset_stats()
    out = fn(*leaves)
    grads = torch.autograd.grad(out.square().sum(), leaves)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_leaves, mask)
    ref_grads = torch.autograd.grad(ref.square().sum(), ref_leaves)
    torch.testing.assert_close(out.transpose(1, 2), ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.transpose(1, 2), b, rtol=1e-10, atol=1e-12)
    assert len(refused) == 1 and "flash_attn_4" not in va.stats()["backends"]


def test_the_checks_float32_math_equals_sdpa_with_autograd():
    """The check compares FA4 with attention and its gradients written out (no autograd, so it
    runs under inference_mode and inside custom ops): equal to SDPA differentiated by autograd
    in float64, per segment, with grouped-query heads and causal."""
    from varlen_attn.kernels.flash import attention_math

    g = torch.Generator().manual_seed(5)
    bounds = [0, 7, 12, 20]
    for hq, hk, causal in ((4, 4, False), (4, 2, True), (6, 1, False)):
        q = torch.randn(20, hq, 16, dtype=torch.float64, generator=g)
        k, v = (torch.randn(20, hk, 16, dtype=torch.float64, generator=g) for _ in range(2))
        dout = torch.randn(20, hq, 16, dtype=torch.float64, generator=g)
        got = attention_math(q, k, v, dout, bounds, 0.3, causal)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        outs = []
        for a, b in zip(bounds, bounds[1:]):
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in leaves)
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, scale=0.3, is_causal=causal, enable_gqa=hq != hk).transpose(0, 1))
        want = torch.cat(outs)
        want_grads = torch.autograd.grad(want, leaves, dout)
        for a, b in zip(got, (want, *want_grads)):
            torch.testing.assert_close(a, b.float(), rtol=1e-5, atol=1e-5)


def test_a_refusal_stored_during_a_check_is_not_overwritten(fake_flash, monkeypatch):
    """Two threads: one checks a kind while another's real call of that kind is refused. The
    refusal stays (a check that passed does not erase it), so the refused thread's retry under
    auto does not pick FA4 again."""
    from varlen_attn.kernels import VarlenInputs, flash

    fa4 = kernels.BACKENDS["flash_attn_4"]
    monkeypatch.setattr(flash, "_FORCE_CHECK", True)
    q, k, v, _ = _batch()
    inp = VarlenInputs(q.transpose(1, 2)[0], k.transpose(1, 2)[0], v.transpose(1, 2)[0], va.plan_from_seqlens([9]),
                       32 ** -0.5)

    def check_while_another_call_is_refused(self_inp):
        fa4._refused(self_inp, "forward", AssertionError(FA4_SAYS))
        return None  # the check itself passed

    monkeypatch.setattr(fa4, "_check", check_while_another_call_is_refused)
    assert FA4_SAYS in fa4._verdict(inp)
    assert any(FA4_SAYS in r for r in fa4.not_supported_reasons(inp))


def test_a_bare_assert_of_flash_attn_4_is_named_by_its_condition(tmp_path, monkeypatch):
    """FA4 asserts some inputs without a message; the refusal then names the failed condition."""
    import importlib

    from varlen_attn.kernels.flash import _first_line

    (tmp_path / "fa4_like.py").write_text("def check(k):\n    assert k.shape == (3, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # a module pytest does not rewrite: a bare assert
    try:
        importlib.import_module("fa4_like").check(torch.zeros(2))
    except AssertionError as e:
        text = _first_line(e)
    assert text == "AssertionError at fa4_like.py:2: assert k.shape == (3, 2)", text


def test_a_refusal_of_flash_attn_4_inside_a_compiled_blocks_graph_reruns_that_block_on_the_next_backend(
        fake_flash, monkeypatch):
    """In blocks compiled on their own, auto's FA4 runs inside the graph (an opaque op chosen when
    the block was traced). When FA4 refuses there, the block's boundary runs the call again on
    the general route, where selection reads the refusal: the step completes on the next backend,
    equal to stock, and stats() counts only what ran."""
    from _testing import Recording, assert_model_close
    from test_in_graph import N, _mask, _Model, _out_and_grads, _x

    torch._dynamo.reset()
    _fa4_first(monkeypatch)
    monkeypatch.setattr(kernels.BACKENDS["flash_attn_4"], "MIN_HEAD_DIM", 8)  # the test model's head dim
    refused = _refusing(monkeypatch, "_flash_attn_fwd", FA4_SAYS, 8)
    stock, model = _Model(["padding", "keys"]), va.enable_varlen(_Model(["padding", "keys"]))
    for block in model.blocks:
        block.compile(fullgraph=True, backend=Recording())
    for i in range(2):
        va.reset_stats()
        got = _out_and_grads(model, _x(i), _mask((3, 6, 1), N))
        assert_model_close(got, _out_and_grads(stock, _x(i), _mask((3, 6, 1), N)), what=f"step {i}")
        assert "flash_attn_4" not in va.stats()["backends"], va.stats()
    assert len(refused) == 1
    torch._dynamo.reset()
