"""Which plan a mask gets: the caller's policy, the per-forward scope, and :func:`resolve_plan`.

Every path that needs a plan asks :func:`resolve_plan`: the functional entries, the SDPA hook
of ``enable_varlen`` (through them) and the custom op that runs under ``torch.compile``. So a
policy (``backend``, ``strict``, ``float_mask``) means the same thing eager, with every block
compiled and with the whole model compiled.

A :class:`Scope` lives for one forward of an enabled model. It keys the mask tensors that the
model derives from its mask inputs by *how* they were derived (the op and the keys of its
inputs): Chroma's ``m[:, None, None, :] * m[:, None, :, None]`` in every block, Qwen-Image's
``cat([text_mask, ones])``, Sana's ``(1 - m) * -10000``. Two masks with equal keys hold equal
values, so every layer whose mask has the same key shares one plan: one build, one host sync
per forward, though each block makes a new mask tensor. A mask whose derivation is unknown still
works: it is keyed by its object for the rest of the forward (:meth:`Scope.key_object`), and
its first use asks :func:`varlen_attn.build_plan`, whose cache checks values (one host read).
Within one forward a mask is trusted not to change behind the hook's back; results never
depend on the keys, only the number of plan builds does.

The scope of the running forward is thread-local (:func:`current_scope`), so two models in two
threads never meet.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from dataclasses import dataclass

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ._errors import InputTypeError, InputValueError, check_bool
from .kernels import SDPA, requested_backend
from .plan import VarlenPlan, build_plan, full_plan

logger = logging.getLogger("varlen_attn")

FLOAT_POLICIES = ("bool", "bias", "error")

# How a scope follows its masks (:mod:`varlen_attn.hook`): the mode over the whole forward (every
# torch function); tracked mask tensors (only the functions that take one); or tracked mask
# tensors and the mode inside attention modules only, where a mask may join a factory's output
# (Qwen-Image's per-layer ``torch.ones``); or, narrower, the mode from an attention module's entry
# to its first submodule call, where every such factory and write comes before it (Qwen-Image).
MODE, TRACKED, LOCAL, ENTRY = "mode", "tracked", "local", "entry"


class AttentionCall:
    """An attention module's forward in progress (``model._AttentionForward``). ``entered``: a
    submodule of it was called since (its first, in a forward under :data:`ENTRY`, took the hook
    ``mode`` off). ``plain``: tensors the hook keyed there that stay plain tensors, not tracked
    masks; their keys are dropped with the hook, which alone would have seen them written."""

    __slots__ = ("module", "entered", "mode", "plain")

    def __init__(self, module):
        self.module = module
        self.entered = False
        self.mode = None
        self.plain: list = []


@dataclass(frozen=True)
class Policy:
    """What the caller asked for; see :func:`varlen_attn.enable_varlen` for the meanings.

    ``backend`` is already resolved (the argument, else ``$VARLEN_ATTN_BACKEND``, else
    ``"auto"``): ``"auto"``, ``"sdpa"`` or a varlen backend name. ``model`` is True for the
    policy of an enabled model or processor, whose ``backend`` and ``strict`` are about its
    masked attention: there a call without a mask always runs stock SDPA.
    """

    backend: str = "auto"
    strict: bool = False
    float_mask: str = "bias"
    model: bool = False
    # Compiled blocks of an enabled model: attention may run in the graph itself (varlen_attn.op,
    # "In the graph"); the block's boundary turns it off where a mask needs the general route.
    in_graph: bool = False

    @classmethod
    def of(cls, backend: str | None = None, strict: bool = False, float_mask: str = "bias",
           model: bool = False, in_graph: bool = False) -> "Policy":
        """Validate the arguments and resolve the backend name."""
        if float_mask not in FLOAT_POLICIES:
            raise InputValueError(f"float_mask must be one of {FLOAT_POLICIES}, got {float_mask!r}")
        check_bool("strict", strict)
        return cls(requested_backend(backend), strict, float_mask, model, in_graph)

    @property
    def unmasked_is_sdpa(self) -> bool:
        """A call without a mask runs plain SDPA (already the fastest kernel) instead of a
        varlen backend over one all-valid plan: always inside a model, and for the functional
        entries unless a varlen backend or ``strict`` was asked for."""
        return self.model or (self.backend in ("auto", SDPA) and not self.strict)


# -- the scope of one forward ----------------------------------------------------------------

# ``Tensor.new_zeros`` and kin read only their tensor's dtype and device (Lumina2 makes its joint
# mask with ``hidden_states.new_zeros(..., dtype=torch.bool)``, then writes each row's length).
_LIKE = frozenset({torch.ones_like, torch.zeros_like, torch.full_like,
                   torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_full})
_FACTORIES = frozenset({torch.ones, torch.zeros, torch.full, torch.arange, torch.eye, torch.tensor}) | _LIKE
# Functions whose output is not determined by their inputs: never keyed.
_NONDETERMINISTIC = ("rand", "dropout", "bernoulli", "multinomial", "normal", "uniform", "exponential",
                     "empty", "cauchy", "geometric", "log_normal", "random", "poisson", "binomial", "gamma",
                     "dirichlet", "rrelu", "gumbel")


class _Unkeyable(Exception):
    pass


def is_factory(func) -> bool:
    """``func`` makes a tensor from constants and shapes alone (``torch.ones``, ``*_like``, ...)."""
    try:
        return func in _FACTORIES
    except TypeError:  # an unhashable callable
        return False


def _random(name: str) -> bool:
    """A function of this name makes an output its inputs do not determine: never keyed."""
    return any(word in name for word in _NONDETERMINISTIC)


# What hands a tensor's memory out past PyTorch's version counter: ``.data`` (read or set), its
# storage, NumPy and DLPack views. A write through what they return bumps no version, so no key
# can trust the tensor's content after one of them (Scope.escape).
_DATA = torch._C.TensorBase.__dict__["data"]
_CUDA_ARRAY = torch.Tensor.__dict__.get("__cuda_array_interface__")
# ``.data =`` and ``set_`` put the tensor on another one's storage, whose writes bump the other's
# version, not this one's. ``Tensor.set_`` itself and ``torch.utils.dlpack.to_dlpack`` do not go
# through ``__torch_function__`` (only the op overload ``torch.ops.aten.set_`` does): not seen.
_ESCAPING = frozenset({"numpy", "untyped_storage", "storage", "_typed_storage", "__dlpack__", "__array__", "set_",
                       "data_ptr"})  # a raw pointer: a custom kernel or ctypes may write through it


def escapes(func) -> bool:
    """``func`` hands out its tensor's memory, or takes another's, where writes bump no version
    counter of the tensor."""
    owner = getattr(func, "__self__", None)  # a descriptor's __get__ / __set__: .data, __cuda_array_interface__
    if owner is not None and (owner is _DATA or owner is _CUDA_ARRAY):
        return True
    return getattr(func, "__name__", "").partition(".")[0] in _ESCAPING  # op overloads: set_.source_Tensor


def storage_ptr(t: torch.Tensor) -> int | None:
    with torch._C.DisableTorchFunction():  # no hook or tracked mask sees this read
        try:
            return t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # a tensor without storage
            return None


def keyable_output(out) -> bool:
    """The outputs a derivation is recorded for, eager and traced: masks are bool or carry no
    gradient (activations of a trained model do)."""
    return isinstance(out, torch.Tensor) and (out.dtype == torch.bool or not out.requires_grad)


class Scope:
    """Per-forward state: the policy, derivation keys of mask tensors, the plans built from
    them, and the model's mask inputs (``roots``, by argument name)."""

    def __init__(self, policy: Policy, tracking: str = MODE, watching: bool = False, adopts: bool = True,
                 enclosing_frame=None, forward: torch.Tensor | None = None):
        self.policy = policy
        # A whole model compiled: this scope is traced, and ``forward`` is the handle of the scope
        # that holds the plans at run time (varlen_attn.op.forward_op), handed to attention.
        self.forward = forward
        self.tracking = tracking
        # Checkpoints the model does not wrap (varlen_attn.hook.adopt_checkpoint): ``adopts`` says
        # whether this scope makes their recomputations re-enter it (not a processor's one-call
        # scope: a recomputation calls that processor again); ``enclosing_frame`` is the frame of
        # a checkpoint around this whole forward, which is never adopted: its recomputation runs
        # the forward again, in a scope of its own, and holds more than this scope's attention.
        self.adopts = adopts
        self.enclosing_frame = enclosing_frame
        # Attention modules entered and not left (model._AttentionForward), and the keys of the
        # factory outputs made inside one / outside every one: what :meth:`learned` reads.
        self.attention: list[AttentionCall] = []
        self.factories_inside: set = set()
        self.factories_outside: set = set()
        # ``watching``: the attention modules' submodule calls are seen (model._leave_entry), so
        # this forward can learn :data:`ENTRY`; ``late``: something only the mode follows came
        # after an attention module's first submodule call (a factory, an in-place write to a
        # keyed tensor, an attention mask that would not be a tracked mask).
        self.watching = watching
        self.late = False
        # Masked attention calls that resolved a plan in this scope (model._run_forward compares
        # a tracked forward's count with the mode forward's it learned from).
        self.masked_calls = 0
        self.derived: dict[int, tuple] = {}
        self.plans: dict[tuple, VarlenPlan] = {}
        self.roots: dict[str, torch.Tensor] = {}
        self.given: dict[str, torch.Tensor] = {}
        # The mask handed back to checkpointed blocks that diffusers calls without it.
        self.checkpoint_mask: torch.Tensor | None = None
        # id(compiled block) -> whether its attention ran in the graph in this forward
        # (model._Boundary): its checkpoint recomputation takes the same route.
        self.routes: dict[int, bool] = {}
        # Storages whose memory was handed out past the version counter in this forward (escape).
        self.escaped: set[int] = set()

    def add_root(self, name: str, t: torch.Tensor, given: torch.Tensor | None = None) -> None:
        """A mask input of the model: the start of every derivation. ``t`` is what the forward
        sees, ``given`` the caller's tensor when ``t`` is an alias of it (a tracked mask): plans
        are cached by the caller's tensor, which lives across forwards."""
        self.roots[name] = t
        self.given[name] = t if given is None else given
        self.mark(t, ("root", name))

    def key_of(self, t: torch.Tensor):
        entry = self.derived.get(id(t))
        if entry is None or entry[0]() is not t or entry[2] != version(t):
            return None
        if self.on_escaped(t):
            return None
        return entry[1]

    def escape(self, t: torch.Tensor) -> None:
        """``t``'s memory was handed out where writes bump no version counter (:func:`escapes`):
        ``t`` and every tensor on its storage go unkeyed for the rest of this forward
        (:meth:`key_of` reads :meth:`on_escaped`), so an attention call with such a mask gets no
        plan by key: :func:`resolve_plan` takes the plan cache, which compares the mask with the
        values its plan was built from."""
        ptr = storage_ptr(t)
        if ptr is None:  # no storage to remember (sparse, nested): its own key goes
            self.forget(t)
        else:
            self.escaped.add(ptr)

    def on_escaped(self, t: torch.Tensor) -> bool:
        """``t`` is on a storage whose memory was handed out in this forward (:meth:`escape`)."""
        return bool(self.escaped) and storage_ptr(t) in self.escaped

    def mark(self, t: torch.Tensor, key) -> None:
        self.derived[id(t)] = (weakref.ref(t), key, version(t))
        # Seen by dynamo when a compiled block takes this tensor: a derivation may start here.
        setattr(t, KEYED, True)

    def key_object(self, t: torch.Tensor) -> tuple:
        """Key a mask of unknown derivation by its identity for the rest of this forward: the
        layers handed this same tensor share one plan (its values are trusted for one forward,
        as derivation keys are; across forwards the plan cache checks them)."""
        key = ("object", next(_object_keys))
        self.mark(t, key)
        return key

    def forget(self, t: torch.Tensor) -> None:
        self.derived.pop(id(t), None)

    def forget_aliases(self, t: torch.Tensor) -> None:
        """Drop the keys of every other keyed tensor on ``t``'s storage (its views and bases):
        ``t`` was written in place where no version counter tells them (an inference tensor)."""
        ptr = storage_ptr(t)
        if ptr is None:  # no storage (sparse, nested): no alias to find
            return
        for i, (ref, _, _) in list(self.derived.items()):
            other = ref()
            if other is not None and other is not t and storage_ptr(other) == ptr:
                del self.derived[i]

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
        if isinstance(a, (bool, int, float)):
            # Typed: True == 1 == 1.0 as Python values, but not as arguments (a bool index selects,
            # an int one gathers; a fill value sets the dtype).
            return (type(a).__name__, a)
        if a is None or a is Ellipsis or isinstance(a, (str, torch.dtype, torch.device, torch.Size)):
            return a
        raise _Unkeyable

    def learned(self) -> str | None:
        """How later forwards with the same mask inputs may follow their masks, from the plans
        this forward built: :data:`TRACKED` where every mask was made from the roots alone
        (:func:`root_derived`), :data:`LOCAL` where factory outputs joined them only inside
        attention modules (the mode runs there), :data:`ENTRY` where moreover all that came
        before each module's first submodule call (seen only when ``watching``), else
        :data:`MODE`; None where no masked attention ran (nothing learned)."""
        keys = [pkey[0] for pkey in self.plans]
        if not keys:
            return None
        if all(root_derived(k) for k in keys):
            return TRACKED
        inside = self.factories_inside - self.factories_outside
        if not all(root_derived(k, inside) for k in keys):
            return MODE
        return ENTRY if self.watching and not self.late else LOCAL

    @property
    def attention_depth(self) -> int:
        return len(self.attention)

    def entered_late(self) -> bool:
        """Inside an attention module whose first submodule was already called."""
        return bool(self.attention) and self.attention[-1].entered

    def derive(self, func, args, kwargs):
        """Key of ``func(*args, **kwargs)`` if every tensor input is keyed, else None."""
        factory = is_factory(func)
        like = factory and func in _LIKE
        # The common case, an activation among the inputs, ends here: no exception, no walk. A
        # ``*_like`` factory reads only its first argument's shape, dtype and device.
        derived = self.derived
        for a in (args[1:] if like else args):
            if isinstance(a, torch.Tensor) and id(a) not in derived:
                return None
        has_tensor = any(isinstance(a, torch.Tensor) for a in flat(args, kwargs))
        if not has_tensor and not factory:
            return None
        if _random(getattr(func, "__name__", "")):
            return None
        try:
            # Only a like factory's template is keyed by its metadata; every other tensor argument
            # (a fill value, a size) by its key: its values make the output.
            head = (self._arg_key(args[0], True),) if like and args else ()
            key = (func, head + self._arg_key(tuple(args[len(head):]), False),
                   tuple(sorted((k, self._arg_key(v, False)) for k, v in kwargs.items())))
        except _Unkeyable:
            return None
        if factory:
            (self.factories_inside if self.attention else self.factories_outside).add(key)
            if self.entered_late():
                self.late = True
        return key


