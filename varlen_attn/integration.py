"""Model integration: ``enable_varlen(model)``, ``disable_varlen(model)``, ``VarlenAttnProcessor``.

How it works. ``enable_varlen`` wraps the model's ``forward``. For the length of one forward it
pushes a :class:`torch.overrides.TorchFunctionMode` (thread-local, so two models in two threads
never meet) that does two things:

1. It routes every ``F.scaled_dot_product_attention`` call inside the model to varlen_attn:
   diffusers processors that go through ``dispatch_attention_fn`` (native backend), legacy
   processors that call SDPA directly (Sana, PixArt), and direct calls (HunyuanVideo's token
   refiner). No processor code is copied; the stock processors keep doing projections, norms
   and rotary embeddings.
2. It records how masks are *derived* from the model's mask inputs (every keyword argument whose
   name contains ``mask``): ``m[:, None, None, :] * m[:, None, :, None]`` in Chroma's blocks,
   ``torch.cat([text_mask, torch.ones(...)])`` in Qwen-Image's processor,
   ``(1 - m) * -10000.0`` in Sana. Each derived tensor gets a structural key (the op and the keys
   of its inputs). Two masks with the same key hold the same values, so every layer whose mask
   has the same key shares one plan: the plan is built once per forward (one host sync), not
   once per layer, even though the model re-derives a new mask tensor in every block.

A mask whose derivation is unknown still works: it gets its own plan (cached by tensor object),
which costs a sync. Results never depend on the tracking; only the number of plan builds does.

Gradient checkpointing: the recomputation runs in backward, outside ``forward``; checkpointed
blocks are wrapped so they re-enter the same forward context (same plans, no rebuild, same
kernels, so the recomputed tensors match). diffusers' Chroma drops ``attention_mask`` from its
checkpointed single-block calls; with ``restore_checkpoint_mask=True`` (default) the mask the
model was called with is passed back in, so a masked model trains the same with and without
checkpointing.

Float masks (``float_mask``): Chroma's pipeline passes a float 0/1 ``attention_mask``, which SDPA
reads as an additive bias (a known diffusers bug: padding then gets weight e^0 vs e^1, not 0).
The policy applies to masks as they *reach attention*: a float mask whose values are all 0 or 1,
with at least one 1, is read as boolean (1 = keep) under ``"bool"`` (default, one warning per
process), refused under ``"error"``, and read as SDPA does (an additive bias, not packable, so
masked SDPA runs) under ``"bias"``. The decision is taken on the device inside the plan's single
sync. Real additive masks (0/-inf, -10000 biases, an all-zero bias) are never 0/1-with-a-one,
so they keep SDPA's reading under every policy.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import _stats
from ._errors import InputTypeError, InputValueError, describe
from .functional import scaled_dot_product_attention
from .kernels import requested_backend
from .plan import build_plan

logger = logging.getLogger("varlen_attn")

_FACTORIES = frozenset({torch.ones, torch.zeros, torch.full, torch.arange, torch.eye, torch.tensor,
                        torch.ones_like, torch.zeros_like, torch.full_like})
_LIKE = frozenset({torch.ones_like, torch.zeros_like, torch.full_like})
# Functions whose output is not determined by their inputs: never keyed.
_NONDETERMINISTIC = ("rand", "dropout", "bernoulli", "multinomial", "normal", "uniform", "exponential",
                     "empty", "cauchy", "geometric", "log_normal", "random")
_FLOAT_POLICIES = ("bool", "bias", "error")
_local = threading.local()
_warned: set[str] = set()


class _Unkeyable(Exception):
    pass


class ForwardContext:
    """Per-forward state: derivation keys of mask tensors, and the plans built from them."""

    def __init__(self, backend: str | None, strict: bool, float_mask: str = "bias"):
        self.backend = backend
        self.strict = strict
        self.float_mask = float_mask
        self.derived: dict[int, tuple] = {}
        self.plans: dict[tuple, object] = {}
        self.roots: dict[str, torch.Tensor] = {}

    # -- derivation keys -------------------------------------------------------------------
    def key_of(self, t: torch.Tensor):
        entry = self.derived.get(id(t))
        if entry is None or entry[0]() is not t or entry[2] != t._version:
            return None
        return entry[1]

    def mark(self, t: torch.Tensor, key) -> None:
        self.derived[id(t)] = (weakref.ref(t), key, t._version)

    def _arg_key(self, a, like: bool):
        if isinstance(a, torch.Tensor):
            if like:  # *_like factories read only shape, dtype and device
                return ("meta", tuple(a.shape), a.dtype, str(a.device))
            k = self.key_of(a)
            if k is None:
                raise _Unkeyable
            return ("T", k)
        if isinstance(a, (list, tuple)):
            return tuple(self._arg_key(x, like) for x in a)
        if isinstance(a, slice):
            return ("slice", a.start, a.stop, a.step)
        if a is None or a is Ellipsis or isinstance(a, (bool, int, float, str, torch.dtype, torch.device, torch.Size)):
            return a
        raise _Unkeyable

    def derive(self, func, args, kwargs):
        """Key of ``func(*args, **kwargs)`` if every tensor input is keyed, else None."""
        has_tensor = any(isinstance(a, torch.Tensor) for a in _flat(args, kwargs))
        if not has_tensor and func not in _FACTORIES:
            return None
        name = getattr(func, "__name__", "")
        if any(word in name for word in _NONDETERMINISTIC):
            return None
        try:
            like = func in _LIKE
            return (func, self._arg_key(tuple(args), like),
                    tuple(sorted((k, self._arg_key(v, like)) for k, v in kwargs.items())))
        except _Unkeyable:
            return None

    # -- attention -------------------------------------------------------------------------
    def sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        if attn_mask is None:
            # Nothing to pack: the stock kernel is already the fast one.
            _stats.record_backend("sdpa")
            return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout_p, is_causal=is_causal,
                                                  scale=scale, enable_gqa=enable_gqa)
        plan = None
        if isinstance(attn_mask, torch.Tensor) and query.dim() == 4:
            plan = self.plan_for(attn_mask, query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        return scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                            enable_gqa, backend=self.backend, strict=self.strict, plan=plan)

    def plan_for(self, attn_mask: torch.Tensor, b: int, h: int, sq: int, sk: int):
        """The plan of a mask reaching attention: shared by every mask with the same derivation
        key in this forward, else cached by mask object (built, one sync, when new)."""
        k = self.key_of(attn_mask)
        pkey = None if k is None else (k, b, h, sq, sk, str(attn_mask.device))
        plan = self.plans.get(pkey) if pkey is not None else None
        if plan is None:
            plan = build_plan(attn_mask, batch_size=b, seqlen_q=sq, seqlen_k=sk, num_heads=h,
                              convention="torch", float01_as_bool=self.float_mask != "bias")
            if pkey is not None:
                self.plans[pkey] = plan
        if plan.read_as_bool:
            _float_mask_read_as_bool(self.float_mask, attn_mask)
        return plan

    # -- activation ------------------------------------------------------------------------
    def active(self):
        return _Activation(self)


def _flat(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from _flat(a, {})
        else:
            yield a


def _in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (name.endswith("_") and not name.endswith("__")) or (
        name.startswith("__i") and name.endswith("__") and name not in ("__init__", "__index__", "__int__", "__invert__", "__iter__"))


def _float_mask_read_as_bool(policy: str, mask: torch.Tensor) -> None:
    if policy == "error":
        raise InputTypeError(
            f"a float 0/1 attention mask (dtype {mask.dtype}, shape {tuple(mask.shape)}) reached "
            f"attention and float_mask='error'; pass a bool mask (True = keep), or choose "
            f"float_mask='bool' (read as keep-mask) or 'bias' (SDPA's additive reading)"
        )
    if "float01" not in _warned:
        _warned.add("float01")
        logger.warning(
            "varlen_attn: a float 0/1 attention mask reached attention (Chroma's pipeline passes "
            "one); reading it as boolean (1 = keep), as the pipeline means it, not as SDPA's "
            "additive bias. float_mask='bias' keeps the stock reading."
        )


class _VarlenMode(TorchFunctionMode):
    def __init__(self, ctx: ForwardContext):
        super().__init__()
        self.ctx = ctx

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            # Traced by dynamo: no derivation tracking (it would break the graph). SDPA goes to
            # the custom op, which finds the plan at run time (varlen_attn.compiled).
            if func is F.scaled_dot_product_attention:
                return _compiled_sdpa(self.ctx, *args, **kwargs)
            name = getattr(func, "__name__", "")
            if args and isinstance(args[0], torch.Tensor) and getattr(torch.Tensor, name, None) is func:
                # A Tensor method as a method call: dynamo cannot inline Python-level methods
                # such as Tensor.unflatten (they call super()), but traces method calls natively.
                return getattr(args[0], name)(*args[1:], **kwargs)
            return func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return self.ctx.sdpa(*args, **kwargs)
        target = args[0] if args and isinstance(args[0], torch.Tensor) and _in_place(func) else None
        if target is not None:
            # The new content is func(old content): key it before the op bumps the version.
            key = self.ctx.derive(func, args, kwargs)
            out = func(*args, **kwargs)
            if key is not None:
                self.ctx.mark(target, key)
            else:
                self.ctx.derived.pop(id(target), None)
            return out
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and (out.dtype == torch.bool or not out.requires_grad):
            key = self.ctx.derive(func, args, kwargs)
            if key is not None:
                self.ctx.mark(out, key)
        return out


def _compiled_sdpa(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
    if attn_mask is None or query.dim() != 4:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    from .compiled import compiled_attend

    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = compiled_attend(q, k, v, attn_mask, plan=None, convention="torch", dropout_p=dropout_p,
                          causal=is_causal, scale=scale, gqa=enable_gqa, backend=ctx.backend,
                          strict=ctx.strict, float_mask=ctx.float_mask)
    return out.transpose(1, 2)


class _Activation:
    """Enter ``ctx`` on this thread unless it is already the innermost active context."""

    def __init__(self, ctx: ForwardContext):
        self.ctx = ctx
        self.mode = None

    def __enter__(self):
        stack = _local.__dict__.setdefault("stack", [])
        if not (stack and stack[-1] is self.ctx):
            self.mode = _VarlenMode(self.ctx)
            self.mode.__enter__()
        stack.append(self.ctx)
        return self.ctx

    def __exit__(self, *exc):
        _local.stack.pop()
        if self.mode is not None:
            self.mode.__exit__(*exc)
        return False


def current_context() -> ForwardContext | None:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


# --------------------------------------------------------------------------------------------
# enable_varlen / disable_varlen


class _State:
    def __init__(self, model, backend, strict, float_mask, restore_checkpoint_mask):
        self.model_ref = weakref.ref(model)
        self.backend = backend
        self.strict = strict
        self.float_mask = float_mask
        self.restore_checkpoint_mask = restore_checkpoint_mask
        self.had_forward_attr = "forward" in model.__dict__
        self.orig_forward_attr = model.__dict__.get("forward")
        self.saved_backends: list[tuple[object, object]] = []
        self.signature = inspect.signature(model.forward)


def enable_varlen(
    model: torch.nn.Module,
    backend: str | None = "auto",
    *,
    strict: bool = False,
    float_mask: str = "bool",
    restore_checkpoint_mask: bool = True,
):
    """Make every masked attention inside ``model`` run packed, with one plan per forward.

    Args:
        model: a diffusers transformer, or any ``nn.Module`` whose attention calls
            ``F.scaled_dot_product_attention`` (directly or through diffusers'
            ``dispatch_attention_fn`` with the native backend).
        backend: varlen backend name or ``"auto"``; explicit names never fall back silently.
        strict: raise :class:`~varlen_attn.NotPackableError` on masks that cannot be packed
            instead of running masked SDPA for them.
        float_mask: ``"bool"``, ``"bias"`` or ``"error"``: how a float 0/1 mask reaching
            attention is read (see the module docstring).
        restore_checkpoint_mask: pass the model's ``attention_mask`` to checkpointed blocks that
            diffusers calls without it (Chroma's single blocks).

    Returns:
        ``model`` itself, also usable as a context manager via :func:`varlen`.
    """
    if not isinstance(model, torch.nn.Module):
        raise InputTypeError(f"model must be a torch.nn.Module, got {describe(model)}")
    if float_mask not in _FLOAT_POLICIES:
        raise InputValueError(f"float_mask must be one of {_FLOAT_POLICIES}, got {float_mask!r}")
    requested_backend(None if backend == "auto" else backend)  # validate the name now
    if getattr(model, "_varlen_state", None) is not None:
        disable_varlen(model)
    state = _State(model, None if backend == "auto" else backend, strict, float_mask, restore_checkpoint_mask)
    # diffusers routes attention to a non-native backend when one was set per processor; those
    # (e.g. flash_varlen) bypass SDPA and some are wrong for joint sequences. Use native while enabled.
    for module in model.modules():
        proc = getattr(module, "processor", None)
        if proc is not None and getattr(proc, "_attention_backend", None) is not None:
            state.saved_backends.append((proc, proc._attention_backend))
            proc._attention_backend = None
    orig_forward = model.forward

    @functools.wraps(orig_forward)
    def forward(*args, **kwargs):
        if torch.compiler.is_compiling():
            # The whole model is being traced: no per-forward bookkeeping (plans are found at run
            # time inside the custom op); only SDPA is redirected.
            with _VarlenMode(ForwardContext(state.backend, state.strict, state.float_mask)):
                return orig_forward(*args, **kwargs)
        return _run_forward(model, state, orig_forward, args, kwargs)

    model.forward = forward
    model._varlen_state = state
    return model


def disable_varlen(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`enable_varlen` exactly: the original forward and attention backends return."""
    state = getattr(model, "_varlen_state", None)
    if state is None:
        return model
    if state.had_forward_attr:
        model.forward = state.orig_forward_attr
    else:
        del model.forward
    for proc, backend in state.saved_backends:
        proc._attention_backend = backend
    del model._varlen_state
    return model


class varlen:  # noqa: N801 - a context manager named like the function it wraps
    """``with varlen_attn.varlen(model, ...):`` enables varlen for the block, then disables it."""

    def __init__(self, model: torch.nn.Module, backend: str | None = "auto", **kwargs):
        self.model, self.backend, self.kwargs = model, backend, kwargs

    def __enter__(self):
        return enable_varlen(self.model, self.backend, **self.kwargs)

    def __exit__(self, *exc):
        disable_varlen(self.model)
        return False


def _run_forward(model, state: _State, orig_forward, args, kwargs):
    ctx = ForwardContext(state.backend, state.strict, state.float_mask)
    bound = state.signature.bind_partial(*args, **kwargs)
    for name, value in bound.arguments.items():
        # Mask inputs, also inside dicts such as Flux's joint_attention_kwargs={"attention_mask": m}.
        items = value.items() if isinstance(value, dict) else [(name, value)]
        for sub, t in items:
            if "mask" in str(sub) and isinstance(t, torch.Tensor):
                full = sub if sub == name else f"{name}.{sub}"
                ctx.roots[full] = t
                ctx.mark(t, ("root", full))
    wrapped = _wrap_checkpointing(model, ctx, state)
    try:
        with ctx.active():
            return orig_forward(*bound.args, **bound.kwargs)
    finally:
        for module, func in wrapped:
            module._gradient_checkpointing_func = func


def _wrap_checkpointing(model, ctx: ForwardContext, state: _State):
    """Wrap every ``_gradient_checkpointing_func`` so recomputation re-enters ``ctx``."""
    wrapped = []
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if func is None or not getattr(module, "gradient_checkpointing", False):
            continue

        def ckpt(block, *args, _func=func, **kwargs):
            mask = ctx.roots.get("attention_mask")
            if state.restore_checkpoint_mask and mask is not None and isinstance(block, torch.nn.Module):
                args = _restore_mask(block, args, kwargs, mask)

            def run(*a, **kw):  # diffusers' helper calls ``module.__call__``: a function has one
                with ctx.active():
                    return block(*a, **kw)

            return _func(run, *args, **kwargs)

        module._gradient_checkpointing_func = ckpt
        wrapped.append((module, func))
    return wrapped


def _restore_mask(block, args, kwargs, mask):
    """Append ``mask`` as ``attention_mask`` when ``block`` takes it right after the given
    positional arguments and the caller left it out (diffusers' checkpoint helper passes
    positional arguments only)."""
    try:
        params = list(inspect.signature(block.forward).parameters)
    except (TypeError, ValueError):
        return args
    if "attention_mask" in kwargs or "attention_mask" not in params:
        return args
    if params.index("attention_mask") == len(args):
        return (*args, mask)
    return args


# --------------------------------------------------------------------------------------------
# VarlenAttnProcessor


class VarlenAttnProcessor:
    """A diffusers attention processor that runs another processor with varlen attention.

    ``processor`` is the processor doing the projections (default: the module's own default
    processor class, e.g. ``FluxAttnProcessor`` or ``AttnProcessor2_0``). Its SDPA calls run
    packed. Inside an ``enable_varlen`` forward the per-forward plan is shared; on its own, plans
    are cached per mask tensor object. Set on chosen modules with ``attn.set_processor(...)`` or
    on all with ``model.set_attn_processor(VarlenAttnProcessor())``.
    """

    def __new__(cls, processor=None, backend: str | None = None, strict: bool = False):
        if processor is None:
            return super().__new__(cls)
        # diffusers filters call kwargs by the processor's __call__ signature: mirror the inner one.
        sub = _processor_class(type(processor))
        return super().__new__(sub)

    def __init__(self, processor=None, backend: str | None = None, strict: bool = False):
        self.processor = processor
        self.backend = backend
        self.strict = strict
        self.float_mask = "bias"  # per-module use keeps SDPA's reading of float masks
        self._by_module: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _inner(self, attn):
        if self.processor is not None:
            return self.processor
        inner = self._by_module.get(attn)
        if inner is None:
            cls = getattr(attn, "_default_processor_cls", None)
            if cls is None:
                from diffusers.models.attention_processor import AttnProcessor2_0 as cls
            inner = self._by_module[attn] = cls()
        return inner

    def __call__(self, attn, *args, **kwargs):
        inner = self._inner(attn)
        ctx = current_context()
        if ctx is None:
            ctx = ForwardContext(self.backend, self.strict, self.float_mask)
        with ctx.active():
            return inner(attn, *args, **kwargs)


@functools.lru_cache(maxsize=None)
def _processor_class(inner_cls):
    sig = inspect.signature(inner_cls.__call__)

    def __call__(self, attn, *args, **kwargs):
        return VarlenAttnProcessor.__call__(self, attn, *args, **kwargs)

    __call__.__signature__ = sig
    return type(f"Varlen{inner_cls.__name__}", (VarlenAttnProcessor,), {"__call__": __call__})
