"""``enable_varlen(model)``, ``disable_varlen(model)`` and ``varlen(model)``.

``enable_varlen`` adds forward hooks to the model and its attention modules: while one runs on a
thread, that thread's SDPA calls are varlen_attn's, with the model's policy (:mod:`varlen_attn.hook`),
also in the recomputation of checkpointed blocks. ``model.forward`` stays the class's own. With
``restore_checkpoint_mask`` Chroma's checkpointed blocks get the model's mask back
(:class:`_Checkpoint`). docs/design.md has the full story.
"""

from __future__ import annotations

import torch

from . import _stats
from ._errors import InputTypeError, NotPackableError, check_bool, warn_once
from .execution import UNREAD, Deferred, Entry, current, pop_entry_of, push
from .hook import install, installed
from .kernels import requested_backend
from .policy import Policy, float_mask_read_as_bool, mask_info
from .trim import param_names, trim_text

from torch._dynamo.eval_frame import OptimizedModule as _OptimizedModule



class _State:
    """What ``enable_varlen`` keeps on the model (``model._varlen_state``) and on each attention
    module (``_varlen_owner``): plain data, so it deep-copies and pickles with the model."""

    def __init__(self, backend, strict, float_mask, restore_checkpoint_mask, in_graph=True, trim_text=True):
        self.backend = backend
        self.trim_text = trim_text
        self.strict = strict
        self.float_mask = float_mask
        self.restore_checkpoint_mask = restore_checkpoint_mask
        self.in_graph = in_graph
        self.saved_backends: list[tuple[object, object]] = []
        self.attention: list[torch.nn.Module] = []
        self.checkpointed: list[torch.nn.Module] = []
        self.compiled: list[tuple[torch.nn.Module, str]] = []  # (module, attribute) given a _Boundary
        self.defers = None  # the model's mask argument where it is in OUTER_MASKS: checks read once per forward
        self._policy: Policy | None = None

    def policy(self) -> Policy:
        """The policy, one object while the backend it names is the same (``backend=None`` reads
        ``$VARLEN_ATTN_BACKEND`` at every forward): compiled code guards on it."""
        name = requested_backend(self.backend)
        policy = self._policy
        if policy is None or policy.backend != name:
            policy = self._policy = Policy(name, self.strict, self.float_mask, True, self.in_graph)
        return policy


# diffusers classes whose every attention mask with rows is the outer product of the model's mask
# (diffusers 0.42.1, transformer_chroma.py). Its device check is read once when the forward ends,
# not in every call (114 reads a full-depth Chroma step otherwise, ~0.8 ms each: NOTES.md entry 48).
# Others are checked per call (HunyuanVideo's token refiner is no outer product: a deferred
# check would fail and run every forward twice).
OUTER_MASKS = {"ChromaTransformer2DModel": "attention_mask"}  # class name -> its [B, S] mask argument


def _defers(cls: type) -> str | None:
    """The mask argument of ``cls`` in :data:`OUTER_MASKS`, or of the class it inherits its
    ``forward`` from; None where neither is listed."""
    return next((OUTER_MASKS[base.__name__] for base in cls.__mro__
                 if base.__name__ in OUTER_MASKS and cls.forward is base.forward), None)


# -- the hooks: module-level functions, so they deep-copy and pickle with the modules ----------

def _enter_model(model, args, kwargs):
    state = model.__dict__.get("_varlen_state")
    if state is None:
        return None
    compiling = torch.compiler.is_compiling()
    # Traced (the whole model compiled), the kept length would be a host read inside the graph:
    # the columns stay there (results are the same).
    trimmed = trim_text(type(model), args, kwargs) if state.trim_text and not compiling else None
    if trimmed is not None:
        args, kwargs = trimmed
    mask = None
    if state.restore_checkpoint_mask:
        mask = _argument(model, args, kwargs, "attention_mask")
        _install_checkpointing(state)  # a function set after enabling is wrapped here (also traced)
    if not compiling:
        _install_compiled(model, state)  # modules compiled since the last forward get theirs now
        if not installed():
            _warn_replaced()
    checks = None
    if state.defers is not None and not compiling:
        keep = _argument(model, args, kwargs, state.defers)
        float01 = state.float_mask == "bool"
        checks = Deferred(keep, [], float01)
        if checks.float01:
            float_mask_read_as_bool(state.float_mask, mask_info(keep.dtype, keep.shape))
    push(Entry(state.policy(), mask if isinstance(mask, torch.Tensor) else None, model, checks))
    return trimmed


