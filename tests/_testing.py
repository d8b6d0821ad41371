"""Shared test helpers: hypothesis strategies for masks of every kind, data-derived checks (the
property tests' :func:`assert_matches`, the model tests' :func:`assert_model_close`), and
:class:`CountSyncs`. The tiny diffusers models live in ``_models.py``.

A case draws the *structure* (shapes, lengths, which tokens are valid, the mask's kind,
representation and layout) from hypothesis, and the tensor *values* from a seeded generator,
so shrinking works on structure and the values stay random.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

PACKABLE_KINDS = ("none", "key_padding", "prefix", "joint_text_first", "joint_image_first",
                  "outer", "cross", "segments", "all_masked")
UNPACKABLE_KINDS = ("random", "causal", "bias01", "per_head")
REPS = ("bool", "neg_inf", "neg_10000", "finfo_min")
# Kinds whose masks are mostly one segment per batch element (what a static plan holds; a row
# of -10000 in an outer product attends every key, and is not).
STATIC_KINDS = ("key_padding", "prefix", "joint_text_first", "joint_image_first", "outer", "cross", "all_masked")


def one_segment(keep: torch.Tensor) -> bool:
    """Brute-force oracle of what a static plan holds: every head equal, and in each batch
    element all query rows that attend something attend the same keys."""
    if not bool((keep == keep[:, :1]).all()):
        return False
    return all(len({tuple(r.tolist()) for r in keep[b, 0] if r.any()}) <= 1 for b in range(keep.shape[0]))


@dataclass
class Case:
    kind: str
    rep: str
    q: torch.Tensor  # [B, Hq, Sq, D]
    k: torch.Tensor  # [B, Hkv, Sk, D]
    v: torch.Tensor  # [B, Hkv, Sk, Dv]
    mask: torch.Tensor | None  # torch-convention mask (SDPA broadcasting)
    model_mask: torch.Tensor | None  # batch-first mask for varlen_attn.attention
    keep: torch.Tensor | None  # [B, H, Sq, Sk] bool meaning of the mask
    gqa: bool
    seed: int

    def __repr__(self):
        return (f"Case(kind={self.kind}, rep={self.rep}, q={tuple(self.q.shape)}, k={tuple(self.k.shape)}, "
                f"v={tuple(self.v.shape)}, mask={None if self.mask is None else tuple(self.mask.shape)}, "
                f"gqa={self.gqa}, seed={self.seed})")

    def _repr_pretty_(self, p, cycle):  # hypothesis' failure report: no tensor dumps
        p.text(repr(self))


def _key_keep(draw, kind: str, b: int, sk: int, g: torch.Generator) -> torch.Tensor:
    """[B, Sk] valid keys for the key-level kinds."""
    if kind == "key_padding":
        p = draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
        keep = torch.rand(b, sk, generator=g) >= p
    elif kind in ("prefix", "cross"):
        lens = draw(st.lists(st.integers(0, sk), min_size=b, max_size=b))
        keep = torch.arange(sk)[None, :] < torch.tensor(lens)[:, None]
    elif kind in ("joint_text_first", "joint_image_first"):
        t = draw(st.integers(1, max(1, sk - 1)))
        lens = draw(st.lists(st.integers(0, t), min_size=b, max_size=b))
        text = torch.arange(t)[None, :] < torch.tensor(lens)[:, None]
        image = torch.ones(b, sk - t, dtype=torch.bool)
        keep = torch.cat([text, image] if kind == "joint_text_first" else [image, text], dim=1)
    else:  # all_masked
        keep = torch.zeros(b, sk, dtype=torch.bool)
    return keep


def _represent(keep: torch.Tensor, rep: str, dtype: torch.dtype) -> torch.Tensor:
    if rep == "bool":
        return keep
    neg = {"neg_inf": float("-inf"), "neg_10000": -10000.0, "finfo_min": torch.finfo(dtype).min}[rep]
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, neg)


@st.composite
def cases(draw, dtype=torch.float64, kinds=PACKABLE_KINDS, reps=REPS, max_s=24, head_dims=(8, 16, 24, 40, 64, 128, 256)):
    kind = draw(st.sampled_from(kinds))
    b = draw(st.integers(1, 3))
    hkv = draw(st.integers(1, 3))
    gqa = draw(st.booleans())
    hq = hkv * draw(st.integers(2, 3)) if gqa else hkv
    sk = draw(st.integers(1, max_s))
    sq = draw(st.integers(1, max_s)) if kind == "cross" else sk
    d = draw(st.sampled_from(head_dims))
    dv = draw(st.sampled_from([d, 8])) if d != 8 else d
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    rep = draw(st.sampled_from(reps))

    keep = None  # [B, 1|H, Sq, Sk]
    if kind in ("key_padding", "prefix", "joint_text_first", "joint_image_first", "cross", "all_masked"):
        keep = _key_keep(draw, kind, b, sk, g)[:, None, None, :].expand(b, 1, sq, sk)
    elif kind == "outer":
        m = _key_keep(draw, draw(st.sampled_from(["key_padding", "joint_text_first", "prefix"])), b, sk, g)
        keep = (m[:, None, :, None] & m[:, None, None, :])
    elif kind == "segments":
        nseg = draw(st.integers(1, 4))
        ids = torch.randint(-1, nseg, (b, sk), generator=g)
        keep = ((ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0))[:, None]
    elif kind == "random":
        keep = (torch.rand(b, 1, sq, sk, generator=g) > 0.5)
    elif kind == "causal":
        keep = torch.ones(sq, sk, dtype=torch.bool).tril().expand(b, 1, sq, sk)
    elif kind == "per_head":
        keep = torch.rand(b, hq, 1, sk, generator=g) > 0.5
        keep = keep.expand(b, hq, sq, sk)

    # finfo.min on a row with no valid key: SDPA's scores vanish in rounding (see README).
    if rep == "finfo_min" and keep is not None and not keep.any(-1).all():
        rep = "neg_10000"
    mask = model_mask = None
    if kind == "bias01":
        mask = (torch.rand(b, 1, sq, sk, generator=g) > 0.5).to(dtype)
        model_mask = mask
    elif keep is not None:
        form = draw(st.sampled_from(["b1sk", "bhsk", "full"]))
        keep_b = keep.expand(b, keep.shape[1], sq, sk)
        if keep.shape[2] == sq and kind not in ("outer", "segments", "random", "causal") and form == "b1sk":
            m4 = keep_b[:, :, :1]  # [B, 1|H, 1, Sk]
        elif form == "bhsk":
            m4 = keep_b.expand(b, hq, sq, sk)
        else:
            m4 = keep_b
        mask = _represent(m4.contiguous(), rep, dtype)
        model_mask = mask
        if m4.shape[1] == 1 and m4.shape[2] == 1 and draw(st.booleans()):
            model_mask = mask[:, 0, 0]  # [B, Sk]: the layout models pass around
    q = torch.randn(b, hq, sq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, hkv, sk, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, sk, dv, generator=g, dtype=torch.float64).to(dtype)
    return Case(kind, rep, q, k, v, mask, model_mask, None if keep is None else keep.expand(b, hq, sq, sk), gqa, seed)


def run_with_grads(fn, case: Case, dtype: torch.dtype, device="cpu"):
    """Output and grads of q, k, v for ``fn(q, k, v)`` at ``dtype``, under a random loss;
    returned on the CPU."""
    q, k, v = (t.detach().to(device, dtype).requires_grad_() for t in (case.q, case.k, case.v))
    out = fn(q, k, v)
    g = torch.Generator().manual_seed(case.seed + 1)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64).to(device, dtype)
    (out * w).sum().backward()
    return [t.cpu() for t in (out.detach(), q.grad, k.grad, v.grad)]


def static_attention(q, k, v, mask, *, backend="reference", convention="torch", gqa=False):
    """``(out, lse)`` of the path CUDA graphs capture (``varlen_attn.op.static_attention``: the
    plan built from the mask with no host read, then the op) on padded ``[B, S, H, D]`` tensors,
    with ``float_mask="bool"``."""
    import varlen_attn as va

    return va.op.static_attention(q, k, v, mask, convention=convention,
                                  opts=va.execution.Options(None, False, 0.0, gqa),
                                  policy=va.policy.Policy(backend, False, "bool", False))


def sdpa_fn(case: Case, mask_dtype: torch.dtype, exact: bool = False, device="cpu"):
    """SDPA with the case's mask; ``exact=True`` uses the mask's meaning as a bool mask instead,
    which avoids SDPA's rounding of ``score - 10000`` in rows where every key is masked."""
    mask = case.mask
    if exact and effective_keep(case) is not None:
        mask = effective_keep(case)
    elif mask is not None and mask.is_floating_point():
        mask = mask.to(mask_dtype)
    if mask is not None:
        mask = mask.to(device)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=case.gqa)

    return fn


