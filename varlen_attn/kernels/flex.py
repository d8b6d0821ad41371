"""``flex``: PyTorch's FlexAttention on the *padded* tensors, with a block mask made once per plan.

No packing: the kernel skips the blocks the plan leaves empty, so a call issues no gather or
scatter. Segment ids per padded position (-1 for padding) give the block mask's tables on the
device (:func:`block_mask_of`); rows in no segment come out as zeros, as SDPA's. On CUDA the
kernel is FlexAttention under ``torch.compile``, one compiled copy per call class
(:func:`_call_class`); where it would run eagerly instead (dense scores, a host sync) the call
raises ``BackendUnavailableError``. CUDA and eager callers only. docs/design.md has the story.
"""

from __future__ import annotations

import collections
import functools
import re
import sys
import threading
import types
import weakref

import torch

from .._errors import BackendUnavailableError
from ..pack import _side
from ._base import Backend, VarlenInputs, inside_compiled_graph

BLOCK = 128  # FlexAttention's default sparse block size


def segment_ids(plan, which: str) -> torch.Tensor:
    """``[B, S]`` int64: the plan's segment of each padded query (``"q"``) or key (``"k"``)
    position, -1 where it is in none. Device ops only (static plans too: no host value read)."""
    _, seqlen, _, inverse, padding = _side(plan, which)
    cu = plan.cu_seqlens_q if which == "q" else plan.cu_seqlens_k
    seg = torch.searchsorted(cu.to(torch.int64), inverse, right=True) - 1
    if padding.dtype == torch.bool:
        seg = seg.masked_fill(padding, -1)
    elif padding.numel():
        seg = seg.index_fill(0, padding, -1)
    return seg.view(plan.batch_size, seqlen)


def _block_stats(seg: torch.Tensor):
    """Per ``BLOCK`` positions of ``seg [B, S]``: (lowest id, highest id, every position valid),
    padding ids (-1) left out; an empty block has lowest > highest."""
    b, s = seg.shape
    n = -(-s // BLOCK)
    blocks = torch.nn.functional.pad(seg, (0, n * BLOCK - s), value=-1).view(b, n, BLOCK)
    valid = blocks >= 0
    big = torch.iinfo(seg.dtype).max
    return (torch.where(valid, blocks, big).amin(-1), blocks.amax(-1), valid.all(-1))


def _ordered(blocks: torch.Tensor):
    """``[B, nq, nk]`` bool -> (count ``[B, 1, nq]``, column indices ``[B, 1, nq, nk]``, the
    marked ones first): a BlockMask's table layout (one head: the mask is the same for all)."""
    count = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count[:, None], order[:, None]


def block_mask_of(seg_q: torch.Tensor, seg_k: torch.Tensor):
    """FlexAttention's ``BlockMask`` for "query and key in the same segment" over padded
    positions with segment ids ``seg_q [B, Sq]``, ``seg_k [B, Sk]``. A block pair is skipped when
    no segment is in both blocks, full (no mask_mod call) when both blocks are one segment with
    no padding, partial otherwise (conservatively: id ranges that overlap)."""
    from torch.nn.attention.flex_attention import BlockMask

    qlo, qhi, qall = _block_stats(seg_q)
    klo, khi, kall = _block_stats(seg_k)
    touch = (qhi[:, :, None] >= klo[:, None, :]) & (khi[:, None, :] >= qlo[:, :, None])
    full = (touch & (qall & (qlo == qhi))[:, :, None] & (kall & (klo == khi))[:, None, :]
            & (qlo[:, :, None] == klo[:, None, :]))
    partial = touch & ~full

    def same_segment(b, h, q_idx, kv_idx):
        sq = seg_q[b, q_idx]
        return (sq == seg_k[b, kv_idx]) & (sq >= 0)

    # The backward's tables (per key block) from the same booleans, transposed: not through
    # BlockMask.from_kv_blocks, whose vmap fails inside a custom op (the compiled path's).
    tables = {}
    for name, blocks in (("", partial), ("full_", full)):
        tables[name + "kv_num_blocks"], tables[name + "kv_indices"] = _ordered(blocks)
        tables[name + "q_num_blocks"], tables[name + "q_indices"] = _ordered(blocks.transpose(1, 2))
    return BlockMask(seq_lengths=(seg_q.shape[1], seg_k.shape[1]), BLOCK_SIZE=(BLOCK, BLOCK),
                     mask_mod=same_segment, **tables)


# plan -> (block mask, query rows in a segment [B, 1, Sq, 1]): made at a plan's first flex call,
# shared by every layer of the forward (and its recomputation), gone with the plan.
_masks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _mask_of(plan):
    entry = _masks.get(plan)
    if entry is None:
        seg_q, seg_k = segment_ids(plan, "q"), segment_ids(plan, "k")
        entry = _masks[plan] = (block_mask_of(seg_q, seg_k), (seg_q >= 0)[:, None, :, None])
    return entry


def _own_code(fn, name: str):
    """A copy of the function ``fn`` with a code object of its own, named ``name``. Dynamo keeps
    its compiled graphs, and counts recompiles against ``recompile_limit``, per code object: a
    second ``torch.compile`` of one function shares the first one's."""
    code = fn.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):  # Python 3.11+
        code = code.replace(co_qualname=name)
    copy = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def _not_compiled(q, k, v, scale, cause: str, advice: str) -> BackendUnavailableError:
    """The error for a call that FlexAttention did not compile (``q``, ``k``, ``v`` as ``[B, H, S, D]``)."""
    return BackendUnavailableError(
        f"backend 'flex' cannot run this call (dtype {q.dtype}, batch {q.shape[0]}, {q.shape[2]} queries / "
        f"{k.shape[2]} keys, {q.shape[1]} query / {k.shape[1]} key heads, head dim {q.shape[-1]} (values "
        f"{v.shape[-1]}), scale {scale}, grad {torch.is_grad_enabled()}): FlexAttention did not compile "
        f"({cause}), and its eager form would materialise the dense score matrix and sync with the "
        f"host. {advice[:1].upper()}{advice[1:]}, or pick another backend."
    )


