"""The SDPA hook: a :class:`torch.overrides.TorchFunctionMode` active for one enabled forward.

It does two things, on the thread that runs the forward only:

1. It routes every ``F.scaled_dot_product_attention`` call to varlen_attn's drop-in with the
   scope's policy: diffusers processors that go through ``dispatch_attention_fn`` (native
   backend), legacy processors that call SDPA directly (Sana, PixArt), direct calls
   (HunyuanVideo's token refiner). No processor code is copied.
2. Eagerly, it records how tensors are derived from the scope's mask inputs
   (:meth:`varlen_attn.scope.Scope.derive`), so that masks re-derived in every block share one
   plan. That is Python on every torch function the forward calls: the price of the mode
   (docs/design.md measures it). Later forwards pay it less: tracked masks (:class:`TrackedMask`)
   where only functions taking a mask matter, and the hook inside attention modules only
   (``masks_only``) where a mask is also joined with a factory's output there (Qwen-Image).

Under ``torch.compile`` the mode is traced by dynamo: it records no derivations (that would
break the graph; the custom op finds plans at run time) and re-issues Tensor methods as method
calls, because dynamo cannot inline Python-level methods such as ``Tensor.unflatten``.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import scope as scopes
from .functional import sdpa_with_policy

try:  # the higher-order op dynamo turns a torch.utils.checkpoint call into (torch >= 2.1)
    from torch._higher_order_ops.wrap import tag_activation_checkpoint as _CHECKPOINT_OP
except ImportError:  # pragma: no cover - an older torch, refused under compile anyway
    _CHECKPOINT_OP = None


def _writes_first_argument(func) -> bool:
    if getattr(getattr(func, "_schema", None), "is_mutable", False):
        return True  # an op overload that writes an argument (``aten.fill_.Scalar``: named "fill_.Scalar")
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (name.endswith("_") and not name.endswith("__")) or (
        name.startswith("__i") and name.endswith("__") and name not in ("__init__", "__index__", "__int__", "__invert__", "__iter__"))


# Functions that, where they return their input itself, never wrote it: all an inference tensor
# (no version counter) can be trusted with.
_RETURN_INPUT_UNWRITTEN = frozenset({
    torch.Tensor.bool, torch.Tensor.to, torch.Tensor.contiguous, torch.Tensor.type, torch.Tensor.type_as,
    torch.Tensor.float, torch.Tensor.double, torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.int,
    torch.Tensor.long, torch.Tensor.cpu, torch.Tensor.cuda})


def _unwritten(func, first, before) -> bool:
    """``first`` (returned by ``func`` as itself) was not written: its version did not move, or,
    an inference tensor with none, ``func`` is one that never writes."""
    if before is not None:
        return scopes.version(first) == before
    try:
        return func in _RETURN_INPUT_UNWRITTEN
    except TypeError:  # an unhashable callable
        return False


_IN_PLACE: dict = {}  # func -> bool: the hook runs on every torch function of a forward


@torch.compiler.assume_constant_result  # a constant per function while dynamo traces the hook
def _in_place(func) -> bool:
    try:
        return _IN_PLACE[func]
    except (KeyError, TypeError):  # TypeError: an unhashable callable
        flag = _writes_first_argument(func)
        if len(_IN_PLACE) < 4096:  # bounded: a caller could make new callables per call
            try:
                _IN_PLACE[func] = flag
            except TypeError:
                pass
        return flag


@torch.compiler.assume_constant_result  # a constant per function while dynamo traces the hook
def _tensor_method(func) -> bool:
    """``func`` is a method of ``torch.Tensor`` (re-issued as a method call while dynamo traces).
    Not an op overload, whose name is dotted (``attention_v4.default``): torch 2.11's dynamo
    asserts on a ``getattr`` of a dotted name."""
    name = getattr(func, "__name__", "")
    return "." not in name and getattr(torch.Tensor, name, None) is func


def _schema_writes(schema, args, kwargs) -> tuple:
    """The tensors an op overload writes, by its schema (``Tensor(a!) out``): any argument, not
    only the first (a ``torch.library.custom_op`` with ``mutates_args=("out",)``)."""
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        values = value if isinstance(value, (list, tuple)) else (value,)
        written.extend(t for t in values if isinstance(t, torch.Tensor))
    return tuple(written)


def _written(func, args, kwargs, schema: bool = True) -> tuple:
    """The tensors ``func(*args, **kwargs)`` writes in place: for an op overload, those its schema
    marks written; else its first argument (each tensor of it, for a list: ``_foreach_copy_``)
    where ``func`` is named as an in-place write (``add_``, ``__setitem__``, ``__iand__``) or is
    called with ``inplace=True`` (``F.relu``), and the ``out=`` tensor or tensors
    (``torch.logical_and(m, x, out=m)``); else none. ``schema`` False (the hook's traced branch):
    the op overload's schema is not read, as torch 2.11's dynamo cannot read ``_schema`` (a whole
    model compiled around compiled blocks stopped there), so there a custom op that writes a mask
    in place goes unseen."""
    op_schema = getattr(func, "_schema", None) if schema else None
    if op_schema is not None and getattr(op_schema, "is_mutable", False):
        return _schema_writes(op_schema, args, kwargs)
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if first is not None and _in_place(func):
        return (first,)
    if first is None and args and isinstance(args[0], (list, tuple)) and _in_place(func):
        return tuple(t for t in args[0] if isinstance(t, torch.Tensor))
    if not kwargs:  # the common case
        return ()
    if first is not None and kwargs.get("inplace"):
        return (first,)
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)):
        return tuple(t for t in out if isinstance(t, torch.Tensor))
    return ()


def _track(scope: scopes.Scope, func, args, kwargs, tracked: bool, takes_tracked: bool = True):
    """Run ``func`` eagerly and key what it makes from keyed masks (:meth:`Scope.derive`);
    ``tracked``: a new keyed output becomes a :class:`TrackedMask`, and so does a view of a
    tracked mask argument under ``inference_mode`` (:func:`_inference_views`; ``takes_tracked``
    False: no argument is one)."""
    if scopes.escapes(func):  # ``mask.data``, ``mask.numpy()``, ``mask.set_(buf)``: writes bump no version
        tensors = [a for a in scopes.flat(args, kwargs) if isinstance(a, torch.Tensor)]
        for t in tensors:  # the tensor, and a source whose storage it takes (``set_``, ``.data =``)
            scope.escape(t)
        out = func(*args, **kwargs)
        if tensors:
            scope.escape(tensors[0])  # its storage now, if it took another's
        return out
    written = _written(func, args, kwargs)
    if written:
        if scope.entered_late() and any(scope.key_of(t) is not None for t in written):
            scope.late = True  # a keyed tensor written where only the mode sees it
        # The new content is func(old content): key it before the op bumps the version. Several
        # tensors written at once (``out=(values, indices)``) are forgotten.
        key = scope.derive(func, args, kwargs) if len(written) == 1 else None
        out = func(*args, **kwargs)
        for target in written:
            if scopes.version(target) is None:
                # An inference tensor: no version counter tells its views that it changed.
                scope.forget_aliases(target)
            if key is None or not _mark(scope, target, key):
                scope.forget(target)
        return out
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    before = None if first is None else scopes.version(first)
    out = func(*args, **kwargs)
    if out is first and first is not None and _unwritten(func, first, before):
        # A function that returned its input itself, unwritten (``mask.bool()`` of a bool mask,
        # ``.to`` its own dtype or device, ``.contiguous()``): it keeps its key. Keyed again, it
        # would get a longer one in every layer that does this, and every such layer a plan (and
        # a host sync) of its own.
        return out
    if scopes.keyable_output(out):
        key = scope.derive(func, args, kwargs)
        if key is None and tracked and scope.escaped and type(out) is not TrackedMask and _from_masks(args, kwargs, out):
            # Made from a tracked mask whose memory escaped (Scope.escape): unkeyed, but still a
            # tracked mask, so the attention call it reaches comes to varlen_attn (plan by value).
            return out.as_subclass(TrackedMask)
        if key is not None:
            if scope.tracking == scopes.MODE and scope.entered_late() and any(
                    isinstance(a, torch.Tensor) and _plain_key(scope.key_of(a)) for a in scopes.flat(args, kwargs)):
                scope.late = True  # a plain keyed tensor used where only the mode follows it
            # A factory's output becomes a tracked mask only when it is a bool mask: an index or
            # position tensor (``torch.arange``) a module keeps must not stay a subclass.
            if tracked and type(out) is not TrackedMask and (
                    out.dtype == torch.bool or not scopes.is_factory(func)):
                out = out.as_subclass(TrackedMask)
            _mark(scope, out, key)
    return _inference_views(args, kwargs, out) if tracked and takes_tracked else out


def _inference_views(args, kwargs, out):
    """``out`` with each output tensor that shares the storage of a tracked mask argument made a
    tracked mask too, where they are inference tensors. Such a view left as a plain tensor (an
    element of what ``unbind``, ``split`` or ``chunk`` return, or ``mask.view_as(activation)``,
    unkeyed) would be written unseen: no version counter shows the write, and a plain tensor does
    not enter the hook, so the mask kept its key and later layers its plan. As a tracked mask its
    write is seen (``_written``) and forgets the mask's key (:meth:`Scope.forget_aliases`)."""
    single = isinstance(out, torch.Tensor)
    outs = (out,) if single else out if isinstance(out, (tuple, list)) else ()
    if all(not isinstance(o, torch.Tensor) or type(o) is TrackedMask or not o.is_inference() for o in outs):
        return out  # the common case: no plain inference tensor among the outputs
    # Non-empty only: every empty tensor's storage has address 0, no view of a mask by that.
    storages = {scopes.storage_ptr(a) for a in scopes.flat(args, kwargs)
                if type(a) is TrackedMask and a.is_inference() and a.numel()}
    storages.discard(None)  # no storage (sparse, nested)
    if not storages:
        return out
    views = [o.as_subclass(TrackedMask) if isinstance(o, torch.Tensor) and type(o) is not TrackedMask
             and o.numel() and scopes.storage_ptr(o) in storages else o for o in outs]
    return views[0] if single else type(out)(views)


def _from_masks(args, kwargs, out: torch.Tensor) -> bool:
    """``out`` is a mask made from tracked masks: a bool output of a call taking one, or any
    output of a call whose tensor inputs all are (not an activation multiplied by a mask)."""
    tensors = [a for a in scopes.flat(args, kwargs) if isinstance(a, torch.Tensor)]
    if not any(type(a) is TrackedMask for a in tensors):
        return False
    return out.dtype == torch.bool or all(type(a) is TrackedMask for a in tensors)


def _mark(scope: scopes.Scope, t: torch.Tensor, key) -> bool:
    """Key ``t``, if its writes will be seen while the key lives; False where not keyed. A
    tracked mask's writes always are (its own ``__torch_function__``), as is everything under the
    mode over a whole forward. A plain tensor, in a forward that tracks masks, only while the
    hook of an attention module runs: its key goes when that hook leaves (model._leave), and
    without a hook it gets none (under ``inference_mode`` no version counter would show a write)."""
    if type(t) is TrackedMask or scope.tracking == scopes.MODE:
        scope.mark(t, key)
        return True
    for call in reversed(scope.attention):
        if call.mode is not None:
            scope.mark(t, key)
            call.plain.append(t)
            return True
    return False


def _plain_key(key) -> bool:
    """A tensor keyed ``key`` may be a plain tensor in a forward that tracks masks: a factory's
    output (a tracked mask only when bool), or last written in place (a tensor stays what it
    was). Past an attention module's entry only the mode follows it (:data:`scopes.ENTRY`)."""
    return key is not None and (scopes.is_factory(key[0]) or _in_place(key[0]))


def _takes_keyed(scope: scopes.Scope, args, kwargs) -> bool:
    """A call takes a keyed tensor that is not a tracked mask (those enter by ``types``): a plain
    tensor the hook keyed inside this attention module (a factory output that is not bool, such
    as the ``torch.ones(..., dtype=torch.int32)`` of CogView4's training processor, and what is
    written into it) or a mask keyed by object. Its output is keyed too, and a write to it seen
    (what a call writes is among its arguments: ``_written``)."""
    derived = scope.derived
    return any(isinstance(a, torch.Tensor) and id(a) in derived and scope.key_of(a) is not None
               for a in scopes.flat(args, kwargs))


def _mask_of(args, kwargs):
    """``attn_mask`` of an SDPA call."""
    return args[3] if len(args) > 3 else kwargs.get("attn_mask")


class VarlenHook(TorchFunctionMode):
    """``masks_only``: inside an attention module of a forward that tracks masks
    (``model._AttentionForward``), where every keyed tensor is a tracked mask: only calls that
    take one, and factories, are tracked. Elsewhere every call is (a compiled block run eagerly
    gets its masks as plain keyed tensors, ``plain``)."""

    def __init__(self, scope: scopes.Scope, masks_only: bool = False):
        super().__init__()
        self.scope = scope
        self.masks_only = masks_only

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            mask = _mask_of(args, kwargs)
            if self.scope.policy.model and mask is None:
                # No mask: stock SDPA, untouched and not counted, as where masks are tracked.
                return func(*args, **kwargs)
            if (mask is not None and self.scope.tracking == scopes.MODE and self.scope.entered_late()
                    and _plain_key(self.scope.key_of(mask))):
                self.scope.late = True  # an attention mask only the mode would route
            adopt_checkpoint(self.scope)
            with torch._C.DisableTorchFunctionSubclass():  # a tracked mask is plain in here
                return sdpa_with_policy(*args, **kwargs, policy=self.scope.policy, forward=self.scope.forward)
        if torch.compiler.is_compiling():
            if func is _CHECKPOINT_OP:
                # A torch.utils.checkpoint call in traced code: dynamo hands the mode the
                # higher-order op it makes of the call, with the checkpointed function, before
                # it traces that function's body, which it traces without the modes around it
                # (attention there would run stock SDPA, the masks the body derives would be
                # unknown). The op is called again with the function under this hook.
                return func(_HookedBody(args[0], self.scope), *args[1:], **kwargs)
            if args and isinstance(args[0], torch.Tensor) and _tensor_method(func):
                out = getattr(args[0], func.__name__)(*args[1:], **kwargs)
            else:
                out = func(*args, **kwargs)
            written = _written(func, args, kwargs, schema=False)
            for t in written:
                scopes.trace_forget(t)
            if not written:
                scopes.trace_derive(func, args, kwargs, out)
            return out
        if self.scope.tracking == scopes.MODE:
            return _track(self.scope, func, args, kwargs, False)
        # A forward that tracks masks: what the hook keys leaves as a tracked mask.
        if TrackedMask not in types:
            # Inside attention modules (masks_only) a call that takes no tracked mask, no other
            # keyed tensor and is no factory just runs.
            if self.masks_only and not scopes.is_factory(func) and not _takes_keyed(self.scope, args, kwargs):
                return func(*args, **kwargs)
            return _track(self.scope, func, args, kwargs, True, takes_tracked=False)
        with torch._C.DisableTorchFunctionSubclass():  # handled here, once, not by the subclass
            return _track(self.scope, func, args, kwargs, True)


class _HookedBody:
    """The function a checkpoint in traced code runs (:meth:`VarlenHook.__torch_function__`),
    called under a hook of ``scope``: every checkpoint dynamo traces, diffusers' own
    (``model._traced_checkpoint``) and the caller's alike."""

    def __init__(self, body, scope: scopes.Scope):
        self.body, self.scope = body, scope

    def __call__(self, *args, **kwargs):
        with VarlenHook(self.scope):
            return self.body(*args, **kwargs)


class TrackedMask(torch.Tensor):
    """A mask input of an enabled forward that runs without the mode, and every mask derived
    from one: only the torch functions that take a tracked mask enter Python (activations never
    do). They key their outputs as the mode does, and an SDPA call whose mask is tracked goes to
    varlen_attn. A scope uses this tracking only where it was seen to reach every masked
    attention call (:mod:`varlen_attn.model`). Outside its scope, or traced by dynamo, a tracked
    mask is a plain tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        scope = scopes.current_scope()
        with torch._C.DisableTorchFunctionSubclass():
            if scope is None or scope.tracking == scopes.MODE or torch.compiler.is_compiling():
                return func(*args, **kwargs)
            if getattr(func, "__name__", "") == "__get__" and not scopes.escapes(func):  # .shape, .dtype
                out = func(*args, **kwargs)
                # ``mask.T``, ``mask.mT``: a view, which under inference_mode must stay tracked.
                return _inference_views(args, kwargs, out) if isinstance(out, torch.Tensor) else out
            if func is F.scaled_dot_product_attention:
                adopt_checkpoint(scope)
                return sdpa_with_policy(*args, **kwargs, policy=scope.policy)
            return _track(scope, func, args, kwargs, True)


def tracked(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a :class:`TrackedMask` (an alias: same storage, same autograd history)."""
    return t if type(t) is TrackedMask else t.as_subclass(TrackedMask)


def hooked(scope: scopes.Scope) -> bool:
    """A hook of ``scope`` is active on this thread."""
    from torch.overrides import _get_current_function_mode_stack

    return any(isinstance(m, VarlenHook) and m.scope is scope for m in _get_current_function_mode_stack())


def plain(value, scope: scopes.Scope):
    """``value`` (an argument, or a tuple, list or dict of them) with every tracked mask as a plain
    tensor keyed as the tracked one was: what compiled code is given (dynamo cannot trace a
    :class:`TrackedMask`). The same object where there is nothing to unwrap."""
    if type(value) is TrackedMask:
        with torch._C.DisableTorchFunctionSubclass():
            out = value.as_subclass(torch.Tensor)  # an alias: same storage, autograd history
            key = scope.key_of(value)
            if key is not None:
                scope.mark(out, key)
        return out
    if isinstance(value, (tuple, list)) and any(type(v) is TrackedMask for v in value):
        return type(value)(plain(v, scope) for v in value)
    if isinstance(value, dict) and any(type(v) is TrackedMask for v in value.values()):
        return {k: plain(v, scope) for k, v in value.items()}
    return value


_boundary = threading.local()


class hidden:  # noqa: N801 - a context manager
    """The hooks on top of this thread's mode stack taken off for the block, around a compiled
    module's call: it runs its graph without them (its attention was routed while tracing,
    :class:`VarlenHook` entered inside the compiled code), so neither the compiled runtime's
    Python nor dynamo's guards see them. :func:`hidden_scope` names ``scope`` meanwhile, for a
    compiled module that runs eagerly after all (``torch.compiler.set_stance("force_eager")``)."""

    def __init__(self, scope: scopes.Scope):
        self.scope = scope

    def __enter__(self):
        from torch.overrides import _get_current_function_mode_stack

        _boundary.__dict__.setdefault("scopes", []).append(self.scope)
        self.popped = []
        stack = _get_current_function_mode_stack()
        while stack and isinstance(stack[-1], VarlenHook):
            self.popped.append(torch._C._pop_torch_function_stack())
            stack.pop()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self.popped):
            torch._C._push_on_torch_function_stack(mode)
        _boundary.scopes.pop()
        return False