# -- derivations traced inside compiled code ---------------------------------------------------
#
# Under torch.compile the hook is traced by dynamo and cannot key tensors by their run-time
# objects. It records instead, on each traced tensor, how it was made from tensors that an eager
# scope keyed (marked KEYED when a compiled block receives them) and from constants. At the
# attention call that record becomes the custom op's ``derivation`` (a string, constant in the
# graph) and ``roots`` (the keyed tensors, graph inputs); at run time the scope keys the mask by
# the roots' keys and the derivation, so every compiled layer that derives the same mask from
# the same inputs shares one plan per forward. Dynamo reads the attributes while tracing only:
# nothing here runs when the graph runs.

KEYED = "_varlen_keyed"
TRACED = "_varlen_traced"


@torch.compiler.assume_constant_result
def derivable_name(func) -> str:
    """The name a derivation records for ``func``; "" for a function whose output its inputs do
    not determine. Evaluated once per function while tracing (a constant to dynamo)."""
    name = getattr(func, "__name__", "")
    if not name or _random(name):
        return ""
    # Qualified, so that a function and a method of one name (torch.where(c, x, y) and
    # x.where(c, y), whose arguments mean different things) never share a derivation.
    return f"{getattr(func, '__module__', None) or ''}.{getattr(func, '__qualname__', None) or name}"


