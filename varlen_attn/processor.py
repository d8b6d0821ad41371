"""``VarlenAttnProcessor``: a diffusers attention processor that runs another one packed.

Which processor it runs must be given: diffusers' ``set_attn_processor`` / ``set_processor``
assign the new processor (``module.processor = processor``) without handing it the one it
replaces, so a processor installed that way cannot know the module's own processor (Sana's
linear attention, Qwen-Image's joint processor) and a guessed default class would silently
compute something else. :meth:`VarlenAttnProcessor.wrap` reads each module's current processor
first (``get_processor()``, what ``model.attn_processors`` lists) and installs one wrapper per
module around it; :meth:`VarlenAttnProcessor.unwrap` puts those very objects back.
"""

from __future__ import annotations

import functools
import inspect

import torch

from ._errors import InputTypeError, InputValueError, describe
from .execution import Entry, active, current
from .hook import install
from .policy import Policy

_WHAT_TO_DO = (
    "diffusers' set_attn_processor/set_processor replace a module's processor without passing on "
    "the one they replace, so a VarlenAttnProcessor() set that way cannot know the module's own "
    "processor (e.g. Sana's linear attention, Qwen-Image's joint processor) and would run a "
    "different one. To run every attention module's own processor packed use "
    "VarlenAttnProcessor.wrap(model) (VarlenAttnProcessor.unwrap(model) puts the originals back); "
    "for one module: attn.set_processor(VarlenAttnProcessor(attn.get_processor()))."
)


def _to_inner(name: str) -> property:
    """An attribute read and written through to the wrapped processor."""
    return property(lambda self: getattr(self.processor, name),
                    lambda self, value: setattr(self.processor, name, value))