def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - ref.double()).abs().max().item()


# Floor, in ulps of the result's scale, for where SDPA's own error is zero by luck (exact zero
# rows, tiny inputs). From data: over a HYPOTHESIS_PROFILE=thorough run (~100k comparisons) the
# worst excess over 2x SDPA's error was 63 ulps in float64 (long reductions: D=256 with GQA),
# 4.4 in float32, 0.22 in bf16/fp16; the floors are about twice that.
FLOOR_ULPS = {torch.float64: 128, torch.float32: 16, torch.bfloat16: 2, torch.float16: 2}
# Set VARLEN_TEST_ERRLOG=path to record every comparison (for the worst-error summary).
ERRLOG = os.environ.get("VARLEN_TEST_ERRLOG")


def effective_keep(case: Case) -> torch.Tensor | None:
    """What SDPA computes with ``case.mask``, as bool [B, H, Sq, Sk]: a row whose keys all carry
    the same large finite negative attends to every key (softmax is shift invariant)."""
    if case.mask is None or case.keep is None:
        return None
    keep = case.keep
    if case.rep in ("neg_10000", "finfo_min"):
        keep = keep | ~keep.any(-1, keepdim=True)
    return keep


def is_segment_pattern(keep: torch.Tensor) -> bool:
    """Brute-force oracle: every head equal, and any two query rows attend equal or disjoint
    key sets. Independent of the library's vectorised test."""
    if not bool((keep == keep[:, :1]).all()):
        return False
    for b in range(keep.shape[0]):
        rows = {tuple(r.tolist()) for r in keep[b, 0] if r.any()}
        sets = [frozenset(i for i, x in enumerate(r) if x) for r in rows]
        for i, a in enumerate(sets):
            for c in sets[i + 1:]:
                if a & c:
                    return False
    return True


