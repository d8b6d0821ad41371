"""``enable_varlen(model)``, ``disable_varlen(model)`` and ``varlen(model)``.

``enable_varlen`` wraps the model's ``forward``. Each forward gets a
:class:`~varlen_attn.scope.Scope` (the policy, the mask inputs, one plan per distinct mask) and
runs under the SDPA hook (:mod:`varlen_attn.hook`). The mask inputs are the keyword arguments
whose name contains ``mask``, also inside dicts such as Flux's ``joint_attention_kwargs``.

Gradient checkpointing: the recomputation runs in backward, outside ``forward``; checkpointed
blocks are wrapped so they re-enter the same scope (same plans, no rebuild, same kernels, so the
recomputed tensors match). diffusers' Chroma drops ``attention_mask`` from its checkpointed
single-block calls; with ``restore_checkpoint_mask=True`` (default) the mask the model was
called with is passed back in, so a masked model trains the same with and without checkpointing.

Under ``torch.compile`` of the whole model the wrapper itself is traced: the hook is entered with
a scope holding the policy only (the custom op resolves plans at run time), and the checkpoint
wrapping is done as a traceable call-time wrapper.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading

import torch
import torch.utils.checkpoint

from . import _stats
from ._errors import InputTypeError, check_bool, describe
from .hook import (TrackedMask, VarlenHook, active, adopt_checkpoint, checkpoint_frame, hidden, hidden_scope, hooked,
                   plain, tracked)
from .op import InGraphDeclined, forward_scope, fullgraph_traced, refuse_unsupported_compile
from .scope import ENTRY, LOCAL, MODE, TRACKED, AttentionCall, Policy, Scope, current_scope, trace_root

from torch._dynamo.eval_frame import OptimizedModule as _OptimizedModule

logger = logging.getLogger("varlen_attn")


class _State:
    """What ``enable_varlen`` keeps on the model (``model._varlen_state``): plain data and the
    model's forward entry, no closure and no reference outside the model, so it deep-copies and
    pickles with the model."""

    # While dynamo traces a whole model compiled: its forward's handle (op.forward_scope). A
    # class default: states pickled before it existed read None.
    traced_forward = None
    # Forwards with no mask input that followed nothing (_learn_without_masks); class default too.
    unmasked_forwards = 0

    def __init__(self, backend, strict, float_mask, restore_checkpoint_mask, in_graph=True):
        self.backend = backend
        self.strict = strict
        self.float_mask = float_mask
        self.restore_checkpoint_mask = restore_checkpoint_mask
        self.in_graph = in_graph
        self.saved_backends: list[tuple[object, object]] = []
        self.entry: _Forward | None = None
        self.checkpointed: list[torch.nn.Module] = []
        # Compiled submodules given a _Boundary and a _BlockForward (undone by disable_varlen).
        self.compiled: list[torch.nn.Module] = []
        # The forwards of the attention modules (those with a processor), while enabled.
        self.attention: list[_AttentionForward] = []
        # Per set of mask input names: how a forward with them follows its masks, as a mode
        # forward learned it (scope.Scope.learned), and how many masked attention calls it saw.
        self.tracking: dict[tuple[str, ...], tuple[str, int]] = {}
        # The attention modules' children carry _leave_entry (forward pre-hooks) while a forward
        # learns or tracks ENTRY (_watch; changed only by a forward running alone: ``running``
        # counts this model's forwards in progress). Mask input names whose ENTRY forward missed
        # a masked attention call learn LOCAL at most from then on.
        self.watching = False
        self.running = 0
        self.no_entry: set[tuple[str, ...]] = set()

    def __setstate__(self, state: dict) -> None:
        # A model pickled enabled by an earlier release: what it lacks starts empty (its forwards
        # learn again under the mode).
        state.pop("root_derived", None)
        self.__dict__.update({"tracking": {}, "attention": [], "compiled": [], "watching": False,
                              "no_entry": set(), "in_graph": True, **state, "running": 0})

    def policy(self, in_graph: bool = False) -> Policy:
        return Policy.of(self.backend, self.strict, self.float_mask, model=True, in_graph=in_graph)


class _InstanceForward:
    """A ``forward`` set on a module instance: a plain callable object holding its module, so
    that ``copy.deepcopy`` (EMA and teacher copies) rebinds it to the copy and ``torch.save``
    pickles it with the model. ``inner`` is the instance ``forward`` it replaced (another
    wrapper), or None for the class's own. ``active`` False: it only passes calls on (taken off
    while a wrapper added around it later still holds it)."""

    def __init__(self, module: torch.nn.Module, inner):
        self.module = module
        self.inner = inner
        self.active = True
        # The class's function, read once here: dynamo cannot trace ``type(module).forward``.
        self.func = type(module).forward

    @property
    def __signature__(self):  # inspect.signature(model.forward), as diffusers pipelines read it
        return inspect.signature(self._target())

    def _target(self):
        # A partial, not ``function.__get__``: dynamo before torch 2.10 cannot trace the latter.
        return self.inner if self.inner is not None else functools.partial(self.func, self.module)


class _Forward(_InstanceForward):
    """``model.forward`` while enabled. After :func:`disable_varlen` it only passes calls
    through, for wrappers added around it later (accelerate's) that still hold it."""

    @property
    def __wrapped__(self):
        # Only when this entry wraps another instance-level forward: accelerate's unwrap_model
        # follows __wrapped__ to strip its own wrappers; enabled after accelerate's prepare, this
        # entry goes with them (the model then runs stock; enable again), rather than keeping
        # a bf16 autocast that keep_fp32_wrapper=False asked to remove.
        if self.inner is None:
            raise AttributeError("__wrapped__")
        return self.inner

    def __call__(self, *args, **kwargs):
        if args and isinstance(args[0], torch.nn.Module):
            # Bound with MethodType to a module (accelerate's unwrap_model re-binds the forward it
            # finds): that module's own entry runs, which is this one unless the binding was
            # deep-copied with another model.
            state = getattr(args[0], "_varlen_state", None)
            if state is not None and state.entry is not None:
                return state.entry._run(args[1:], kwargs)
            if args[0] is self.module:
                args = args[1:]
        return self._run(args, kwargs)

    def _run(self, args, kwargs):
        module = self.module
        target = self._target()
        state = getattr(module, "_varlen_state", None)
        if not self.active or state is None:
            return target(*args, **kwargs)
        if torch.compiler.is_compiling():
            # Also here, not only in dispatch: where dynamo does not trace the hook (torch 2.5),
            # attention would never reach dispatch and the model would silently run stock.
            refuse_unsupported_compile()
            return _traced_forward(module, state, target, args, kwargs)
        return _run_forward(module, state, target, args, kwargs)


class _AttentionForward(_InstanceForward):
    """``forward`` of an attention module (one with a diffusers ``processor``) while the model is
    enabled. It tells the running forward's scope that attention is entered, so a forward under
    the mode learns which factory outputs are made inside attention modules only
    (:meth:`varlen_attn.scope.Scope.learned`), and in a forward that tracks :data:`LOCAL` it
    runs the module under the hook: the mode is paid inside attention modules, not on the rest
    of the forward; under :data:`ENTRY`, only up to the module's first submodule call
    (:func:`_leave_entry`). Traced by dynamo, or after :func:`disable_varlen`, it only passes
    calls on."""

    def __call__(self, *args, **kwargs):
        target = self._target()
        scope = current_scope() if self.active and not torch.compiler.is_compiling() else None
        if scope is None:
            return target(*args, **kwargs)
        call = AttentionCall(self.module)
        scope.attention.append(call)
        followed: list = []
        try:
            args, kwargs = _follow_mask_arguments(scope, self.module, args, kwargs, followed)
            if scope.tracking in (LOCAL, ENTRY) and not hooked(scope):  # not a second hook over one
                call.mode = VarlenHook(scope, masks_only=True)
                call.mode.__enter__()
            return target(*args, **kwargs)
        finally:
            if call.mode is not None:
                _leave(scope, call)
            for t in followed:  # keys no write to them would be seen past this call
                scope.forget(t)
            scope.attention.pop()


def _follow_mask_arguments(scope: Scope, module, args, kwargs, forget: list):
    """``args`` and ``kwargs`` of an attention module's call, every plain tensor argument named like
    a mask (``attention_mask``) keyed: as it is, else by object, so every layer handed this tensor
    shares one plan, also for the masks the module derives from it (HunyuanVideo 1.5 pads and
    squares its reordered text mask in every processor). In a forward under the mode that is all
    (the mode sees every write). In a forward that tracks masks it is handed on as a tracked mask:
    one the forward could not follow to here (made where tracked masks are not seen, such as
    Lumina2's joint mask from ``new_zeros`` in a forward that learned on a batch with none) would
    reach SDPA unseen and run stock. A mask that needs a gradient is left alone. There an
    inference tensor (no version counter: a write to it outside attention modules would go
    unseen) keeps the keys given here for this call only: they go to ``forget``."""
    names = _param_names(type(module)) or ()
    out_args = None
    for i, value in enumerate(args):
        if i < len(names) and _names_a_mask(names[i]) and _plain_mask(value):
            out_args = out_args or list(args)
            out_args[i] = _followed(scope, value, forget)
    out_kwargs = None
    for name, value in kwargs.items():
        if _names_a_mask(name) and _plain_mask(value):
            out_kwargs = out_kwargs or dict(kwargs)
            out_kwargs[name] = _followed(scope, value, forget)
    return (args if out_args is None else tuple(out_args)), (kwargs if out_kwargs is None else out_kwargs)


def _plain_mask(value) -> bool:
    return type(value) is torch.Tensor and not value.requires_grad


def _followed(scope: Scope, mask: torch.Tensor, forget: list) -> torch.Tensor:
    key = scope.key_of(mask)
    if scope.tracking == MODE:
        if key is None:
            scope.key_object(mask)
        return mask
    inference = mask.is_inference()
    if key is None:
        key = scope.key_object(mask)
        if inference:
            forget.append(mask)
    alias = tracked(mask)
    scope.mark(alias, key)
    if inference:
        forget.append(alias)
    return alias


def _leave(scope: Scope, call: AttentionCall) -> None:
    """Take the hook of ``call`` off this thread's mode stack (from under any mode entered since
    and still active) and drop the keys it gave plain tensors: no one sees them written from
    here on."""
    mode, call.mode = call.mode, None
    above = []  # modes entered since and still active (not ours: left as they are)
    while torch._C._len_torch_function_stack():
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)
    for t in call.plain:
        scope.forget(t)
    call.plain.clear()