def _argument(model, args, kwargs, name: str):
    """The argument ``name`` of a call of ``model``'s forward, or None."""
    found = kwargs.get(name)
    if found is None and args:
        params = param_names(type(model)) or ()
        if name in params[:len(args)]:
            found = args[params.index(name)]
    return found


def _leave_model(model, args, kwargs, output):
    """Take the model's entry off, then read its forward's device checks (one host read): where
    one failed (a mask read as an outer product that is not one), the forward is run again with
    each call checked as it comes (exact), or raises under ``strict``."""
    entry = current()
    pop_entry_of(model)
    if (entry is None or entry.owner is not model or entry.checks is None or not entry.checks.flags
            or output is None or torch.compiler.is_compiling()):
        return None
    flags = entry.checks.flags
    _stats.record_host_sync()
    device = flags[0].device  # a model split across devices checks on each: gathered for the read
    if not torch.stack([f if f.device == device else f.to(device) for f in flags]).any().item():
        return None
    reason = ("an attention mask with rows is not the outer product of the model's mask, or the model's "
              "float mask is not 0/1: the forward ran again, each such call checked as it came")
    if entry.policy.strict:
        raise NotPackableError(reason.split(":")[0] + " (strict=True: the forward is not run again)")
    _stats.record_fallback(reason)
    push(Entry(entry.policy, entry.checkpoint_mask, model))
    try:
        return model.forward(*args, **kwargs)
    finally:
        pop_entry_of(model)


def _enter_attention(module, args):
    # Traced, the model's own entry (pushed by its hook, eagerly or in the same trace) is what the
    # graph reads; a push here could sit inside a checkpoint's traced body, which takes none.
    state = module.__dict__.get("_varlen_owner")
    if state is None or torch.compiler.is_compiling():
        return
    top = current()
    if top is not None and top.policy is state._policy:
        return  # inside its model's forward: that entry routes the module (its leave pops only its own)
    push(Entry(state.policy(), owner=module, checks=_checks_outside_forward(state)))


def _checks_outside_forward(state: _State):
    """The checks of calls made outside the model's forward: in backward (a checkpoint's
    recomputation) of a model in ``OUTER_MASKS``, each call's own factors, unread (:data:`UNREAD`:
    a forward run again after a failed check fails loudly there, NaN or CheckpointError); else
    None, read in the call."""
    return UNREAD if state.defers is not None and torch._C._current_autograd_node() is not None else None


def _leave_attention(module, args, output):
    if not torch.compiler.is_compiling():
        pop_entry_of(module)


def _warn_replaced() -> None:
    warn_once("sdpa_replaced",
              "varlen_attn: torch.nn.functional.scaled_dot_product_attention was replaced after "
              "varlen_attn was enabled, by a function that does not pass calls on to it: enabled "
              "models run that function's attention, not varlen_attn's. Enable varlen_attn after "
              "the other library patches SDPA.")


def _add_hooks(module, pre, post, with_kwargs=False, post_kwargs=False) -> None:
    module.register_forward_pre_hook(pre, with_kwargs=with_kwargs)
    # First among the forward hooks: the user's see the output of a forward run again.
    module.register_forward_hook(post, with_kwargs=post_kwargs, always_call=True, prepend=post_kwargs)


def _remove_hooks(module, *fns) -> None:
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for hid in [h for h, fn in hooks.items() if fn in fns]:
            del hooks[hid]
            module._forward_hooks_always_called.pop(hid, None)
            module._forward_pre_hooks_with_kwargs.pop(hid, None)
            module._forward_hooks_with_kwargs.pop(hid, None)


