"""``VarlenAttnProcessor``: a diffusers attention processor that runs another one packed."""

from __future__ import annotations

import functools
import inspect
import weakref

from .hook import active
from .scope import Policy, Scope, current_scope


class VarlenAttnProcessor:
    """A diffusers attention processor that runs another processor with varlen attention.

    ``processor`` is the processor doing the projections (default: the module's own default
    processor class, e.g. ``FluxAttnProcessor`` or ``AttnProcessor2_0``). Its SDPA calls run
    packed. Inside an ``enable_varlen`` forward it joins that forward's scope: the model's
    policy (``backend``, ``strict``, ``float_mask``) applies and its per-forward plans are shared,
    one policy per forward. On its own, its ``backend`` and ``strict`` apply, plans are cached
    per mask tensor object, and float masks keep SDPA's reading (``float_mask="bias"``).
    Set on chosen modules with ``attn.set_processor(...)`` or on all with
    ``model.set_attn_processor(VarlenAttnProcessor())``.
    """

    def __new__(cls, processor=None, backend: str | None = None, strict: bool = False):
        if processor is None:
            return super().__new__(cls)
        # diffusers filters call kwargs by the processor's __call__ signature: mirror the inner one.
        sub = _processor_class(type(processor))
        return super().__new__(sub)

    def __init__(self, processor=None, backend: str | None = None, strict: bool = False):
        self.processor = processor
        self.backend, self.strict = backend, strict
        Policy.of(backend, strict)  # validate now; $VARLEN_ATTN_BACKEND is read per call
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
        scope = current_scope()
        if scope is None:
            scope = Scope(Policy.of(self.backend, self.strict, "bias", model=True))
        with active(scope):
            return inner(attn, *args, **kwargs)


@functools.lru_cache(maxsize=None)
def _processor_class(inner_cls):
    sig = inspect.signature(inner_cls.__call__)

    def __call__(self, attn, *args, **kwargs):
        return VarlenAttnProcessor.__call__(self, attn, *args, **kwargs)

    __call__.__signature__ = sig
    return type(f"Varlen{inner_cls.__name__}", (VarlenAttnProcessor,), {"__call__": __call__})