_STANCE = ("dynamo ran it eagerly: a stance such as torch.compiler.set_stance('force_eager'), a "
           "disabled dynamo, or its recompile limit")
_STANCE_ADVICE = "run it where torch.compile compiles (no eager stance, dynamo enabled)"


def _limit_advice() -> str:
    return (f"raise torch._dynamo.config.recompile_limit (now {_recompile_limit()}; TORCH_LOGS=recompiles "
            f"says what recompiled)")


def _recompile_limit():
    import torch._dynamo

    config = torch._dynamo.config
    return getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", None)


def _compiled_flex_attention(q, k, v, block_mask, scale, enable_gqa):
    # Copied per call class; is_compiling() is False only where this body runs eagerly.
    if not torch.compiler.is_compiling():
        raise _not_compiled(q, k, v, scale, _STANCE, f"{_STANCE_ADVICE}; {_limit_advice()}")
    from torch.nn.attention.flex_attention import flex_attention

    # Under 128 queries FlexAttention's decoding kernel found no configuration with grouped-query
    # heads (H200, torch 2.11: NoValidChoicesError at 65 queries, head dims 16 and 32).
    options = {"FORCE_USE_FLEX_ATTENTION": True} if enable_gqa else None
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, kernel_options=options)


def _call_class(q, k, v, scale: float, gqa: bool) -> tuple:
    """The call class of ``q``, ``k``, ``v`` (``[B, H, S, D]``): what made dynamo compile
    FlexAttention again (torch 2.13): dtype, head dims and counts, device, scale, grad mode and
    flags, inference tensors, batch size and lengths. Compiled for static shapes only: symbolic
    lengths failed to compile (H200, torch 2.11), so a new shape compiles once more (6-9 s)."""
    return (q.dtype, q.shape[-1], v.shape[-1], q.shape[1], k.shape[1], gqa, q.device, float(scale),
            torch.is_grad_enabled(), q.requires_grad, k.requires_grad, v.requires_grad, q.is_inference(),
            q.shape[0], q.shape[2], k.shape[2])


class _Class:
    """A call class's compiled FlexAttention, whether it has run once (compiled its forward),
    and why it did not compile (``failed``: the message; the class is not compiled again)."""

    __slots__ = ("fn", "warm", "failed")

    def __init__(self, fn):
        self.fn, self.warm, self.failed = fn, False, None


# Call classes kept, the oldest dropped first (met again, it compiles again).
CLASSES_KEPT = 128
_classes: "collections.OrderedDict[tuple, _Class]" = collections.OrderedDict()
_compiling = threading.Lock()


def _class(key: tuple) -> _Class:
    """The call class ``key``: ``torch.compile`` of a copy of :func:`_compiled_flex_attention`
    with its own code object, so its own recompile limit. Made once (compiles at its first call)."""
    entry = _classes.get(key)
    if entry is None:
        with _compiling:
            entry = _classes.get(key)
            if entry is None:
                dtype, dq, dv, hq, hk, gqa, device, scale, *flags, b, sq, sk = key
                name = re.sub(r"\W", "_", f"flex_attention_{str(dtype).split('.')[-1]}_d{dq}_{dv}_h{hq}_{hk}_"
                                            f"{device}_s{scale!r}_g{''.join(str(int(f)) for f in flags)}_b{b}_q{sq}_k{sk}")
                entry = _classes[key] = _Class(torch.compile(_own_code(_compiled_flex_attention, name),
                                                             fullgraph=True, dynamic=False))
                while len(_classes) > CLASSES_KEPT:
                    _classes.popitem(last=False)
    return entry


def _compiled(key: tuple):
    """The compiled FlexAttention of the call class ``key`` (:func:`_class`)."""
    return _class(key).fn