def assert_matches(got, ref64, baseline, dtype, names=("out", "dq", "dk", "dv")):
    """Data-derived tolerance (attention-gym's rule): ``got`` may be at most 2x as far from the
    float64 result as ``baseline`` (SDPA at the same precision) is, plus a floor of a few ulps
    of the result's scale (both can be exact by luck on tiny inputs). NaN never passes."""
    eps = torch.finfo(dtype).eps
    for name, a, r, bl in zip(names, got, ref64, baseline):
        assert not torch.isnan(a).any(), f"{name}: NaN"
        assert a.shape == r.shape, f"{name}: shape {tuple(a.shape)} != {tuple(r.shape)}"
        scale = r.abs().max().item() if r.numel() else 0.0
        tol = 2.0 * max_err(bl, r) + FLOOR_ULPS[dtype] * eps * max(scale, 1.0)
        err = max_err(a, r)
        if ERRLOG:
            with open(ERRLOG, "a") as fh:
                fh.write(json.dumps({"dtype": str(dtype), "name": name, "err": err,
                                     "baseline": max_err(bl, r), "scale": scale}) + "\n")
        assert err <= tol, f"{name}: max error {err:.3e} > tolerance {tol:.3e} (dtype {dtype})"


# Floor of :func:`assert_model_close`, in ulps of each compared tensor's scale (``max |ref|``, at
# least 1), by the dtype the model ran in; its docstring gives the measurements behind it.
MODEL_FLOOR_ULPS = {torch.float64: 32, torch.float32: 16, torch.bfloat16: 2, torch.float16: 2}