def trace_derive(func, args, kwargs, out) -> None:
    """While tracing: record on ``out`` how ``func`` made it, when every tensor input is keyed or
    traced and ``func`` is deterministic (the eager rule of :meth:`Scope.derive`)."""
    if not keyable_output(out):
        return
    name = derivable_name(func)
    if not name:
        return
    has_tensor = False
    for a in flat(args, kwargs):
        if isinstance(a, torch.Tensor):
            has_tensor = True
            if not (hasattr(a, TRACED) or getattr(a, KEYED, False)):
                return
    if has_tensor or is_factory(func):
        setattr(out, TRACED, (name, func in _LIKE, tuple(args), tuple(sorted(kwargs.items()))))


def trace_root(t: torch.Tensor) -> None:
    """While tracing a whole model compiled: ``t`` is a mask input, where derivations start (at
    run time the forward's scope keys it, varlen_attn.op.forward_op). As an eager scope marks
    its roots, the caller's tensor keeps the mark."""
    setattr(t, KEYED, True)


def trace_forget(t) -> None:
    """While tracing: ``t`` was written in place; derive nothing from it any more, nor from any
    tensor it was made from: it may be a view of them (a write through ``mask[:, 1:3]`` writes
    ``mask``), and in the compiled graph the root's buffer is written in place with no version
    bump that a key would see (inductor), so a later layer's same derivation of the root must not
    share the earlier plan. Forgetting a tensor that was not a view costs a plan by value only."""
    stack = [t]
    while stack:
        x = stack.pop()
        if not isinstance(x, torch.Tensor):
            continue
        rec = getattr(x, TRACED, None)
        setattr(x, TRACED, None)
        if rec is not None:
            _, _, args, kwargs = rec
            stack.extend(flat(args, kwargs or {}))