def _run_compiled(key: tuple, *args):
    """The call class ``key``'s compiled FlexAttention on ``args``. A class's first call (its
    compile, seconds) runs under a lock: two threads meeting a new class at once compile it once."""
    entry = _class(key)
    if entry.warm:
        return entry.fn(*args)
    with _compiling:
        if entry.failed is not None:
            raise _ClassFailed(entry.failed)
        try:
            out = entry.fn(*args)
        except _compile_errors() as e:
            entry.failed = _compiler_said(e)
            raise
        entry.warm = True
    return out


class _ClassFailed(Exception):
    """A call class whose compile failed before is met again: not compiled again (inductor's
    choice is the same every time, and a try costs seconds)."""


def _compiler_said(e: Exception) -> str:
    """What the compiler itself raised, in one line: its type and the first line of its message."""
    inner = getattr(e, "inner_exception", None) or e
    said = (str(inner).strip().splitlines() or [""])[0][:300]
    return f"{type(inner).__name__}: {said}"


def _forget_classes() -> None:
    """Drop every compiled call class (tests)."""
    with _compiling:
        _classes.clear()


def _recompile_limit_errors() -> tuple:
    # fullgraph=True: where torch raises past the recompile limit instead of running eagerly
    import torch._dynamo.exc as exc

    names = ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")  # the second: older torch
    return tuple(getattr(exc, n) for n in names if hasattr(exc, n))


def _compile_errors() -> tuple:
    # What dynamo raises where its backend failed: inductor's own error (re-raised as it is since
    # torch 2.6), or dynamo's wrapper of any other backend's
    import torch._dynamo.exc as exc

    errors = [exc.BackendCompilerFailed]
    try:
        from torch._inductor.exc import InductorError

        errors.append(InductorError)
    except ImportError:
        pass
    return tuple(errors)


def flex_padded(q, k, v, plan, scale: float, *, compiled: bool = True) -> torch.Tensor:
    """Padded ``[B, S, H, D]`` q, k, v -> ``[B, Sq, Hq, Dv]``: attention within the plan's
    segments, zeros at query positions in none. ``compiled`` False runs FlexAttention's eager
    (reference) implementation, forward only on the CPU; ``compiled`` True raises
    ``BackendUnavailableError`` where FlexAttention would not compile (never its eager form)."""
    block_mask, rows = _mask_of(plan)
    gqa = q.shape[2] != k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if compiled:
        try:
            out = _run_compiled(_call_class(q, k, v, scale, gqa), q, k, v, block_mask, scale, gqa)
        except _recompile_limit_errors() as e:
            raise _not_compiled(q, k, v, scale, "dynamo's recompile limit was reached for this call class",
                                _limit_advice()) from e
        except (*_compile_errors(), _ClassFailed) as e:
            # The class keeps the failure: its later calls raise at once.
            said = str(e) if isinstance(e, _ClassFailed) else _compiler_said(e)
            raise _not_compiled(q, k, v, scale, f"inductor could not compile this call class: {said}",
                                "a newer torch may compile it") from e
    else:
        from torch.nn.attention.flex_attention import flex_attention

        out = flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    # A query row with no key in any block comes out as whatever the kernel left: zeros, as SDPA.
    return out.masked_fill(~rows, 0).transpose(1, 2)


@functools.lru_cache(maxsize=None)
def _cannot_compile(device_type: str) -> str | None:
    """Why ``torch.compile`` cannot compile FlexAttention on ``device_type`` in this process, or
    None (asked once per device type)."""
    try:
        import torch._dynamo
        from torch.utils._triton import has_triton
    except ImportError as e:
        return f"torch.compile is not available ({e})"
    if not torch._dynamo.is_dynamo_supported():
        return f"torch.compile is not supported here (Python {sys.version.split()[0]}, torch {torch.__version__})"
    if device_type == "cuda" and not has_triton():
        return "torch.compile needs Triton for FlexAttention on CUDA, and Triton is not installed"
    return None


class FlexBackend(Backend):
    NAME = "flex"
    REQUIRES = ("torch.nn.attention.flex_attention",)
    SUPPORTED_DEVICES = frozenset({"cuda"})  # no FlexAttention backward on the CPU
    SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
    MIN_COMPUTE_CAPABILITY = (8, 0)
    SUPPORTS_CAUSAL = False
    SUPPORTS_DROPOUT = False
    SUPPORTS_DIFFERENT_V_DIM = False
    PADDED = True

    def not_supported_reasons(self, inp: VarlenInputs) -> list[str]:
        reasons = super().not_supported_reasons(inp)
        d = inp.q.shape[-1]
        if d < 16 or d & (d - 1):
            reasons.append(f"head dim {d} is not a power of two >= 16 (FlexAttention's compiled kernel)")
        why = _cannot_compile(inp.q.device.type)
        if why:
            reasons.append(why)
        if inside_compiled_graph():
            # Inside a running compiled graph dynamo does not compile, and FlexAttention's eager
            # implementation fails there (its vmap, below autograd): seen on an H100.
            reasons.append("called from a torch.compile graph, where FlexAttention cannot compile (eager only)")
        return reasons

    def forward_padded(self, q, k, v, plan, scale: float, causal: bool) -> torch.Tensor:
        return flex_padded(q, k, v, plan, scale)