def _named_tensors(result) -> dict:
    """A model test's result as ``{name: tensor}``: a tensor is ``{"out": t}``; a ``step()``
    result ``(output, {parameter: gradient}, ...)`` is the output plus one ``"grad <parameter>"``
    entry per gradient; a dict is taken as is."""
    if isinstance(result, torch.Tensor):
        return {"out": result}
    if isinstance(result, dict):
        return dict(result)
    out, grads = result[:2]
    return {"out": out, **{f"grad {n}": g for n, g in grads.items()}}


def assert_model_close(got, ref, *, baseline=None, what="", equal_nan=False):
    """The one tolerance rule of the model tests. Each tensor of ``got`` (the varlen run) may be
    at most ``max(2 * |baseline - ref|, floor)`` from ``ref`` (max abs difference), where
    ``floor = MODEL_FLOOR_ULPS[dtype] * eps(dtype) * max(max |ref|, 1)`` for the dtype ``got``
    ran in. The names must match (the same parameters received gradients), and the shapes; NaN
    never passes, unless ``equal_nan``: then NaN must sit exactly where ``ref`` has it.

    ``got``, ``ref`` and ``baseline``: a tensor, a ``_models.step`` result ``(output,
    {parameter: gradient})``, or a ``{name: tensor}`` dict. ``what`` names the case in messages.

    ``baseline`` measures the error ``ref`` itself carries, as in :func:`assert_matches`:

    * ``ref`` a float64 CPU run: ``baseline`` is stock at ``got``'s precision (the GPU bf16 test);
    * ``ref`` stock in float64: ``baseline`` is an equivalent computation that rounds differently:
      stock on a permuted batch (Qwen, Flux), or the -10000 rows of an empty prompt replaced by an
      all-ones mask, which SDPA does not round to the float64 grid at 10000 (Sana, PixArt).

    Without one only the floor applies (float64 stock vs float64 varlen differ only in the
    summation order of a few small reductions). The floor's scale is clamped at 1 because some
    gradients are zero in exact arithmetic (a key bias, by softmax shift invariance) and pure
    rounding noise, ~1e-16, in both runs; activations in these models are O(1).

    Measured with ``VARLEN_TEST_ERRLOG`` (records every comparison), in ulps of the tensor's scale.
    float64, every CPU model test (and test_compile's Chroma) with model and input seeds 0..9,
    ~190k tensor comparisons:

    * varlen vs stock: at most 4.0 (Chroma, ``reference`` backend, a gradient); Qwen 2.1, Flux 2.2,
      HunyuanVideo 3.4 (the former rules: absolute 1e-11 for Chroma, 16 ulps for HunyuanVideo,
      16x a permuted-batch noise of ~3 ulps, relative to ``max |ref|``, for Qwen and Flux);
    * varlen vs the exact (all-ones) baseline, Sana/PixArt: at most 5.0 (former floor: 32);
    * stock vs stock on a permuted batch (the check in the Qwen/Flux tests): at most 6.1;
    * with a baseline: at most 4.4 above 2x the baseline's error; where an empty prompt makes
      stock's own error large (up to 2832 ulps), varlen's is at most 1.05x it.

    float32 (the threaded toy model in test_integration): at most 1.3.
    bf16 on an H200 (test_gpu_models, plus 4 seeds x 5 prompt-length sets x the ``split_sdpa``,
    ``torch`` and ``reference`` backends, 6k comparisons): varlen's error is 10 to 350 ulps and at
    most 1.03x stock's bf16 error, so 2x the baseline decides (err/tolerance <= 0.52); where stock's
    error is 0, varlen's is 0 too. The former rule there was ``2 * stock error + 1 ulp`` relative
    to each gradient's scale.

    Hence floors of 32 ulps for float64 (5x the worst seen, 6.1; a masking error moves an output
    by ~1e-2 relative, ~4e13 ulps), 16 for float32 (12x), and 2 for bf16/fp16 (as
    :data:`FLOOR_ULPS`; it never binds there).
    """
    got, ref = _named_tensors(got), _named_tensors(ref)
    base = None if baseline is None else _named_tensors(baseline)
    prefix = f"{what}: " if what else ""
    assert ref, f"{prefix}nothing to compare"
    assert got.keys() == ref.keys(), f"{prefix}different tensors: {sorted(got.keys() ^ ref.keys())}"
    for name, r in ref.items():
        a = got[name]
        assert a.shape == r.shape, f"{prefix}{name}: shape {tuple(a.shape)} != {tuple(r.shape)}"
        dtype = a.dtype
        a, r = a.detach().double().cpu(), r.detach().double().cpu()
        b = None if base is None else base[name].detach().double().cpu()
        if equal_nan:
            assert torch.equal(a.isnan(), r.isnan()), f"{prefix}{name}: NaN in different places"
            a, r = a.nan_to_num(0.0), r.nan_to_num(0.0)
            b = None if b is None else b.nan_to_num(0.0)
        assert not a.isnan().any(), f"{prefix}{name}: NaN"
        assert not r.isnan().any(), f"{prefix}{name}: NaN in the reference"
        scale = r.abs().max().item() if r.numel() else 0.0
        ulp = torch.finfo(dtype).eps * max(scale, 1.0)
        floor = MODEL_FLOOR_ULPS[dtype] * ulp
        base_err = 0.0 if b is None else max_err(b, r)
        tol = max(2.0 * base_err, floor)
        err = max_err(a, r)
        if ERRLOG:
            with open(ERRLOG, "a") as fh:
                fh.write(json.dumps({"model": True, "what": what, "name": name, "dtype": str(dtype),
                                     "err": err, "baseline": None if b is None else base_err,
                                     "scale": scale, "ulp": ulp}) + "\n")
        assert err <= tol, (f"{prefix}{name}: max error {err:.3e} ({err / ulp:.1f} ulps) > tolerance "
                            f"{tol:.3e} (baseline error {base_err:.3e}, floor {floor:.3e}, {dtype})")