def _leave_entry(child: torch.nn.Module, args) -> None:
    """Forward pre-hook of the children of attention modules while enabled: marks the running
    attention module's first submodule call (a forward under the mode learns what came after
    it: :attr:`Scope.late`), and under :data:`ENTRY` takes that module's hook off there. A
    stateless function, so the children deep-copy and pickle as before."""
    if torch.compiler.is_compiling():
        return None
    scope = current_scope()
    if scope is None or not scope.attention:
        return None
    call = scope.attention[-1]
    if call.entered or not any(c is child for c in call.module.__dict__["_modules"].values()):
        return None
    call.entered = True
    if call.mode is not None and scope.tracking == ENTRY:
        # Only from the top of the stack: a mode entered since and still active stays above it.
        n = torch._C._len_torch_function_stack()
        if n and torch._C._get_function_stack_at(n - 1) is call.mode:
            _leave(scope, call)
    return None


def _watch(state: _State, on: bool) -> None:
    """Give the attention modules' children :func:`_leave_entry` (``on``), or take it off."""
    if state.watching == on:
        return
    state.watching = on
    for wrapper in state.attention:
        if wrapper.active:
            _watch_children(wrapper.module, on)


def _watch_children(module: torch.nn.Module, on: bool) -> None:
    # Taken off every descendant: a child wrapped since (peft's LoRA layer keeps it as
    # ``base_layer``) is a grandchild now.
    for sub in module.modules():
        hooks = sub._forward_pre_hooks
        for hid in [h for h, fn in hooks.items() if fn is _leave_entry]:
            del hooks[hid]
    if on:
        for child in module.children():
            child.register_forward_pre_hook(_leave_entry)