class VarlenAttnProcessor:
    """A diffusers attention processor that runs another processor with varlen attention.

    ``processor`` is the processor doing the projections (an instance; required): usually the
    module's own, ``VarlenAttnProcessor(attn.get_processor())``. Its SDPA calls run packed. The
    instance mirrors ``processor.__call__``'s signature, by which diffusers filters the keyword
    arguments it passes. Inside an ``enable_varlen`` forward the model's policy (``backend``,
    ``strict``, ``float_mask``) applies. On its own, its ``backend`` and ``strict`` apply, and
    float masks keep SDPA's reading (``float_mask="bias"``). Either way each call builds its plan
    from its own mask.

    For a whole model use :meth:`wrap` (each module's current processor, wrapped) and
    :meth:`unwrap`. ``model.set_attn_processor(VarlenAttnProcessor())`` cannot work (diffusers
    does not hand over the processor it replaces), so ``VarlenAttnProcessor()`` without a
    processor raises, before anything on the model has changed.

    diffusers' per-processor settings ``_attention_backend`` and ``_parallel_config``
    (``set_attention_backend``, ``enable_parallelism``, ``enable_varlen``'s native backend) read
    and write the wrapped processor's.
    """

    def __new__(cls, processor=None, backend: str | None = None, strict: bool = False):
        if processor is None or isinstance(processor, type):
            return super().__new__(cls)  # __init__ refuses it
        # diffusers filters call kwargs by the processor's __call__ signature: mirror the inner one.
        # Built on ``cls``: a subclass keeps its own __init__ and __call__.
        return super().__new__(_processor_class(cls, type(processor)))

    def __init__(self, processor=None, backend: str | None = None, strict: bool = False):
        if processor is None:
            raise InputTypeError("VarlenAttnProcessor needs the processor it runs packed. " + _WHAT_TO_DO)
        if isinstance(processor, type) or not callable(processor):
            raise InputTypeError(f"processor must be an attention processor instance, got {describe(processor)}")
        Policy.of(backend, strict)  # validate now; $VARLEN_ATTN_BACKEND is read per call
        install()
        self.processor = processor
        self.backend, self.strict = backend, strict

    def __call__(self, attn, *args, **kwargs):
        if current() is not None:  # inside an enabled model: its policy
            return self.processor(attn, *args, **kwargs)
        with active(Entry(Policy.of(self.backend, self.strict, "bias", model=True))):
            return self.processor(attn, *args, **kwargs)

    def __reduce__(self):
        # The mirroring subclass is made at run time (not importable): rebuild through the constructor
        # of the class it was made for (VarlenAttnProcessor or a subclass of it).
        return type(self).__dict__.get("_mirrors", type(self)), (self.processor, self.backend, self.strict)

    def __repr__(self):
        return (f"VarlenAttnProcessor({getattr(self, 'processor', None)!r}, backend={getattr(self, 'backend', None)!r}, "
                f"strict={getattr(self, 'strict', False)!r})")

    # diffusers sets these on module.processor when hasattr() says the processor has them.
    _attention_backend = _to_inner("_attention_backend")
    _parallel_config = _to_inner("_parallel_config")

    # -- a whole model ---------------------------------------------------------------------------

    @staticmethod
    def wrap(model: torch.nn.Module, backend: str | None = None, strict: bool = False) -> torch.nn.Module:
        """Wrap every diffusers attention module's *current* processor in ``model`` (``model``
        itself included) in its own ``VarlenAttnProcessor(processor, backend, strict)``.

        The modules are those diffusers' ``set_attn_processor`` sets (they have ``set_processor``
        and ``get_processor``); each keeps its own processor, shared instances and linear
        attention included, so the model computes what it computed before. A processor that
        already is a ``VarlenAttnProcessor`` is re-wrapped with the new ``backend``/``strict``,
        never nested. Refused, with nothing changed: a model without attention modules, and a
        processor that is a ``torch.nn.Module`` (its weights would leave the model's parameters
        and state dict; use :func:`varlen_attn.enable_varlen` there). Returns ``model``.
        """
        modules = _attention_modules(model)
        if not modules:
            raise InputValueError(
                f"{type(model).__name__} has no diffusers attention module (a module with set_processor "
                "and get_processor): nothing to wrap. enable_varlen(model) works on any module that calls SDPA.")
        new = []
        for name, module in modules:
            inner = module.get_processor()
            if isinstance(inner, VarlenAttnProcessor):
                inner = inner.processor
            if isinstance(inner, torch.nn.Module):
                raise InputTypeError(
                    f"the processor of {name or type(model).__name__} ({type(inner).__name__}) is a torch.nn.Module: "
                    "wrapped, its weights would leave the model's parameters and state dict. Use "
                    "varlen_attn.enable_varlen(model), which keeps every processor.")
            new.append((module, None if inner is None else VarlenAttnProcessor(inner, backend, strict)))
        for module, proc in new:  # every wrapper made (and validated) before the first change
            if proc is not None:
                module.set_processor(proc)
        return model

    @staticmethod
    def unwrap(model: torch.nn.Module) -> torch.nn.Module:
        """Put back, in every attention module of ``model`` whose processor is a
        ``VarlenAttnProcessor``, the processor it wraps (the same object :meth:`wrap` found
        there). Modules with other processors are left alone. Returns ``model``."""
        for _, module in _attention_modules(model):
            proc = module.get_processor()
            if isinstance(proc, VarlenAttnProcessor):
                module.set_processor(proc.processor)
        return model


def _attention_modules(model) -> list:
    if not isinstance(model, torch.nn.Module):
        raise InputTypeError(f"model must be a torch.nn.Module (of a pipeline: pass pipe.transformer), "
                             f"got {type(model).__name__}")
    return [(name, m) for name, m in model.named_modules()
            if callable(getattr(m, "set_processor", None)) and callable(getattr(m, "get_processor", None))]


@functools.cache
def _processor_class(cls, inner_cls):
    """A subclass of ``cls`` (VarlenAttnProcessor or a subclass of it) whose ``__call__`` is
    ``cls``'s under the signature of ``inner_cls.__call__``, by which diffusers filters the
    keyword arguments it passes."""
    sig = inspect.signature(inner_cls.__call__)

    def __call__(self, attn, *args, **kwargs):
        return cls.__call__(self, attn, *args, **kwargs)

    __call__.__signature__ = sig
    return type(f"Varlen{inner_cls.__name__}", (cls,), {"__call__": __call__, "_mirrors": cls})
