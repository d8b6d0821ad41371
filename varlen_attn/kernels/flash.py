"""flash-attention varlen kernels: FA2 (``flash_attn``), FA3 (``flash_attn_interface``) and
FA4 (``flash-attn-4``, imported as ``flash_attn.cute``). Each module is imported at the first
call, never at ``import varlen_attn``: none is a required dependency.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import itertools
import traceback

import torch

from .._errors import KernelRefusedError
from ._base import Backend, VarlenInputs, bump_refusals

_HALF = frozenset({torch.float16, torch.bfloat16})


class _FlashBackend(Backend):
    MODULE = ""
    SUPPORTED_DEVICES = frozenset({"cuda"})
    SUPPORTED_DTYPES = _HALF
    MAX_HEAD_DIM = 256
    SUPPORTS_DIFFERENT_V_DIM = False
    REQUIRES_CONTIGUOUS_LAST_DIM = True
    STATIC_PLANS = True

    def _fn(self):
        return importlib.import_module(self.MODULE).flash_attn_varlen_func

    def is_installed(self) -> bool:
        try:  # find_spec on a submodule imports its parent; a broken parent means absent
            return importlib.util.find_spec(self.MODULE) is not None
        except (ImportError, ValueError):
            return False

    def forward(self, inp: VarlenInputs) -> torch.Tensor:
        # Only FA2 takes dropout; the others refuse it in not_supported_reasons.
        extra = {"dropout_p": inp.dropout_p} if self.SUPPORTS_DROPOUT else {}
        out = self._fn()(*_last_dim_contiguous(inp.q, inp.k, inp.v), **_varlen_kwargs(inp), **extra)
        # FA3 before 3.0 stable and FA4 return (out, lse).
        return out[0] if isinstance(out, tuple) else out


def _last_dim_contiguous(*ts):
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in ts)


def _varlen_kwargs(inp: VarlenInputs) -> dict:
    """Keywords, not positions: FA3/FA4 put seqused_q/k between cu_seqlens and max_seqlen."""
    p = inp.plan
    return dict(cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k, max_seqlen_q=p.max_seqlen_q,
                max_seqlen_k=p.max_seqlen_k, softmax_scale=inp.scale, causal=inp.causal)


def _skipped(inp: VarlenInputs) -> dict:
    """FA4's ``seqused_q`` where the plan has dead elements (VarlenPlan.dead): their queries
    skipped (used: none), every other segment used whole."""
    used = inp.plan.seqused_q
    return {} if used is None else {"seqused_q": used}


class FlashAttn2Backend(_FlashBackend):
    NAME = "flash_attn"
    # Not plain "flash_attn": flash-attn-4 installs that package name too, without FA2's kernels.
    MODULE = "flash_attn.flash_attn_interface"
    REQUIRES = (MODULE,)
    MIN_COMPUTE_CAPABILITY = (8, 0)


class FlashAttn3Backend(_FlashBackend):
    NAME = "flash_attn_3"
    MODULE = "flash_attn_interface"
    REQUIRES = ("flash_attn_interface",)
    MIN_COMPUTE_CAPABILITY = (9, 0)
    SUPPORTS_DROPOUT = False


class FlashAttn4Backend(_FlashBackend):
    NAME = "flash_attn_4"
    MODULE = "flash_attn.cute"
    REQUIRES = ("flash_attn.cute",)
    # flash-attn-4 4.0.0b36 asserts its backward for compute capability 9.x-12.x (forward 8.x):
    # training needs both, so 9.0 is the floor; above it see ``MEASURED_MAJORS``.
    MIN_COMPUTE_CAPABILITY = (9, 0)
    SUPPORTS_DROPOUT = False
    HEAD_DIM_MULTIPLE = 8
    # Measured on an H200 with flash-attn-4 4.0.0b36: at head dim 16 dq is wrong (relative
    # error ~1 against float64; out, dk, dv fine); 32 and up matched split_sdpa's error.
    MIN_HEAD_DIM = 32
    # Majors where the declarations above were measured (Hopper). Elsewhere the first call of each
    # kind is preceded by a check of FA4 on 64 tokens (:meth:`_verdict`; benchmarks/NOTES.md entry 32).
    MEASURED_MAJORS = frozenset({9})
    _PROBE_TOKENS = (40, 24)  # two segments

    def __init__(self):
        # kind of call -> None (runs) or why FA4 cannot run it (the check, or a refusal at a call).
        self._verdicts: dict[tuple, str | None] = {}

    def not_supported_reasons(self, inp: VarlenInputs) -> list[str]:
        reasons = super().not_supported_reasons(inp)
        if inp.q.shape[-1] % self.HEAD_DIM_MULTIPLE:
            reasons.append(f"head dim {inp.q.shape[-1]} not a multiple of {self.HEAD_DIM_MULTIPLE}")
        if inp.q.shape[-1] < self.MIN_HEAD_DIM:
            reasons.append(f"head dim {inp.q.shape[-1]} < {self.MIN_HEAD_DIM} (wrong dq measured at 16)")
        # FA4 betas mishandled zero-length sequences; plans never hold one, but guard anyway.
        if 0 in inp.plan.seqlens_q or 0 in inp.plan.seqlens_k:
            reasons.append("zero-length segment in the plan")
        if not reasons:
            refused = self._verdict(inp)
            if refused:
                reasons.append(refused)
        return reasons

    @staticmethod
    def _kind(inp: VarlenInputs) -> tuple:
        q, k, v = inp.q, inp.k, inp.v
        return (q.device.index, q.dtype, q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1], inp.causal)

    def _verdict(self, inp: VarlenInputs) -> str | None:
        """None where FA4 runs calls of this kind; else why not. Remembered per kind."""
        kind = self._kind(inp)
        if kind in self._verdicts:
            return self._verdicts[kind]
        dev = inp.q.device
        if dev.type == "cuda":
            if torch.cuda.get_device_capability(dev)[0] in self.MEASURED_MAJORS and not _FORCE_CHECK:
                return None
            if torch.cuda.is_current_stream_capturing():
                return None  # a capture cannot run the check; an eager call will (a refusal raises clearly)
        elif not _FORCE_CHECK:
            return None  # FA4 runs on CUDA only; elsewhere only a test's stand-in gets here
        verdict = self._check(inp)
        # A refusal stored meanwhile (another thread's call) wins over a check that passed.
        if verdict is not None or kind not in self._verdicts:
            self._verdicts[kind] = verdict
        return self._verdicts[kind]

    def _check(self, inp: VarlenInputs) -> str | None:
        """FA4's forward and backward on 64 tokens of ``inp``'s kind, against float32 math: None,
        or what FA4 refused or computed wrong. FA4 compiles kernels for these 64 tokens (on an
        H200 the real call did not reuse them: benchmarks/NOTES.md entry 32)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        dev = inp.q.device
        cc = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
        where = f"flash-attn-4 {_version('flash-attn-4')} on " + (
            f"compute capability {cc[0]}.{cc[1]}" if cc else f"device {dev.type}")
        with unset_fake_temporarily(), torch.no_grad():  # selection may run while dynamo traces
            return _fa4_check(self._interface(), inp, self._PROBE_TOKENS, where)

    def _refused(self, inp: VarlenInputs, entry: str, e: BaseException) -> KernelRefusedError:
        why = f"flash-attn-4 {_version('flash-attn-4')} refused {inp.describe()} in its {entry}: {_first_line(e)}"
        self._verdicts[self._kind(inp)] = why
        bump_refusals()
        return KernelRefusedError(why + " (calls of this kind now skip flash_attn_4 under auto; an explicit "
                                  "backend='flash_attn_4' cannot run them)")

    # FA4's own forward and backward entry points (what its autograd Function calls), so the
    # fused path (varlen_attn.fused) can run pack + kernel + unpack as one autograd node.
    NATIVE_BACKWARD = True

    def _interface(self):
        return importlib.import_module("flash_attn.cute.interface")

    # FA4 writes into the buffers it is given, never past the last segment, and skips queries past
    # ``seqused_q`` (H200, FA4 4.0.0b36, benchmarks/NOTES.md entry 53; tests/test_gpu.py holds it).
    INTO_ZEROS = True

    def forward_lse(self, inp: VarlenInputs, out=None, lse=None):
        try:
            res = self._interface()._flash_attn_fwd(*_last_dim_contiguous(inp.q, inp.k, inp.v), **_varlen_kwargs(inp),
                                                    **_skipped(inp), return_lse=True, out=out, lse=lse)
        except _REFUSALS as e:  # FA4 checks its inputs with asserts before it launches anything
            raise self._refused(inp, "forward", e) from e
        return res[0], res[1]

    def backward(self, inp: VarlenInputs, out, lse, dout, grads=None):
        dq, dk, dv = grads or (None, None, None)
        try:
            return tuple(self._interface()._flash_attn_bwd(
                *_last_dim_contiguous(inp.q, inp.k, inp.v, out, dout), lse, **_varlen_kwargs(inp), **_skipped(inp),
                dq=dq, dk=dk, dv=dv)[:3])
        except _REFUSALS as e:
            raise self._refused(inp, "backward", e) from e