def enable_varlen(
    model: torch.nn.Module,
    backend: str | None = None,
    *,
    strict: bool = False,
    float_mask: str = "bool",
    restore_checkpoint_mask: bool = True,
    in_graph: bool = True,
    trim_text: bool = True,
):
    """Make every masked attention inside ``model`` run packed.

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
        in_graph: under ``torch.compile``, attention with a boolean key-padding mask runs inside
            the compiled graph, its plan traced into it (no host read), where the backend's kernel
            traces (``torch``; ``reference`` on the CPU) or has its own entry points (FA4).
            False: varlen_attn's custom op everywhere (one host read per call where a plan needs one).
        trim_text: before each forward of a model listed in :data:`varlen_attn.trim.TEXT_INPUTS`
            (Chroma, Qwen-Image, HunyuanVideo, Sana, PixArt, LTX-Video), cut the trailing text columns that
            every sample masks, the kept length rounded up to a multiple of 16 (one host read per
            forward). Kept tokens' results are unchanged; False keeps the inputs' shapes (CUDA
            graphs captured at one length).

    Returns:
        ``model`` itself; :func:`varlen` is the context-manager form.
    """
    if not isinstance(model, torch.nn.Module):
        # A diffusers pipeline (by class name: diffusers is not imported here): name the part to pass.
        if (any(c.__name__ == "DiffusionPipeline" for c in type(model).__mro__)
                or isinstance(getattr(model, "transformer", None), torch.nn.Module)):
            part = ("unet" if getattr(model, "transformer", None) is None
                    and isinstance(getattr(model, "unet", None), torch.nn.Module) else "transformer")
            raise InputTypeError(f"model must be the {part} (a torch.nn.Module), not a pipeline: "
                                 f"pass pipe.{part}; got {type(model).__name__}")
        raise InputTypeError(f"model must be a torch.nn.Module (of a pipeline: pass pipe.transformer), "
                             f"got {type(model).__name__}")
    Policy.of(backend, strict, float_mask)  # validate now, not at the first forward
    check_bool("in_graph", in_graph)
    check_bool("restore_checkpoint_mask", restore_checkpoint_mask)
    check_bool("trim_text", trim_text)
    if getattr(model, "_varlen_state", None) is not None:
        disable_varlen(model)
    install()
    state = _State(backend, strict, float_mask, restore_checkpoint_mask, in_graph, trim_text)
    state.defers = _defers(type(model))
    state.policy()  # made now: a whole model compiled would otherwise guard on its absence, and recompile
    for module in model.modules():
        proc = getattr(module, "processor", None)
        if proc is None or module is model:
            continue
        # diffusers routes attention to another backend where one was set per processor; those
        # (e.g. flash_varlen) bypass SDPA, and some are wrong for joint sequences: native while enabled.
        if getattr(proc, "_attention_backend", None) is not None:
            state.saved_backends.append((proc, proc._attention_backend))
            proc._attention_backend = None
        state.attention.append(module)
    # No diffusers attention module: every submodule pushes the policy, so a checkpoint's
    # recomputation around any of them is routed as its forward was.
    hooked = state.attention or [m for m in model.modules() if m is not model]
    for module in hooked:
        module._varlen_owner = state
        _add_hooks(module, _enter_attention, _leave_attention)
    state.attention = hooked
    if restore_checkpoint_mask:
        state.checkpointed = _checkpointing_modules(model)
        _install_checkpointing(state)
    model._varlen_state = state
    _add_hooks(model, _enter_model, _leave_model, with_kwargs=True, post_kwargs=True)
    return model