def traced_signature(mask) -> tuple[list, str]:
    """While tracing: ``(roots, derivation)`` of ``mask``, or ``([], "")`` when unknown."""
    roots: list = []
    text = _trace_text(mask, roots) if isinstance(mask, torch.Tensor) else None
    return (roots, text) if text else ([], "")


class _Text:
    """A piece of a derivation's text given as it is (a like factory's template)."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text


def _trace_text(a, roots: list):
    if isinstance(a, torch.Tensor):
        if hasattr(a, TRACED):
            rec = getattr(a, TRACED)
            if rec is None:
                return None
            name, is_like, args, kwargs = rec
            if is_like and args and isinstance(args[0], torch.Tensor):
                # As Scope.derive: only a like factory's template (its first argument) by metadata.
                args = (_Text("meta" + str(tuple(args[0].shape)) + str(args[0].dtype)), *args[1:])
            inner = _trace_text(args, roots)
            kw = _trace_text(kwargs, roots)
            return None if inner is None or kw is None else name + inner + kw
        if getattr(a, KEYED, False):
            roots.append(a)
            return "r" + str(len(roots) - 1)
        return None
    if isinstance(a, (tuple, list)):
        parts = []
        for x in a:
            s = _trace_text(x, roots)
            if s is None:
                return None
            parts.append(s)
        return "(" + ",".join(parts) + ")"
    if isinstance(a, _Text):
        return a.text
    if isinstance(a, slice):
        parts = [_trace_text(x, roots) for x in (a.start, a.stop, a.step)]
        return None if None in parts else "slice(" + ",".join(parts) + ")"
    if isinstance(a, (int, float)) and not isinstance(a, bool) and not _constant(a):
        # A size dynamo traces as a symbol (dynamic shapes: ``mask.view(b, 1, 1, s)``; dynamo
        # shows it as an int): its value changes between calls of the same graph, so no text
        # baked at trace time stands for it. The derivation is unknown; the plan is then found by
        # the mask's values.
        return None
    if a is None or a is Ellipsis or isinstance(a, (bool, int, float, str)):
        return repr(a)
    if isinstance(a, (torch.dtype, torch.device)):
        return str(a)
    return None


def _constant(a) -> bool:
    """``a`` is a number known while tracing, not a symbol of dynamic shapes. Dynamo presents a
    symbolic size as an int (``isinstance``, ``type``) and cannot format it, but can decide a
    comparison without a guard. A constant has every bit known statically; a symbol (or an
    expression in one, ``s + 8``, ``2 * s``) has some low bit that might be 0 or 1, whatever
    range its guards left it (an interval of two values or more holds both parities). An equality
    probe was not enough: a symbol whose guards bound it (``s <= 4``, from slicing a mask of 12
    with ``mask[:, s:s + 8]``) is statically unequal to any large probe, so it passed for a
    constant and formatting it stopped dynamo ("repr_impl not implemented"). Floats count as
    constants (dynamo specializes them by default; ``-inf`` has no bits to probe)."""
    if isinstance(a, float):
        return True
    for i in range(12):
        bit = (a // (1 << i)) % 2
        if not (statically_known_true(bit == 0) or statically_known_true(bit == 1)):
            return False
    return True


def root_derived(key, factories=frozenset()) -> bool:
    """``key`` (of :meth:`Scope.derive`) names a mask made from the roots by deterministic
    functions that take them, with constants: no factory (``torch.ones``, ``*_like``) other than
    those keyed in ``factories``, and no mask of unknown origin. Masks made so are exactly those
    that tracked mask tensors follow without a mode (every function on the way takes one of them),
    with ``factories`` made where the mode runs. A mask made inside compiled code counts by the
    tensors its graph was given: the derivation in between was followed while tracing."""
    kind = key[0]
    if kind == "root":
        return True
    if kind == "traced":
        return all(root_derived(k, factories) for k in key[2])
    if is_factory(kind):
        return key in factories
    if kind == "object":
        return False
    return _args_root_derived(key[1], factories) and _args_root_derived(key[2], factories)


def _args_root_derived(a, factories) -> bool:
    if isinstance(a, tuple) and a:
        if len(a) == 2 and a[0] == "T":
            return root_derived(a[1], factories)
        if a[0] == "meta":
            return False
        return all(_args_root_derived(x, factories) for x in a)
    return True


def version(t: torch.Tensor):
    """The version counter; an inference tensor has none. Keys live for one forward; an in-place
    write that is seen re-keys (or forgets) the tensor written and, where it has no counter,
    forgets its aliases (:meth:`Scope.forget_aliases`); and a tensor is keyed only where its
    writes are seen (``hook._mark``). So None is safe there."""
    return None if t.is_inference() else t._version


def flat(args, kwargs):
    """Every argument, lists and tuples opened."""
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from flat(a, {})
        else:
            yield a


_object_keys = itertools.count()
_local = threading.local()


def current_scope() -> Scope | None:
    """The scope of the innermost enabled forward running on this thread, or None."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def push(scope: Scope) -> bool:
    """Make ``scope`` current on this thread; True when it was not already the innermost."""
    stack = _local.__dict__.setdefault("stack", [])
    fresh = not (stack and stack[-1] is scope)
    stack.append(scope)
    return fresh