def assert_model_equal(got, ref, what=""):
    """Bitwise equality of two model results (same forms as :func:`assert_model_close`): for
    paths where nothing of varlen runs, or runs that must not change at all."""
    got, ref = _named_tensors(got), _named_tensors(ref)
    prefix = f"{what}: " if what else ""
    assert got.keys() == ref.keys(), f"{prefix}different tensors: {sorted(got.keys() ^ ref.keys())}"
    for name, r in ref.items():
        assert torch.equal(got[name], r), f"{prefix}{name}: not bitwise equal"


def synchronising_calls(fn) -> list[str]:
    """The messages of the synchronising CUDA calls ``fn()`` makes: torch's sync debug mode sees
    every one, those inside a kernel's Python wrapper included (``CountSyncs`` sees only ops)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [str(w.message) for w in seen if "synchroniz" in str(w.message)]


class CountSyncs(TorchDispatchMode):
    """Counts ops that force a device-to-host sync on CUDA (``.item()``, ``nonzero``, ...)."""

    SYNCING = frozenset({"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select",
                         "unique_dim", "_unique2", "unique_consecutive", "bincount", "repeat_interleave"})

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.SYNCING:
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


class CopySaved(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that hand the backward a copy of every tensor autograd saves, as
    offloading hooks do (``torch.autograd.graph.save_on_cpu(pin_memory=True)`` on a GPU): what the
    forward saved is gone by the backward, and a copy is a plain tensor. ``copied`` counts them."""

    def __init__(self):
        self.copied = 0
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t):
        self.copied += 1
        return copy_keeping_strides(t)