# What flash-attn-4's entry points raise when they refuse a call (their checks are asserts and
# ValueError/NotImplementedError), before any kernel runs.
_REFUSALS = (AssertionError, ValueError, NotImplementedError)
_FORCE_CHECK = False  # tests: run the check on a measured GPU too


def _first_line(e: BaseException) -> str:
    """``Type: first line of the message``; for a bare ``assert`` (no message), where it failed
    and its condition, which says what was expected."""
    text = str(e).strip().splitlines()
    if text:
        return f"{type(e).__name__}: {text[0]}"[:300]
    tb = traceback.extract_tb(e.__traceback__)
    if not tb:
        return type(e).__name__
    last = tb[-1]
    return f"{type(e).__name__} at {last.filename.rsplit('/', 1)[-1]}:{last.lineno}: {(last.line or '').strip()}"[:300]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _fa4_check(iface, inp: VarlenInputs, lengths: tuple[int, ...], where: str) -> str | None:
    """Run FA4's forward and backward on ``sum(lengths)`` random tokens of ``inp``'s kind and
    compare with float32 math per segment: None, or what FA4 refused or got wrong. Only FA4's
    own errors are its refusals; an error of the comparison (out of memory) propagates."""
    q0, k0, v0 = inp.q, inp.k, inp.v
    dev, dt, n = q0.device, q0.dtype, sum(lengths)
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn((n, q0.shape[-2], q0.shape[-1]), generator=gen, device=dev, dtype=dt)
    k = torch.randn((n, k0.shape[-2], k0.shape[-1]), generator=gen, device=dev, dtype=dt)
    v = torch.randn((n, v0.shape[-2], v0.shape[-1]), generator=gen, device=dev, dtype=dt)
    dout = torch.randn((n, q0.shape[-2], v0.shape[-1]), generator=gen, device=dev, dtype=dt)
    bounds = [0, *itertools.accumulate(lengths)]
    cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths),
              softmax_scale=inp.scale, causal=inp.causal)
    try:
        out, lse = iface._flash_attn_fwd(q, k, v, **kw, return_lse=True)[:2]
        grads = iface._flash_attn_bwd(q, k, v, out, dout, lse, **kw)[:3]
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:  # whatever FA4 raises (its asserts, its compiler's errors) is its refusal
        return f"{where} refuses this kind of call: {_first_line(e)}"
    want = attention_math(q, k, v, dout, bounds, inp.scale, inp.causal)
    for name, got, exp in zip(("output", "dq", "dk", "dv"), (out, *grads), want):
        err = ((got.float() - exp).norm() / exp.norm().clamp_min(1e-30)).item()
        if not err < _CHECK_TOLERANCE:  # NaN fails too
            return f"{where} computed a wrong {name} in a check of this kind of call (relative error {err:.2g})"
    return None