def hidden_scope() -> scopes.Scope | None:
    """The scope whose hooks the innermost :class:`hidden` on this thread took off, or None."""
    stack = getattr(_boundary, "scopes", None)
    return stack[-1] if stack else None


class active:  # noqa: N801 - a context manager
    """Make ``scope`` current on this thread and, when it tracks by mode (or ``mode`` is True),
    its hook active, unless it already is the innermost (a checkpoint recomputation re-entering
    its forward's scope)."""

    def __init__(self, scope: scopes.Scope, mode: bool | None = None):
        self.scope = scope
        self.with_mode = scope.tracking == scopes.MODE if mode is None else mode
        self.mode = None

    def __enter__(self):
        fresh = scopes.push(self.scope)
        # Not fresh: the forward (or recomputation) already entered it, with its hook when it
        # tracks by mode. A processor inside a forward that tracks masks needs the hook itself.
        if self.with_mode and (fresh or (self.scope.tracking != scopes.MODE and not hooked(self.scope))):
            self.mode = VarlenHook(self.scope)
            self.mode.__enter__()
        return self.scope

    def __exit__(self, *exc):
        scopes.pop()
        if self.mode is not None:
            self.mode.__exit__(*exc)
        return False


# --- Checkpoints the model did not wrap ---------------------------------------------------------
# A model (or a trainer: OneTrainer wraps blocks this way) may call torch.utils.checkpoint itself,
# not through diffusers' ``_gradient_checkpointing_func`` that enable_varlen wraps. Its
# recomputation runs in backward, outside the forward's scope: attention there would run stock
# SDPA where the forward ran varlen, and torch's checkpoint stops ("A different number of tensors
# was saved"). So the first attention call (or compiled block) inside such a checkpoint's forward
# makes its recomputation re-enter the forward's scope, as varlen_attn.model._Checkpoint does:
# same plans, no rebuild, same kernels. torch's non-reentrant checkpoint keeps the recomputation
# in its frame (``_CheckpointFrame.recompute_fn``), which the innermost saved-tensor hooks (its
# ``_checkpoint_hook``) hold while its forward runs. A reentrant checkpoint runs its forward
# without autograd and compares nothing: its recomputation runs outside the scope (eagerly on
# stock SDPA; compiled blocks plan again), with equal results.