def _put_back(module: torch.nn.Module, name: str, wrapper) -> None:
    """Give ``module.<name>`` back what ``wrapper`` replaced (its ``inner``; None: the class's
    own), where the attribute still is ``wrapper``, or a method bound to it."""
    current = module.__dict__.get(name)
    if current is wrapper or getattr(current, "__func__", None) is wrapper:
        if wrapper.inner is None:
            delattr(module, name)
        else:
            setattr(module, name, wrapper.inner)


def _remove_attention_forward(wrapper: _AttentionForward) -> None:
    wrapper.active = False  # a wrapper added around it later keeps calling it: pass through
    _put_back(wrapper.module, "forward", wrapper)
    _watch_children(wrapper.module, False)


def enable_varlen(
    model: torch.nn.Module,
    backend: str | None = None,
    *,
    strict: bool = False,
    float_mask: str = "bool",
    restore_checkpoint_mask: bool = True,
    in_graph: bool = True,
):
    """Make every masked attention inside ``model`` run packed, with one plan per forward.

    Args:
        model: a diffusers transformer, or any ``nn.Module`` whose attention calls
            ``F.scaled_dot_product_attention`` (directly or through diffusers'
            ``dispatch_attention_fn`` with the native backend).
        backend: a varlen backend name, ``"sdpa"`` or ``"auto"``; None (default) reads
            ``$VARLEN_ATTN_BACKEND`` at every forward, else auto, as the functional entries do.
            Explicit names never fall back silently.
        strict: raise :class:`~varlen_attn.NotPackableError` on masks that cannot be packed
            instead of running masked SDPA for them.
        float_mask: how a float mask whose values are all 0 or 1 (with at least one 1) is read
            when it reaches attention: ``"bool"`` (default) as a keep-mask, with one warning per
            process; ``"bias"`` as SDPA reads it (an additive bias: not packable, masked SDPA
            runs); ``"error"``: raise. Other additive masks keep SDPA's reading under every policy.
        restore_checkpoint_mask: pass the model's ``attention_mask`` to checkpointed blocks that
            diffusers calls without it (Chroma's single blocks).
        in_graph: in submodules compiled on their own with ``fullgraph=True``
            (``block.compile()``, regional compilation), run attention inside the compiled graph
            where the backend's kernel traces (``torch``; ``reference`` on the CPU) or has its own
            entry points (FA4, its kernel in an opaque op): no Python
            of varlen_attn runs then beyond one plan lookup per call. A block whose call that
            route cannot run (a mask that is not one segment per batch element, a fallback to
            masked SDPA) is called again on the general route, varlen_attn's custom op, and
            keeps it from then on (logged at INFO). False: the custom op everywhere, as under a
            whole model compiled and without ``fullgraph``.

    Returns:
        ``model`` itself; :func:`varlen` is the context-manager form.
    """
    if not isinstance(model, torch.nn.Module):
        raise InputTypeError(f"model must be a torch.nn.Module, got {describe(model)}")
    Policy.of(backend, strict, float_mask)  # validate now, not at the first forward
    check_bool("in_graph", in_graph)
    if getattr(model, "_varlen_state", None) is not None:
        disable_varlen(model)
    state = _State(backend, strict, float_mask, restore_checkpoint_mask, in_graph)
    # diffusers routes attention to a non-native backend when one was set per processor; those
    # (e.g. flash_varlen) bypass SDPA and some are wrong for joint sequences. Use native while enabled.
    for module in model.modules():
        proc = getattr(module, "processor", None)
        if proc is None:
            continue
        if getattr(proc, "_attention_backend", None) is not None:
            state.saved_backends.append((proc, proc._attention_backend))
            proc._attention_backend = None
        wrapper = _AttentionForward(module, module.__dict__.get("forward"))
        module.forward = wrapper
        state.attention.append(wrapper)
    state.checkpointed = _checkpointing_modules(model)
    _install_checkpointing(state)
    state.entry = _Forward(model, model.__dict__.get("forward"))
    model.forward = state.entry
    model._varlen_state = state
    return model