def disable_varlen(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`enable_varlen`: its hooks, checkpoint wrappers and attention backends go."""
    state = model.__dict__.get("_varlen_state")
    if state is None:
        return model
    _remove_hooks(model, _enter_model, _leave_model)
    for module in state.attention:
        _remove_hooks(module, _enter_attention, _leave_attention)
        module.__dict__.pop("_varlen_owner", None)
    for proc, backend in state.saved_backends:
        proc._attention_backend = backend
    for module, name in state.compiled:
        wrapper = module.__dict__.get(name)
        if isinstance(wrapper, _Boundary):
            module.__dict__[name] = wrapper.inner
    for module in state.checkpointed:
        func = module.__dict__.get("_gradient_checkpointing_func")
        if isinstance(func, _Checkpoint):
            module._gradient_checkpointing_func = func.func
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


# -- compiled submodules ---------------------------------------------------------------------

class _Boundary:
    """The compiled call of a submodule while the model is enabled (``module._compiled_call_impl``
    or an ``OptimizedModule``'s ``forward``): runs it with the model's policy on this thread's
    stack, also in a checkpoint's recomputation, where traced hooks push nothing (compiled code
    guards on that stack)."""

    def __init__(self, inner, state: _State):
        self.inner = inner
        self.state = state

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # inlined into a graph traced inside the forward: its entry is there
            return self.inner(*args, **kwargs)
        # The checks of the forward (or recomputation) it runs in, else those of calls outside one.
        top = current()
        push(Entry(self.state.policy(), owner=self,
                   checks=top.checks if top is not None else _checks_outside_forward(self.state)))
        try:
            return self.inner(*args, **kwargs)
        finally:
            pop_entry_of(self)


def _install_compiled(model: torch.nn.Module, state: _State) -> None:
    """Give every compiled submodule of ``model`` its :class:`_Boundary`, once; not below a
    diffusers attention module, whose processor calls SDPA itself: a module compiled in there
    (a projection, a norm) holds no SDPA call and no hook of ours, so it needs none."""
    stack = list(model.__dict__.get("_modules", {}).values())
    pop, extend = stack.pop, stack.extend
    # By hand, not model.modules(): it runs at every forward. Full-depth Qwen-Image with LoRA r=16
    # has 7,097 modules, most of them peft's below the attention modules: walking them all took
    # 4.6 of the 6.2 ms its 60-layer forward spent over stock's on the CPU; without them, 1.1 of
    # 3.0 (benchmarks/forward_host_time.py, NOTES.md entry 64).
    while stack:
        module = pop()
        if module is None:
            continue
        attrs = module.__dict__
        children = attrs.get("_modules")
        if children and not ("_varlen_owner" in attrs and attrs.get("processor") is not None):
            extend(children.values())
        if isinstance(module, _OptimizedModule):
            name = "forward"
        elif attrs.get("_compiled_call_impl") is not None:
            name = "_compiled_call_impl"
        else:
            continue
        call = attrs.get(name)
        if call is not None and not isinstance(call, _Boundary):
            attrs[name] = _Boundary(call, state)
            state.compiled.append((module, name))
            # Inside, the boundary puts the policy on the stack; the attention modules' hooks would
            # only cost guards (dynamo guards on each module's hook ids: a recompile per block).
            for sub in module.modules():
                _remove_hooks(sub, _enter_attention, _leave_attention)


# -- Chroma's checkpointed blocks -------------------------------------------------------------

class _Checkpoint:
    """A module's ``_gradient_checkpointing_func`` while the model is enabled: gives diffusers'
    checkpointed blocks back the forward's mask where diffusers left it out (saved with the
    block's inputs, so the recomputation gets it too)."""

    def __init__(self, func):
        self.func = func

    def __call__(self, block, *args, **kwargs):
        entry = current()
        if entry is not None and entry.checkpoint_mask is not None and isinstance(block, torch.nn.Module):
            restored = _restore_mask(block, args, kwargs, entry.checkpoint_mask)
            if len(restored) > len(args) and not torch.compiler.is_compiling():
                warn_once("checkpoint_mask",
                          "varlen_attn: %s is checkpointed and called without attention_mask, so stock "
                          "attends to the padding there; varlen_attn passes the model's mask back in (results "
                          "differ from stock's on purpose). enable_varlen(..., restore_checkpoint_mask=False) "
                          "keeps stock's behaviour.", type(block).__name__)
            args = restored
        state = getattr(entry.owner, "_varlen_state", None) if entry is not None else None
        if state is not None and state.defers is not None and not torch.compiler.is_compiling():
            # Its recomputation with this forward's checks: not read, the factors reused; or, in a
            # forward run again after a failed check (no checks), read in each call.
            block = _Recomputed(block, entry.policy, None if entry.checks is None else entry.checks.unread())
        return self.func(block, *args, **kwargs)


class _Recomputed:
    """A checkpointed block of a model in ``OUTER_MASKS``: recomputed in backward, it runs with
    its forward's checks (:class:`varlen_attn.execution.Deferred`, not read), or with none
    (``checks`` None: each call reads its own); the forward's own call passes through."""

    def __init__(self, block, policy, checks):
        self.block, self.policy, self.checks = block, policy, checks

    def __call__(self, *args, **kwargs):
        if torch._C._current_autograd_node() is None:
            return self.block(*args, **kwargs)
        push(Entry(self.policy, owner=self, checks=self.checks))
        try:
            return self.block(*args, **kwargs)
        finally:
            pop_entry_of(self)


def _checkpointing_modules(model) -> list[torch.nn.Module]:
    """The modules that can hold a ``_gradient_checkpointing_func``: diffusers sets one on every
    module with a ``gradient_checkpointing`` attribute (there from ``__init__``)."""
    return [m for m in model.modules()
            if hasattr(m, "gradient_checkpointing") or "_gradient_checkpointing_func" in m.__dict__]


def _install_checkpointing(state: _State) -> None:
    """Wrap each ``_gradient_checkpointing_func`` in a :class:`_Checkpoint`, once."""
    for module in state.checkpointed:
        func = module.__dict__.get("_gradient_checkpointing_func")
        if func is not None and not isinstance(func, _Checkpoint):
            module._gradient_checkpointing_func = _Checkpoint(func)


def _restore_mask(block, args, kwargs, mask):
    """Append ``mask`` as ``attention_mask`` when ``block`` takes it right after the given
    positional arguments and the caller left it out (diffusers' checkpoint helper passes
    positional arguments only)."""
    params = param_names(type(block))
    if params is None or "attention_mask" in kwargs or "attention_mask" not in params:
        return args
    if params.index("attention_mask") == len(args):
        return (*args, mask)
    return args