def checkpoint_frame():
    """The frame of the torch.utils.checkpoint (non-reentrant) whose forward this thread is
    running inside, when its hooks are the innermost saved-tensor hooks; else None (also where
    a torch version lays them out otherwise)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if hooks is None:
        return None
    pack = hooks[0]
    code = getattr(pack, "__code__", None)
    if code is None or getattr(pack, "__qualname__", "") != "_checkpoint_hook.__init__.<locals>.pack_hook":
        return None
    try:
        frame = pack.__closure__[code.co_freevars.index("frame")].cell_contents
    except (ValueError, IndexError, TypeError, AttributeError):
        return None
    return frame if callable(getattr(frame, "recompute_fn", None)) else None


class _Reentered:
    """A checkpoint frame's recomputation, run in the scope of the forward that made it."""

    def __init__(self, recompute, scope: scopes.Scope):
        self.recompute, self.scope = recompute, scope

    def __call__(self, *args, **kwargs):
        with active(self.scope):
            return self.recompute(*args, **kwargs)


def adopt_checkpoint(scope: scopes.Scope) -> None:
    """Make the recomputation of the checkpoint whose forward is running here (if any) re-enter
    ``scope``; once per checkpoint. Only a checkpoint that began inside the scope's forward: not
    one around the whole forward (``Scope.enclosing_frame``), whose recomputation holds more
    than this scope's attention, nor for a scope that adopts none (``Scope.adopts``). Eager
    only (no-op while dynamo traces)."""
    if torch.compiler.is_compiling() or not scope.adopts:
        return
    frame = checkpoint_frame()
    if frame is not None and frame is not scope.enclosing_frame and not isinstance(frame.recompute_fn, _Reentered):
        frame.recompute_fn = _Reentered(frame.recompute_fn, scope)