def disable_varlen(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`enable_varlen`, removing only what it added: the forward it replaced and the
    attention backends return. When something wrapped the model's forward after enabling
    (accelerate's ``prepare`` or its hooks), that wrapper stays, and the entry it holds passes
    calls straight through from now on."""
    state = getattr(model, "_varlen_state", None)
    if state is None:
        return model
    state.entry.active = False
    _put_back(model, "forward", state.entry)
    for proc, backend in state.saved_backends:
        proc._attention_backend = backend
    _uninstall_checkpointing(state)
    _uninstall_compiled(state)
    for wrapper in state.attention:
        _remove_attention_forward(wrapper)
    del model._varlen_state
    return model


class varlen:  # noqa: N801 - a context manager named like the function it wraps
    """``with varlen_attn.varlen(model, ...):`` enables varlen for the block, then disables it."""

    def __init__(self, model: torch.nn.Module, backend: str | None = None, **kwargs):
        self.model, self.backend, self.kwargs = model, backend, kwargs

    def __enter__(self):
        return enable_varlen(self.model, self.backend, **self.kwargs)

    def __exit__(self, *exc):
        disable_varlen(self.model)
        return False


@functools.lru_cache(maxsize=64)
def _signature(cls) -> inspect.Signature:
    """The class's forward signature without ``self``: mask inputs are found by name."""
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    return inspect.Signature(params)


_PARAM_NAMES: dict[type, tuple[str, ...] | None] = {}


@torch._dynamo.assume_constant_result  # traced: called once while tracing, its result a constant
def _param_names(cls) -> tuple[str, ...] | None:
    """The names of a block class's forward parameters (without ``self``), once per class:
    checkpointed blocks are called twice per step each (forward and recomputation). A plain
    dict, not lru_cache: dynamo inlines lru_cache wrappers and cannot trace inspect there."""
    if cls not in _PARAM_NAMES:
        try:
            _PARAM_NAMES[cls] = tuple(_signature(cls).parameters)
        except (TypeError, ValueError):
            _PARAM_NAMES[cls] = None
    return _PARAM_NAMES[cls]


def _run_forward(model, state: _State, orig_forward, args, kwargs):
    bound = _signature(type(model)).bind_partial(*args, **kwargs)
    roots = _mask_arguments(bound.arguments)
    names = tuple(sub if sub == name else f"{name}.{sub}" for name, sub, _ in roots)
    # How this forward follows its masks: tracked mask tensors (with the mode inside attention
    # modules, for LOCAL) where an earlier forward with the same mask inputs showed that they
    # reach every mask that attention gets; else the mode, which follows every torch function
    # and learns the answer. Compiled submodules follow theirs inside their graphs either way
    # (_Boundary). Results never depend on it.
    _install_compiled(model, state)
    tracking, calls = state.tracking.get(names) or (MODE, 0)
    if not roots and tracking != MODE:
        state.unmasked_forwards += 1
        if state.unmasked_forwards % RECHECK_UNMASKED == 0:
            tracking = MODE  # _learn_without_masks
    with _running_lock:
        state.running += 1
        if state.running == 1:
            # Alone: no other thread is inside the modules whose hooks change. A mode forward
            # watches to learn where each attention module's mask work ends.
            _watch(state, (tracking == MODE and bool(roots)) or any(t == ENTRY for t, _ in state.tracking.values()))
    try:
        out = _run_scoped(model, state, orig_forward, bound, roots, names, tracking, calls)
    finally:
        with _running_lock:
            state.running -= 1
    return out


_running_lock = threading.Lock()


def _run_scoped(model, state: _State, orig_forward, bound, roots, names, tracking: str, calls: int):
    scope = Scope(state.policy(), tracking, watching=state.watching and names not in state.no_entry,
                  enclosing_frame=checkpoint_frame())  # a checkpoint around this forward (hook.adopt_checkpoint)
    for (name, sub, given), root in zip(roots, names):
        t = given
        if tracking != MODE:
            t = tracked(given)
            bound.arguments[name] = t if sub == name else {**bound.arguments[name], sub: t}
        scope.add_root(root, t, given)
    if state.restore_checkpoint_mask:
        scope.checkpoint_mask = scope.roots.get("attention_mask")
    _install_checkpointing(state)
    _stats.record_forward(tracking)
    with active(scope):
        out = orig_forward(*bound.args, **bound.kwargs)
    if not roots:
        _learn_without_masks(state, names, scope)
    elif tracking == MODE:
        learned = scope.learned()
        if learned is not None:
            state.tracking[names] = (learned, scope.masked_calls)
    elif scope.masked_calls < calls and not _may_skip_modules(model):
        # Fewer masked attention calls reached varlen_attn than in the forward this tracking was
        # learned from: some ran stock SDPA unseen (an attention module's forward replaced after
        # enabling, mask code that changed, or under ENTRY a mask made past a module's first
        # submodule call). Say so, and learn again at the next forward (after ENTRY, LOCAL at most).
        # Not where a diffusers hook may skip modules (a cache, layer skipping): fewer calls are
        # what its skips look like, and nothing ran then.
        state.tracking.pop(names, None)
        if tracking == ENTRY:
            state.no_entry.add(names)
        logger.warning(
            "varlen_attn: %d masked attention call(s) reached varlen_attn in this forward, %d in the "
            "forward its mask tracking (%s) was learned from; the others ran stock SDPA. The next "
            "forward follows its masks under the mode again.", scope.masked_calls, calls, tracking)
    return out


def _learn_without_masks(state: _State, names: tuple, scope: Scope) -> None:
    """What a forward with no mask input teaches. Under the mode, where no attention call had a
    mask (a model called without its mask, Flux without one): later such forwards follow
    nothing (:data:`TRACKED` with no roots), no Python on their torch functions. A mask handed
    to an attention module is still seen there; a forward that met a mask, under any tracking,
    sends the next back to the mode, which sees masks made anywhere and keys them by derivation.
    One made inside an attention module from other inputs would run stock SDPA unseen, so every
    :data:`RECHECK_UNMASKED`-th such forward runs under the mode again (:func:`_run_forward`)."""
    if scope.masked_calls:
        state.tracking.pop(names, None)
    elif scope.tracking == MODE:
        state.tracking[names] = (TRACKED, 0)


# A forward with no mask input that follows nothing runs under the mode once in this many (one
# in 16: a sixteenth of the mode's host time, and a mask the model starts making itself is seen
# within 16 forwards).
RECHECK_UNMASKED = 16


def _may_skip_modules(model: torch.nn.Module) -> bool:
    """A diffusers hook in ``model`` may run a module without its forward: one that replaces the
    forward (``ModelHook.new_forward``; diffusers' caches, such as FirstBlockCache and
    PyramidAttentionBroadcast, and its layer skipping return without calling it on a hit).
    Read only after a forward with fewer masked attention calls than expected."""
    for module in model.modules():
        registry = module.__dict__.get("_diffusers_hook")
        hooks = getattr(registry, "hooks", None)
        if isinstance(hooks, dict) and any(_replaces_forward(h) for h in hooks.values()):
            return True
    return False


# diffusers hooks that replace a forward but always call it (dtype casts around it).
_PASS_THROUGH_HOOKS = ("diffusers.hooks.layerwise_casting",)


def _replaces_forward(hook) -> bool:
    for cls in type(hook).__mro__:
        if "new_forward" in cls.__dict__:
            if cls.__module__ in _PASS_THROUGH_HOOKS:
                return False
            return cls.__name__ != "ModelHook" or not cls.__module__.startswith("diffusers.")
    return False


class _Boundary:
    """The call of a compiled submodule while the model is enabled: ``module._compiled_call_impl``
    (``module.compile()``, as diffusers' regional compilation and OneTrainer do) or an
    ``OptimizedModule``'s ``forward`` (``torch.compile(module)``). Around the compiled call it
    takes the forward's hooks off the mode stack and hands tracked masks in as plain tensors
    keyed as they were (:func:`varlen_attn.hook.plain`): the graph routes its own attention
    (:class:`_BlockForward`), so it runs with no Python of ours on its ops and is traced the
    same in every forward (dynamo guards on the mode stack), whichever way the forward tracks."""

    def __init__(self, inner, block: torch.nn.Module):
        self.inner = inner
        self.block = block  # the module whose forward is the _BlockForward

    def __call__(self, *args, **kwargs):
        """The compiled call, attention in the graph where the block's flag says so (dynamo
        guards on ``_BlockForward.in_graph``: one graph per value). The route a forward took is
        kept in its scope, so the checkpoint recomputation takes it again even where another
        forward has turned the flag off since; a call the route declines
        (:class:`~varlen_attn.op.InGraphDeclined`, before the graph saved anything: only
        fullgraph compiles take the route) turns the flag off for good and runs again, from the
        random state the first attempt started with."""
        forward = self.block.__dict__.get("forward")
        if not isinstance(forward, _BlockForward) or torch.compiler.is_compiling():
            return self._call(*args, **kwargs)
        scope = current_scope()
        route = forward.in_graph if scope is None else scope.routes.setdefault(id(self.block), forward.in_graph)
        if route != forward.in_graph:  # a recomputation whose forward ran before the flag went off
            with _route_lock:
                previous, forward.in_graph = forward.in_graph, route
                try:
                    return self._attempt(args, kwargs)
                finally:
                    forward.in_graph = previous
        if not route:
            return self._attempt(args, kwargs)
        rng = _rng_state()
        calls = None if scope is None else scope.masked_calls
        try:
            return self._attempt(args, kwargs)
        except InGraphDeclined as declined:
            with _route_lock:
                for module in self.block.modules():  # nested compiled blocks too
                    inner = module.__dict__.get("forward")
                    if isinstance(inner, _BlockForward):
                        inner.in_graph = False
            if scope is not None:
                scope.routes[id(self.block)] = False
                scope.masked_calls = calls
            logger.info("varlen_attn: %s takes the general compiled route: %s", type(self.block).__name__, declined)
            _set_rng_state(rng)
            return self._attempt(args, kwargs)

    def _attempt(self, args, kwargs):
        _boundary.depth = getattr(_boundary, "depth", 0) + 1
        try:
            return self._call(*args, **kwargs)
        finally:
            _boundary.depth -= 1

    def _call(self, *args, **kwargs):
        scope = None if torch.compiler.is_compiling() else current_scope()
        if scope is None:
            return self.inner(*args, **kwargs)
        adopt_checkpoint(scope)  # a checkpoint the model did not wrap around this block (varlen_attn.hook)
        args = plain(args, scope)
        kwargs = {k: plain(v, scope) for k, v in kwargs.items()}
        with hidden(scope):
            return self.inner(*args, **kwargs)


# Compiled blocks a _Boundary is calling on this thread: dynamo traces a block for the in-graph
# route only inside one (not inlined into a whole model compiled around it).
_boundary = threading.local()
# Held while a block's route flag is changed against the forward's own (rare: a decline, or the
# recomputation of a forward that ran before one).
_route_lock = threading.RLock()


@torch._dynamo.assume_constant_result  # read while tracing; the graph holds the answer
def _traced_for_the_boundary() -> bool:
    """Dynamo is tracing a compiled block that a _Boundary called (not a whole model compiled
    around it), with ``fullgraph=True``: a decline then comes before anything ran."""
    return bool(getattr(_boundary, "depth", 0)) and fullgraph_traced()


def _rng_state():
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


class _BlockForward(_InstanceForward):
    """``forward`` of a compiled submodule while the model is enabled. Traced by dynamo, it
    enters the SDPA hook inside the compiled code (a scope holding the policy only: plans are
    resolved at run time by the custom op, from the running forward's scope), so the graph
    holds the routed attention and no hook is active while it runs. Run eagerly after all
    (dynamo disabled, or ``set_stance("force_eager")``), it re-enters the forward's hook that
    :class:`_Boundary` took off. ``inner``: the instance forward it replaced, or None."""

    in_graph = True  # the default of wrappers pickled before the flag existed

    def __init__(self, module: torch.nn.Module, inner, state: _State):
        super().__init__(module, inner)
        self.state = state
        self.in_graph = state.in_graph  # attention may run in the graph itself (see _Boundary)

    def __call__(self, *args, **kwargs):
        target = self._target()
        if torch.compiler.is_compiling():
            in_graph = self.in_graph and _traced_for_the_boundary()
            with VarlenHook(_traced_scope(self.state, in_graph)):
                return target(*args, **kwargs)
        scope = hidden_scope()
        if scope is None:
            return target(*args, **kwargs)
        with VarlenHook(scope):
            return target(*args, **kwargs)


def _install_compiled(model: torch.nn.Module, state: _State) -> None:
    """Give every compiled submodule its :class:`_Boundary` and :class:`_BlockForward`, once
    (a module compiled since the last forward gets them now)."""
    stack = list(model.__dict__.get("_modules", {}).values())
    pop, extend = stack.pop, stack.extend
    # By hand, not model.modules(): a third of its time (1 ms for 3800 modules). It runs over
    # every module at every forward (7000 in a full-depth Qwen-Image with LoRA): a module that
    # is not compiled costs two reads of its __dict__ and a type check (0.7 ms less there).
    while stack:
        module = pop()
        if module is None:
            continue
        attrs = module.__dict__
        children = attrs.get("_modules")
        if children:
            extend(children.values())
        if isinstance(module, _OptimizedModule):
            call = attrs.get("forward")
            if call is not None and not isinstance(call, _Boundary):
                module.forward = _Boundary(call, module._orig_mod)
                state.compiled.append(module)
            module = module._orig_mod
        else:
            call = attrs.get("_compiled_call_impl")
            if call is None:
                continue
            if not isinstance(call, _Boundary):
                module._compiled_call_impl = _Boundary(call, module)
                state.compiled.append(module)
        if not isinstance(module.__dict__.get("forward"), _BlockForward):
            # Compiled code routes its own attention, and dynamo guards on each instance's
            # forward object: one _AttentionForward per block would recompile every block.
            for sub in module.modules():
                if isinstance(sub.__dict__.get("forward"), _AttentionForward):
                    _remove_attention_forward(sub.__dict__["forward"])
            module.forward = _BlockForward(module, module.__dict__.get("forward"), state)
            state.compiled.append(module)


def _uninstall_compiled(state: _State) -> None:
    for module in state.compiled:
        for name in ("forward", "_compiled_call_impl"):
            wrapper = module.__dict__.get(name)
            if isinstance(wrapper, (_Boundary, _BlockForward)):
                _put_back(module, name, wrapper)
    state.compiled = []


def _traced_forward(model, state: _State, orig_forward, args, kwargs):
    """The forward as dynamo traces it (the whole model compiled): the hook with the policy
    only (plans are resolved at run time inside the custom op), derivation tracking off, and the
    checkpointed blocks given back their mask and the hook (:func:`_traced_checkpoint`). The
    recomputation is part of the compiled graph, so it needs no scope to re-enter. The checkpoint functions are swapped while tracing only:
    the compiled code holds the traced calls, and no module is left changed."""
    arguments = _arguments(type(model), args, kwargs)
    mask = arguments.get("attention_mask") if state.restore_checkpoint_mask else None
    masks = [t for _, _, t in _mask_arguments(arguments)]
    # The run-time scope of this forward (op.forward_op): one plan per mask, one host read.
    for t in masks:
        trace_root(t)
    forward = forward_scope(masks)
    swapped = []
    for module in state.checkpointed:
        func = module.__dict__.get("_gradient_checkpointing_func")
        if func is not None:
            module._gradient_checkpointing_func = functools.partial(_traced_checkpoint, func, mask, state)
            swapped.append((module, func))
    # Every hook entered while this forward is traced takes its handle (_traced_scope): this one,
    # the checkpointed blocks' and that of compiled blocks inlined here (their _BlockForward
    # installed by an eager forward). Set while tracing only, as the checkpoint functions.
    state.traced_forward = forward
    try:
        with VarlenHook(_traced_scope(state)):
            return orig_forward(*args, **kwargs)
    finally:
        state.traced_forward = None
        for module, func in swapped:
            module._gradient_checkpointing_func = func


def _arguments(cls, args, kwargs) -> dict:
    """The arguments of a call of ``cls.forward`` by name, as far as the cached parameter names
    (:func:`_param_names`) name them: dynamo traces this."""
    params = _param_names(cls) or ()
    return {**dict(zip(params, args)), **kwargs}


def _mask_arguments(arguments: dict) -> list[tuple[str, str, torch.Tensor]]:
    """The mask inputs among a forward's ``arguments``: tensors whose argument name contains
    ``mask``, also inside dicts such as Flux's ``joint_attention_kwargs={"attention_mask": m}``,
    as ``(argument name, name in it, tensor)``."""
    return [(name, sub, t) for name, value in arguments.items()
            for sub, t in (value.items() if isinstance(value, dict) else [(name, value)])
            if _names_a_mask(sub) and isinstance(t, torch.Tensor)]


def _names_a_mask(name) -> bool:
    """An argument named like a mask (``attention_mask``, ``encoder_hidden_states_mask``): a mask
    input of a forward (:func:`_mask_arguments`) or of an attention module's call."""
    return "mask" in str(name)


def _traced_scope(state: _State, in_graph: bool = False) -> Scope:
    """The scope of a hook entered inside traced code: the policy only, and the handle of the
    run-time scope of the whole model's forward being traced, if any (``state.traced_forward``)."""
    return Scope(state.policy(in_graph=in_graph), forward=state.traced_forward)


def _traced_checkpoint(func, mask, state: _State, block, *args, **kwargs):
    """A checkpointed block as dynamo traces it: its mask given back. The hook around the traced
    forward routes the attention inside the checkpointed call (``hook.VarlenHook`` takes the
    checkpoint's higher-order op and runs its function under itself)."""
    if isinstance(block, torch.nn.Module) and isinstance(mask, torch.Tensor):
        args = _restore_mask(block, args, kwargs, mask)
    return func(block, *args, **kwargs)


class _Checkpoint:
    """A module's ``_gradient_checkpointing_func`` while the model is enabled, installed once
    and left in place: it holds no per-forward state. At call time it reads the scope of the
    forward running on the calling thread, gives diffusers' checkpointed blocks back their mask
    where diffusers left it out, and makes the recomputation (which runs in backward, possibly
    on another thread) re-enter that scope: same plans, no rebuild, same kernels. One model can
    so run forwards on several threads at once. A plain object: it deep-copies and pickles with
    its module."""

    def __init__(self, func):
        self.func = func

    def __call__(self, block, *args, **kwargs):
        scope = None if torch.compiler.is_compiling() else current_scope()
        if scope is None:  # outside an enabled forward, or traced (see _traced_forward)
            return self.func(block, *args, **kwargs)
        if scope.checkpoint_mask is not None and isinstance(block, torch.nn.Module):
            args = _restore_mask(block, args, kwargs, scope.checkpoint_mask)
        if not _torch_checkpoint(self.func):
            # A function of the caller's own (``enable_gradient_checkpointing(func)``) gets what
            # stock's gets: the block itself and its arguments, to use as it likes (``.to()``,
            # keywords, identity). A torch.utils.checkpoint inside it takes its recomputation back
            # into this scope through its frame (hook.adopt_checkpoint), as for blocks the caller
            # checkpoints.
            return self.func(block, *args, **kwargs)
        # The scope's masks reach the recomputation as they are, not through the checkpoint's saved
        # inputs: saved-tensor hooks that copy what autograd saves (offloading, such as
        # save_on_cpu) would hand it copies, which are neither tracked nor keyed.
        held = {i: a for i, a in enumerate(args) if _scope_mask(scope, a)}
        held_kw = {name: a for name, a in kwargs.items() if _scope_mask(scope, a)}
        args = tuple(None if i in held else a for i, a in enumerate(args))
        kwargs = {name: a for name, a in kwargs.items() if name not in held_kw}

        def run(*a, **kw):  # diffusers' helper calls ``module.__call__``: a function has one
            a = tuple(held.get(i, x) for i, x in enumerate(a))
            with active(scope):
                return block(*a, **kw, **held_kw)

        return self.func(run, *args, **kwargs)


def _torch_checkpoint(func) -> bool:
    """``func`` only hands the block to ``torch.utils.checkpoint.checkpoint``, which calls it and
    nothing else: the one ``enable_gradient_checkpointing()`` sets without a function (diffusers
    0.42.1: a local function around ``checkpoint(module.__call__, *args, use_reentrant=False)``,
    known by its name), or that function with keyword options only (``functools.partial``)."""
    if isinstance(func, functools.partial):
        return func.func is torch.utils.checkpoint.checkpoint and not func.args
    return (getattr(func, "__module__", "") or "").startswith("diffusers.") and getattr(
        func, "__qualname__", "").endswith("enable_gradient_checkpointing.<locals>._gradient_checkpointing_func")


def _scope_mask(scope: Scope, value) -> bool:
    """``value`` is a mask the scope follows (tracked or keyed) that needs no gradient."""
    return (isinstance(value, torch.Tensor) and not value.requires_grad
            and (type(value) is TrackedMask or scope.key_of(value) is not None))


def _checkpointing_modules(model) -> list[torch.nn.Module]:
    """The modules that can hold a ``_gradient_checkpointing_func``: diffusers sets one on every
    module with a ``gradient_checkpointing`` attribute (there from ``__init__``)."""
    return [m for m in model.modules()
            if hasattr(m, "gradient_checkpointing") or "_gradient_checkpointing_func" in m.__dict__]


def _install_checkpointing(state: _State) -> None:
    """Wrap each ``_gradient_checkpointing_func`` in a :class:`_Checkpoint`, once; a function set
    later (``enable_gradient_checkpointing`` after ``enable_varlen``) is wrapped at the next
    forward. Idempotent, so threads racing here install equal wrappers."""
    for module in state.checkpointed:
        func = module.__dict__.get("_gradient_checkpointing_func")
        if func is not None and not isinstance(func, _Checkpoint):
            module._gradient_checkpointing_func = _Checkpoint(func)


def _uninstall_checkpointing(state: _State) -> None:
    for module in state.checkpointed:
        func = module.__dict__.get("_gradient_checkpointing_func")
        if isinstance(func, _Checkpoint):
            module._gradient_checkpointing_func = func.func


def _restore_mask(block, args, kwargs, mask):
    """Append ``mask`` as ``attention_mask`` when ``block`` takes it right after the given
    positional arguments and the caller left it out (diffusers' checkpoint helper passes
    positional arguments only)."""
    params = _param_names(type(block))
    if params is None:
        return args
    if "attention_mask" in kwargs or "attention_mask" not in params:
        return args
    if params.index("attention_mask") == len(args):
        return (*args, mask)
    return args