def copy_keeping_strides(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s storage viewed as ``t``: the copy keeps the strides compiled code asserts."""
    return t.new_empty(0).set_(t.untyped_storage().clone(), t.storage_offset(), t.size(), t.stride())


class HostReads:
    """Counts the calls that read tensor values on the host (``tolist``, ``item``,
    ``torch.equal``), wherever they come from, except the custom op's reads of its own handles
    (one-element int64 tensors made on the CPU, never on a device: no sync there). A dispatch
    mode cannot count them here: dynamo refuses to run compiled code under one."""

    def __init__(self, monkeypatch):
        self.calls = []
        self.on = False
        for owner, name in ((torch.Tensor, "tolist"), (torch.Tensor, "item"), (torch, "equal")):
            monkeypatch.setattr(owner, name, self._counted(getattr(owner, name), name))

    def _counted(self, fn, name):
        def counted(*args, **kwargs):
            handle = name == "item" and args[0].dtype == torch.int64 and args[0].shape == (1,)
            if self.on and not handle:
                self.calls.append(name)
            return fn(*args, **kwargs)
        return counted

    def __enter__(self):
        self.calls, self.on = [], True
        return self

    def __exit__(self, *exc):
        self.on = False


def ran_in_graph(ops: set) -> bool:
    """A compiled graph's ops (:class:`Recording`, as dynamo traced them) ran attention in the graph
    itself (varlen_attn.op, "In the graph"): the key-padding plan op, and neither varlen_attn's
    custom op (which reads the host at run time) nor masked SDPA."""
    return ("varlen_attn.key_padding_plan.default" in ops and not any(o.startswith("varlen_attn.attention") for o in ops)
            and not any("scaled_dot_product" in o for o in ops))


class Recording:
    """A torch.compile backend: inductor, recording the ops of every graph it compiles."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return compile_fx(gm, example_inputs)


class BlocksInARow(torch.nn.Module):
    """Blocks called in a row on ``(x, attention_mask)``, each one's output added to ``x``; with
    ``checkpointing``, called as diffusers calls them while gradients are on (non-reentrant
    ``torch.utils.checkpoint`` through ``_gradient_checkpointing_func``, which enable_varlen wraps)."""

    def __init__(self, blocks, checkpointing=False):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)
        self.gradient_checkpointing = checkpointing
        if checkpointing:
            self._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint,
                                                                  use_reentrant=False)

    def forward(self, x, attention_mask):
        for block in self.blocks:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = x + self._gradient_checkpointing_func(block, x, attention_mask)
            else:
                x = x + block(x, attention_mask)
        return x


class Checkpointed:
    """A block's ``forward`` checkpointed by the caller with ``torch.utils.checkpoint`` itself, not
    through diffusers' ``_gradient_checkpointing_func`` (OneTrainer wraps its blocks this way);
    arguments by position, which a reentrant checkpoint needs to differentiate them."""

    def __init__(self, forward, use_reentrant):
        self.forward, self.use_reentrant = forward, use_reentrant

    def __call__(self, *args, **kwargs):
        forward = getattr(self.forward, "forward", self.forward)  # a module: its forward's signature
        bound = inspect.signature(forward).bind(*args, **kwargs)
        bound.apply_defaults()
        return torch.utils.checkpoint.checkpoint(self.forward, *bound.args, use_reentrant=self.use_reentrant)


class CheckpointedModule(torch.nn.Module):
    """A block replaced by a module that checkpoints it (the block may be compiled itself)."""

    def __init__(self, block, use_reentrant):
        super().__init__()
        self.block, self.call = block, Checkpointed(block, use_reentrant)

    def forward(self, *args, **kwargs):
        return self.call(*args, **kwargs)


def checkpoint_blocks(model, use_reentrant=False, compiled=None, compiler="aot_eager"):
    """Every block of a Chroma checkpointed by the caller: its forward wrapped (``compiled``
    None), or the block replaced by a module that checkpoints it, the block compiled by
    ``compiler`` (``compiled`` True: the checkpoint around the compiled call) or not (False:
    the stock of that case)."""
    for blocks in (model.transformer_blocks, model.single_transformer_blocks):
        for i, block in enumerate(blocks):
            if compiled is None:
                block.forward = Checkpointed(block.forward, use_reentrant)
                continue
            if compiled:
                block.compile(fullgraph=True, backend=compiler)
            blocks[i] = CheckpointedModule(block, use_reentrant)
    return model