def attention_math(q, k, v, dout, bounds: list[int], scale: float, causal: bool):
    """``(out, dq, dk, dv)`` of attention within each segment ``bounds[i]:bounds[i+1]`` of packed
    ``[T, H, D]`` q, k, v (grouped-query heads allowed) for the output gradient ``dout``, in
    float32, by the formulas (no autograd: runs under inference_mode and inside custom ops).
    Causal is top-left, which is bottom-right here: queries and keys share the segments."""
    group = q.shape[1] // k.shape[1]
    parts = []
    for a, b in zip(bounds, bounds[1:]):
        qs, do = (t[a:b].float().transpose(0, 1) for t in (q, dout))
        ks, vs = (t[a:b].float().transpose(0, 1).repeat_interleave(group, 0) for t in (k, v))
        s = qs @ ks.transpose(1, 2) * scale
        if causal:
            s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        p = s.softmax(-1)
        o = p @ vs
        ds = p * (do @ vs.transpose(1, 2) - (do * o).sum(-1, keepdim=True))
        dq = ds @ ks * scale
        dk = (ds.transpose(1, 2) @ qs * scale).unflatten(0, (-1, group)).sum(1)
        dv = (p.transpose(1, 2) @ do).unflatten(0, (-1, group)).sum(1)
        parts.append([t.transpose(0, 1) for t in (o, dq, dk, dv)])
    return [torch.cat(ts) for ts in zip(*parts)]


# bf16 and fp16 operands land between 1e-3 and 1e-2 against float32 math; the head-dim-16 dq
# failure on an H200 (above) was near 1.
_CHECK_TOLERANCE = 5e-2