def pop() -> None:
    _local.stack.pop()


# -- resolving a plan ------------------------------------------------------------------------

_warned: set[str] = set()


def resolve_plan(
    mask: torch.Tensor | None,
    *,
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    device: torch.device,
    convention: str,
    policy: Policy,
    plan: VarlenPlan | None = None,
    scope: Scope | None = None,
    roots: list | None = None,
    derivation: str = "",
    graph: bool = False,
) -> VarlenPlan | None:
    """The plan an attention call runs with, or None for a call without a mask that runs plain
    SDPA (:attr:`Policy.unmasked_is_sdpa`).

    In order: the caller's ``plan``; for no mask, None or the all-valid plan; the plan ``scope``
    already built for a mask with the same derivation key (for a call in compiled code, the
    traced ``derivation`` from ``roots``: :func:`traced_signature`); else :func:`build_plan` (cached by
    mask object). ``graph``: the call comes from a compiled graph, whose compiler reuses a dead
    buffer's tensor object for a later buffer without bumping its version: there a mask is keyed
    by its derivation or as a tensor the scope keyed itself (a root, a tensor of the eager forward),
    never by its object, and a mask of unknown derivation gets the value-checked cache. A float 0/1 mask is read as boolean when ``policy.float_mask`` is ``"bool"``
    (one warning per process) and refused under ``"error"``; ``"bias"`` keeps SDPA's reading.
    """
    if plan is not None:
        return plan
    if mask is None:
        return None if policy.unmasked_is_sdpa else full_plan(batch, seqlen_q, seqlen_k, device)
    if scope is not None:
        scope.masked_calls += 1
    as_bool = policy.float_mask != "bias"
    key = None
    if scope is not None:
        key = scope.key_of(mask)
        if key is None and derivation:
            keys = tuple(scope.key_of(r) or scope.key_object(r) for r in roots)
            key = keys[0] if derivation == "r0" else ("traced", derivation, keys)
        if key is None and not graph and not scope.on_escaped(mask):
            key = scope.key_object(mask)
    pkey = None if key is None else (key, batch, heads, seqlen_q, seqlen_k, convention, as_bool, mask.dtype,
                                     str(mask.device))
    found = scope.plans.get(pkey) if pkey is not None else None
    if found is None:
        # Masks a forward derives live for that forward: caching them across calls buys nothing.
        cache = key is None or key[0] in ("root", "object")
        if key is not None and key[0] == "root":
            mask = scope.given[key[1]]
        found = build_plan(mask, batch_size=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, num_heads=heads,
                           convention=convention, float01_as_bool=as_bool, cache=cache)
        if pkey is not None:
            scope.plans[pkey] = found
    if found.read_as_bool:
        float_mask_read_as_bool(policy.float_mask, mask_info(mask.dtype, mask.shape))
    return found


def mask_info(dtype, shape) -> str:
    """How errors name a mask: ``"dtype torch.float32, shape (3, 1, 12, 12)"``."""
    return f"dtype {dtype}, shape {tuple(shape)}"


def float_mask_read_as_bool(policy: str, info: str) -> None:
    """A float 0/1 mask (``info``: :func:`mask_info`) was read as boolean: raise under
    ``float_mask="error"``, else warn once."""
    if policy == "error":
        raise InputTypeError(
            f"a float 0/1 attention mask ({info}) reached "
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
