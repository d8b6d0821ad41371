"""One attention call with its plan in hand: where it goes (:func:`route`) and running it.

Tensors here are padded ``[B, S, H, D]`` (flash-attn's layout). A call goes one of three ways:

* **fused**: a backend with its own backward (``Backend.NATIVE_BACKWARD``, FA4) runs pack +
  kernel + unpack as one autograd node (:mod:`varlen_attn.fused`);
* **packed**: pack q, k, v, the backend's forward under autograd, unpack;
* **masked SDPA** on the padded tensors: no mask at all, ``backend="sdpa"``, or a mask that
  cannot be packed (the reason goes to :func:`varlen_attn.stats`).

The route is decided once per call; the custom op (:mod:`varlen_attn.op`) keeps it for the
call's backward. :func:`masked_sdpa` is the library's one call of masked SDPA. The thread's
stack of entries (:class:`Entry`, :func:`current`) is here, below the op, which reads a
forward's checks from it (:func:`outer_in_op`); :mod:`varlen_attn.hook` pushes and reads it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from . import _stats, costs
from ._errors import BackendUnavailableError, InputValueError, KernelRefusedError, NotPackableError
from .fused import FusedAttention, packed_backward, packed_forward
from .kernels import BACKENDS, SDPA, TORCH_SDPA, Backend, VarlenInputs, select
from .kernels._base import empty_output, refusals
from .masks import canonical_mask, outer_factors
from .pack import gather_packed, pack_qkv, scatter_packed, unpack
from .plan import VarlenPlan, call_plan, full_plan, outer_plan, read_float01_as_bool
from .policy import Policy, float_mask_read_as_bool, mask_info


@dataclass(frozen=True)
class Options:
    """The per-call options of SDPA. ``causal`` is bottom-right aligned (flash-attn's
    convention; top-left and bottom-right agree when ``Sq == Sk``)."""

    scale: float | None = None
    causal: bool = False
    dropout_p: float = 0.0
    gqa: bool = False


@dataclass(frozen=True, eq=False)
class Route:
    """Where one call goes. ``impl`` None: masked SDPA, with ``reason`` when that is a fallback
    (None when SDPA was asked for or there is no mask)."""

    impl: Backend | None
    reason: str | None = None
    scale: float = 0.0  # the softmax scale the varlen kernel uses
    fused: bool = False  # one autograd node (impl has its own backward)
    float01: bool = False  # masked SDPA reads a float 0/1 mask as boolean, on the device
    rows: torch.Tensor | None = None  # masked SDPA's output scaled by it: an outer product's query rows


def mask4_of(mask: torch.Tensor | None, q, k, convention: str) -> torch.Tensor | None:
    """``mask`` viewed as ``[B|1, H|1, Sq|1, Sk]`` for padded ``[B, S, H, D]`` q and k (no copy)."""
    if mask is None:
        return None
    return canonical_mask(mask, batch_size=q.shape[0], num_heads=q.shape[2], seqlen_q=q.shape[1],
                          seqlen_k=k.shape[1], convention=convention)


def kernel_scale(q, opts: Options) -> float:
    """The softmax scale a varlen kernel gets: the caller's, else SDPA's default."""
    return q.shape[-1] ** -0.5 if opts.scale is None else float(opts.scale)


def route(q, k, v, plan: VarlenPlan | None, mask4: torch.Tensor | None, opts: Options, policy) -> Route:
    """Decide where a call goes. ``plan`` None means there is no mask. Raises where the policy
    cannot be honoured: ``strict`` with an unpackable mask, an explicit varlen backend that
    cannot run the inputs or the mask."""
    if plan is None:
        return Route(None)
    reason = None
    if not plan.packable:
        reason = plan.reason
    elif opts.causal and not (plan.self_aligned or (plan.q_identity and plan.k_identity)):
        reason = "causal with queries and keys in different segment positions"
    if reason is not None:
        return unpackable(policy, reason, mask4)
    name = policy.backend
    if name == SDPA:
        return Route(None)
    if q.device != plan.device:
        raise InputValueError(f"plan was built on {plan.device}, query is on {q.device}")
    scale = kernel_scale(q, opts)
    impl = _select(q, k, v, plan, scale, opts, name)
    fused = impl.NATIVE_BACKWARD and plan.total_q > 0 and not opts.dropout_p
    return Route(impl, None, scale, fused)


# What selection reads of a call -> (refusals when chosen, the backend): every call builds its own
# plan, and selection reads of a plan only whether it is static and holds an empty segment, so
# the calls of a forward (the same heads, head dim and dtype) share one selection. A kernel's
# refusal (KernelRefusedError) makes every earlier selection stale.
_selected: dict[tuple, tuple[int, Backend]] = {}


def _select(q, k, v, plan: VarlenPlan, scale: float, opts: Options, name: str) -> Backend:
    key = (name, q.dtype, q.device, q.shape[2], k.shape[2], q.shape[-1], v.shape[-1], scale > 0,
           opts.causal, opts.dropout_p > 0, plan.static, 0 in plan.seqlens_q or 0 in plan.seqlens_k)
    made, impl = _selected.get(key, (None, None))
    if made != refusals():
        # Selection reads heads, head dim, dtype and device (and the plan): per-token views do.
        probe = VarlenInputs(q.select(1, 0), k.select(1, 0), v.select(1, 0), plan, scale, opts.causal,
                             opts.dropout_p)
        impl = select(probe, name)
        if len(_selected) >= 256:
            _selected.clear()
        _selected[key] = (refusals(), impl)
    return impl


def unpackable(policy, reason: str, mask4: torch.Tensor | None) -> Route:
    """The route of a call whose mask cannot be packed: masked SDPA, the reason recorded as a
    fallback under ``auto``; raises under ``strict`` or an explicit varlen backend (never a silent
    fallback), and where the call has a plan but no mask (``mask4`` None: nothing for SDPA to run on)."""
    if policy.strict:
        raise NotPackableError(reason)
    if policy.backend not in ("auto", SDPA):
        raise BackendUnavailableError(f"backend {policy.backend!r} needs a packable mask: {reason}")
    if mask4 is None:
        raise InputValueError(f"plan is not packable ({reason}); pass attn_mask so SDPA can run")
    return Route(None, reason if policy.backend == "auto" else None)


def run(q, k, v, plan: VarlenPlan | None, mask4, r: Route, opts: Options) -> torch.Tensor:
    """Run the route ``r`` with autograd; ``[B, Sq, Hq, Dv]``."""
    if r.impl is None:
        mask = read_float01_as_bool(mask4)[0] if r.float01 else sdpa_mask(plan, mask4)
        out = masked_sdpa(q, k, v, mask, opts, r.reason)
        return out if r.rows is None else out * r.rows
    if r.fused:
        out = FusedAttention.apply(q, k, v, plan, r.impl, r.scale, opts.causal)
    else:
        qp, kp, vp = pack_qkv(q, k, v, plan)
        inp = VarlenInputs(qp, kp, vp, plan, r.scale, opts.causal, opts.dropout_p)
        # Every query masked (caption dropout on a whole batch): nothing for a kernel to do.
        out = unpack(empty_output(inp) if plan.total_q == 0 else r.impl.forward(inp), plan, "q")
    _stats.record_backend(r.impl.NAME)  # once it ran: a kernel that refused the call did not
    return zero_dead(out, plan, r.impl if r.fused else None)


def zero_dead(x: torch.Tensor, plan: VarlenPlan, fused: Backend | None = None) -> torch.Tensor:
    """Padded ``[B, Sq, ...]`` with the rows of the plan's dead elements (:attr:`VarlenPlan.dead`:
    no query attends a key) zeroed, as SDPA returns them; ``x`` itself where there are none, or
    where the fused route's kernel skipped them (``INTO_ZEROS``: zeros already, and their output
    gradient is never read)."""
    if plan.dead is None or (fused is not None and fused.INTO_ZEROS):
        return x
    return x.masked_fill(plan.dead.view((-1,) + (1,) * (x.dim() - 1)), 0)


def plan_and_route(q, k, v, mask4, opts: Options, policy, plan: VarlenPlan | None = None):
    """``(plan, route)`` of one call: its plan (the caller's ``plan``; without a mask None, plain
    SDPA where :attr:`Policy.unmasked_is_sdpa`, else the all-valid plan; else the plan of the
    call's own mask, :func:`~varlen_attn.plan.call_plan`, nothing looked up by a mask's identity
    or history), then :func:`route`. A static plan that the
    backend to run cannot take is built with its lengths on the host: at once for an explicit
    backend (``split_sdpa`` on a GPU: a fact of the backend), and under auto where no installed
    backend takes it (built again, routed once more)."""
    decision = cost_decision(q, k, v, mask4, opts, policy) if plan is None else None
    if decision is not None:
        _stats.record_route(decision.reason)
        if decision.stock:
            return None, stock_route(mask4, policy)

    def resolved(host=False):
        if plan is not None:
            return plan
        b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        if mask4 is None:
            return None if policy.unmasked_is_sdpa else full_plan(b, sq, sk, q.device)
        # A float 0/1 mask is read as boolean unless float_mask="bias" (warned once; "error" raises).
        found = call_plan(mask4, batch=b, seqlen_q=sq, seqlen_k=sk, float01_as_bool=policy.float_mask != "bias",
                          host=host)
        if found.read_as_bool:
            float_mask_read_as_bool(policy.float_mask, mask_info(mask4.dtype, mask4.shape))
        return found

    named = BACKENDS.get(policy.backend)
    found = resolved(host=named is not None and not named.runs_static(q.device.type))
    try:
        return found, route(q, k, v, found, mask4, opts, policy)
    except BackendUnavailableError:
        if found is None or not found.static or plan is not None:
            raise
        found = resolved(host=True)
        return found, route(q, k, v, found, mask4, opts, policy)


def stock_route(mask4, policy, rows: torch.Tensor | None = None) -> Route:
    """The route of a call auto leaves to stock's masked SDPA: no plan; a float 0/1 mask read as
    boolean (``float_mask="bool"``) is converted on the device by :func:`run`; ``rows``: an outer
    product's query rows, ``mask4`` its keys' mask (:func:`attend_outer`)."""
    return Route(None, float01=mask4.is_floating_point() and policy.float_mask == "bool", rows=rows)


def cost_applies(policy, causal: bool, float_mask: bool) -> bool:
    """auto chooses between stock's masked SDPA and packing for a masked call by cost: not
    where another backend is named, not for causal calls (stock and packing were measured
    without), not for a float mask under ``float_mask="error"`` (its check reads the mask)."""
    return policy.backend == "auto" and not causal and not (float_mask and policy.float_mask == "error")


def cost_decision(q, k, v, mask4, opts: Options, policy, order=None) -> costs.Decision | None:
    """auto's choice for a call of padded ``[B, S, H, D]`` q, k, v and ``mask4``
    (:func:`varlen_attn.costs.decide`, from the call's signature), or None where it does not
    choose (no mask, :func:`cost_applies`)."""
    if mask4 is None or not cost_applies(policy, opts.causal, mask4.is_floating_point()):
        return None
    return costs.decide(q.device, q.dtype, q.shape[2], k.shape[2], q.shape[-1], v.shape[-1], q.shape[1],
                        k.shape[1], costs.layout_of(mask4.shape), order)


def attend(q, k, v, mask4, opts: Options, policy, plan: VarlenPlan | None = None) -> torch.Tensor:
    """:func:`plan_and_route` then :func:`run` (:func:`rerouted`)."""
    plan, first = plan_and_route(q, k, v, mask4, opts, policy, plan)

    def choose():
        return route(q, k, v, plan, mask4, opts, policy)

    return rerouted(policy.backend, first, choose, lambda r: run(q, k, v, plan, mask4, r, opts))[1]


def factorable(mask4, opts: Options, policy, checks: Deferred | None = None, batch: int | None = None) -> bool:
    """A call :func:`attend_outer` runs: a mask with rows, the same in every head
    (``[B|1, 1, Sq, Sk]``, Sq > 1), not causal, for a varlen backend or auto; boolean, or a float
    0/1 mask of the shape of the model's own for a call of ``batch`` (the query's) elements
    (``checks.float01``: read as boolean)."""
    if mask4 is None or mask4.shape[1] != 1 or mask4.shape[2] <= 1 or opts.causal or policy.backend == SDPA:
        return False
    return mask4.dtype == torch.bool or (checks is not None and checks.float01
                                         and checks.factors(mask4, batch) is not None)


class Deferred:
    """How :func:`attend_outer` treats its device checks. ``flags`` a list: one forward of a model in
    :data:`varlen_attn.model.OUTER_MASKS`, whose flags are read once when it ends; None: a
    recomputation in backward of such a forward, after its checks passed: not read, a failed
    flag makes the rows NaN (:data:`UNREAD`). ``keep``: the ``[B, S]`` mask the model was called
    with, boolean (``float01``: a float mask read as one, its values checked to be 0 or 1 with a
    1 among them, the first flag); its factors are made once (:meth:`factors`), and a call whose
    mask equals their outer product in value (one comparison on the device) runs with them, so
    that the mask each block re-derives costs two tensor ops, not a reading of its own."""

    def __init__(self, keep: torch.Tensor | None = None, flags: list | None = None, float01: bool = False):
        self.flags, self.float01, self.keep = flags, False, None
        self._made: dict = {}
        if not (isinstance(keep, torch.Tensor) and keep.dim() == 2):
            return
        if keep.dtype == torch.bool:
            self.keep = keep
        elif float01 and keep.is_floating_point():
            self.float01, self.keep = True, keep != 0
            if flags is not None:  # not 0/1, or no 1 at all: not the keep-mask it is read as
                flags.append(((keep != 0) & (keep != 1)).any() | (keep != 1).all())

    @classmethod
    def of_call(cls, mask4: torch.Tensor, float01: bool) -> Deferred:
        """:data:`UNREAD`'s checks for one call: a recomputation in backward has no model mask, so
        the call's own rows stand for it, and the call takes the route its forward took on the
        model's factors (torch's checkpoint finds the tensors the forward saved). ``float01``: a
        float mask is read as boolean (``float_mask="bool"``); one with no 1 fails the check, as
        the model's does. UNREAD itself for a mask of another shape or kind."""
        floating = mask4.is_floating_point()
        if mask4.dim() != 4 or mask4.shape[1] != 1 or not (mask4.dtype == torch.bool or floating and float01):
            return UNREAD
        m = mask4[:, 0]
        keep = (m != 0).any(dim=-1)
        if floating:
            keep = keep | (m != 1).all()  # no 1: every row kept, so the mask is not their product
        found = cls(keep)
        found.float01 = floating
        return found

    def unread(self) -> Deferred:
        """The same factors, for the forward's recomputation: flags not read."""
        found = Deferred(None)
        found.keep, found._made, found.float01 = self.keep, self._made, self.float01
        return found

    def factors(self, mask4: torch.Tensor, batch: int | None):
        """``(outer [B, 1, S, S], keys [B, 1, 1, S])`` for a call of ``batch`` elements (its
        query's) whose mask has the shape of the outer product of ``keep`` (its keys' mask:
        ``keep``, all keys where an element keeps none), or None: also where ``keep`` is of
        another batch (a ``[1, S]`` mask the model broadcasts over its batch: its plan is of one
        element)."""
        keep = self.keep
        if keep is None or tuple(mask4.shape) != (keep.shape[0], 1, keep.shape[1], keep.shape[1]) \
                or keep.shape[0] != batch or mask4.device != keep.device:
            return None
        made = self._made.get("factors")
        if made is None:
            keys = torch.where(keep.any(dim=1, keepdim=True), keep, True)
            made = self._made["factors"] = (keep[:, None, :, None] & keep[:, None, None, :], keys[:, None, None, :])
        return made

    def plan(self) -> VarlenPlan:
        """The packed plan of the outer product of ``keep`` (:func:`~varlen_attn.plan.outer_plan`),
        built once a forward and kept for its recomputation."""
        made = self._made.get("plan")
        if made is None:
            _stats.record_plan_build()
            made = self._made["plan"] = outer_plan(self.keep, self.keep)
        return made

    def checked(self, x: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
        """``x`` (an output, or the rows it is scaled by), with ``bad`` kept for the forward's
        read; not read: ``x`` all NaN where ``bad`` (an addition: its backward is no pass over
        the gradient)."""
        if self.flags is not None:
            self.flags.append(bad)
            return x
        return x + torch.where(bad, float("nan"), 0.0).to(x.dtype)

    def rows(self, dtype: torch.dtype, bhsd: bool = False) -> torch.Tensor:
        """``keep`` as the output's row scale: ``[B, S, 1, 1]`` (``[B, 1, S, 1]`` with ``bhsd``)."""
        made = self._made.get((dtype, bhsd))
        if made is None:
            made = self._made[(dtype, bhsd)] = self.keep.to(dtype)[:, None, :, None] if bhsd \
                else self.keep.to(dtype)[:, :, None, None]
        return made


UNREAD = Deferred()  # a recomputation's checks, without the model's mask: each call's own factors


def call_checks(checks, mask, policy: Policy):
    """An entry's ``checks`` for a call of ``mask``: in a recomputation in backward without the
    model's mask (:data:`UNREAD`), the call's own rows stand for it (:meth:`Deferred.of_call`), so
    that it takes its forward's route (the hook's calls and the op's, eagerly and compiled)."""
    if checks is UNREAD and isinstance(mask, torch.Tensor):
        return Deferred.of_call(mask, policy.float_mask == "bool")
    return checks


def op_checks(deferred: bool):
    """The checks of a compiled graph's call (:mod:`varlen_attn.op`): this thread's entry's; in a
    recomputation in backward with no entry on the thread (a checkpoint traced into the compiled
    block) of a graph traced in a forward that collected its checks (``deferred``), that forward's,
    which it read: :data:`UNREAD`."""
    top = current()
    checks = None if top is None else top.checks
    if checks is None and deferred and torch._C._current_autograd_node() is not None:
        return UNREAD
    return checks


def attend_outer(q, k, v, mask4, opts: Options, policy, checks: Deferred | None) -> torch.Tensor:
    """A :func:`factorable` call as the key-padding call it is when its mask is an outer product
    ``keep_q x keep_k`` (:func:`~varlen_attn.masks.outer_factors`, or the model's mask's factors,
    :meth:`Deferred.factors`): routed as its keys' mask; packed, on the plan of the outer product
    (:func:`~varlen_attn.plan.outer_plan`: padded queries never computed, a plan the forward's
    calls share where the factors are the model's), else on stock's SDPA with the keys' mask,
    the rows then multiplied by ``keep_q``. Whether the mask is that product is a device flag,
    read as ``checks`` says (:class:`Deferred`); None: read now (one host read), and a mask that
    is no outer product takes :func:`attend`. auto first weighs the call as it is (an outer
    mask): one it leaves to stock's SDPA is read and changed by nothing."""
    decision = cost_decision(q, k, v, mask4, opts, policy)
    if decision is not None and decision.stock:
        _stats.record_route(decision.reason)
        return run(q, k, v, None, mask4, stock_route(mask4, policy), opts)
    keys, bad, plan_of, rows_of = _outer(q, mask4, checks)
    if checks is None:
        _stats.record_host_sync()
        if bad.item():
            return attend(q, k, v, mask4, opts, policy)
    packed = _keys_route(q, k, v, keys, plan_of, rows_of, opts, policy)
    if packed is None:  # no backend here runs a static plan: the keys' own plan
        rows = rows_of()
        return attend(q, k, v, keys, opts, policy) * (rows if checks is None else checks.checked(rows, bad))
    plan, first = packed
    out = rerouted(policy.backend, first, lambda: route(q, k, v, plan, keys, opts, policy),
                   lambda r: run(q, k, v, plan, keys, r, opts))[1]
    return out if checks is None else checks.checked(out, bad)


def _outer(q, mask4, checks: Deferred | None):
    """``(keys [B, 1, 1, S], bad, plan_of(), rows_of())`` of a :func:`factorable` call: the model's
    mask's factors where the mask has their shape (:meth:`Deferred.factors`, their plan made once a
    forward), else the call's own (:func:`~varlen_attn.masks.outer_factors`); ``bad``: a device
    flag, the mask is not their outer product."""
    made = checks.factors(mask4, q.shape[0]) if checks is not None else None
    if made is not None:
        outer, keys = made
        return keys, mask4.ne(outer).any(), checks.plan, lambda: checks.rows(q.dtype)
    keep_q, keep_k, bad = outer_factors(mask4)
    keep_q, keep_k = keep_q.expand(q.shape[0], -1), keep_k.expand(q.shape[0], -1)

    def plan_of():
        _stats.record_plan_build()
        return outer_plan(keep_q, keep_k)

    return keep_k[:, None, None, :], bad, plan_of, lambda: keep_q.to(q.dtype)[:, :, None, None]


def _keys_route(q, k, v, keys, plan_of, rows_of, opts: Options, policy):
    """``(plan, route)`` of a :func:`factorable` call weighed as its keys' mask: stock's SDPA on
    ``keys`` with the output's rows scaled by ``rows_of()`` (no plan) where auto leaves it to
    stock (its kernel, cuDNN's, fails on rows), else packed on the plan of the outer product
    (``plan_of()``); None where no backend here runs that plan. The decision is counted."""
    decision = cost_decision(q, k, v, keys, opts, policy)
    if decision is not None and decision.stock:
        found = None, stock_route(keys, policy, rows_of())
    else:
        plan = plan_of()
        try:
            found = plan, route(q, k, v, plan, keys, opts, policy)
        except BackendUnavailableError:
            return None
    if decision is not None:
        _stats.record_route(decision.reason)
    return found


def outer_in_op(q, k, v, mask4, opts: Options, policy, deferred: bool = False):
    """A compiled graph's call (:mod:`varlen_attn.op`) as :func:`attend_outer` runs it, with no
    read: packed on the plan of the outer product, or on stock's SDPA with its keys' mask and its
    rows scaled (:func:`stock_route`), its check kept as this thread's entry says
    (:class:`Deferred`). ``(plan, route, keys, checked)``, ``checked(out)`` the output with its
    check (``deferred``: traced in a forward that collects its checks, so that its recomputation
    in backward with no entry on the thread is unread, :data:`UNREAD`); None where the entry reads
    each call (no checks), the call is not the model's own
    (``policy.model``: the hook's; a call of the functional API in the graph is read in its call,
    as eagerly, where no checks reach it), not :func:`factorable`, or no backend runs the plan
    (:func:`plan_and_route` then); where auto leaves it to stock as it came, that route:
    ``(None, route, mask4, None)``."""
    checks = call_checks(op_checks(deferred), mask4, policy) if policy.model else None
    if checks is None or not factorable(mask4, opts, policy, checks, q.shape[0]):
        return None
    decision = cost_decision(q, k, v, mask4, opts, policy)
    if decision is not None and decision.stock:
        _stats.record_route(decision.reason)
        return None, stock_route(mask4, policy), mask4, None
    keys, bad, plan_of, rows_of = _outer(q, mask4, checks)
    packed = _keys_route(q, k, v, keys, plan_of, rows_of, opts, policy)
    return None if packed is None else (*packed, keys, lambda out: checks.checked(out, bad))


def rerouted(backend: str, first, choose, call):
    """``(route, call(route))``, ``route`` being ``first``. Under ``auto`` a call its kernel refused
    (:class:`KernelRefusedError`) runs again on ``choose()``, the next backend: the refusal made the
    kernel's backend unsupported for calls of this kind. An explicit backend raises it."""
    try:
        return first, call(first)
    except KernelRefusedError:
        if backend != "auto":
            raise
        r = choose()
        return r, call(r)


def forward_lse(q, k, v, plan: VarlenPlan, r: Route, opts: Options):
    """A fused route's forward without autograd: ``(out [B, Sq, Hq, Dv], lse [Hq, total_q])``."""
    _, out, lse = packed_forward(r.impl, q, k, v, plan, r.scale, opts.causal)
    _stats.record_backend(r.impl.NAME)
    return zero_dead(scatter_packed(out, plan, "q", r.impl.INTO_ZEROS), plan, r.impl), lse


def backward_native(dout, q, k, v, out, lse, plan: VarlenPlan, r: Route, opts: Options):
    """A fused route's backward from padded tensors (re-gathered): padded ``(dq, dk, dv)``."""
    packed = [gather_packed(t, plan, w) for t, w in ((q, "q"), (k, "k"), (v, "k"), (out, "q"))]
    inp = VarlenInputs(*packed[:3], plan, r.scale, opts.causal)
    return packed_backward(r.impl, inp, packed[3], lse, zero_dead(dout, plan, r.impl))


def sdpa_mask(plan: VarlenPlan | None, mask4: torch.Tensor | None) -> torch.Tensor | None:
    """The mask as SDPA must see it. A float 0/1 mask read as boolean is converted only here,
    on the SDPA path: the packed path never reads the mask, so that costs nothing per layer."""
    return mask4 != 0 if plan is not None and plan.read_as_bool and mask4 is not None else mask4


def causal_mask(mask4: torch.Tensor | None, sq: int, sk: int, device, top_left: bool = False) -> torch.Tensor:
    """``mask4`` restricted to causal positions, bottom-right aligned unless ``top_left``."""
    tri = torch.ones(sq, sk, dtype=torch.bool, device=device).tril(0 if top_left else sk - sq)
    if mask4 is None:
        return tri
    if mask4.dtype == torch.bool:
        return mask4 & tri
    return torch.where(tri, mask4, float("-inf")).to(mask4.dtype)


def masked_sdpa(q, k, v, mask4, opts: Options, reason: str | None = None) -> torch.Tensor:
    """SDPA on padded ``[B, S, H, D]`` tensors with ``mask4`` (None: no mask), ``reason``
    recorded as a fallback when given. Causal is bottom-right aligned, as everywhere here."""
    if reason is not None:
        _stats.record_fallback(reason)
    _stats.record_backend(SDPA)
    sq, sk = q.shape[1], k.shape[1]
    causal = opts.causal
    if causal and (mask4 is not None or sq != sk):
        mask4, causal = causal_mask(mask4, sq, sk, q.device), False
    out = TORCH_SDPA(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask4,
        dropout_p=opts.dropout_p, is_causal=causal, scale=opts.scale, enable_gqa=opts.gqa,
    )
    return out.transpose(1, 2)


# -- the thread's stack of entries: which SDPA calls varlen_attn answers, and with what (varlen_attn.hook)

# The top of this thread's stack of entries (``_local.top``). A plain threading.local: dynamo
# replays a traced store into one (an enabled model's pre-hook, traced as a frame of its own),
# not into a subclass's. The attribute is made where it can be (here, for the importing thread;
# ``enable_varlen`` for its caller's), so compiled code finds it from the first call on: a guard
# on its absence recompiles the second call (on any other thread, once).
_local = threading.local()
_local.top = None


def ensure_thread_state() -> None:
    """Make this thread's ``_local.top`` if it has none yet (eagerly: never while tracing)."""
    if not hasattr(_local, "top"):
        _local.top = None


@dataclass(eq=False)
class Entry:
    """What an enabled forward or attention module puts on this thread's stack: its policy,
    for a model's forward the mask handed back to checkpointed blocks that diffusers calls
    without it (``model._Checkpoint``), and the module that pushed it (its hook that always runs
    after the forward takes off its own entry only, also where an earlier pre-hook raised).
    ``checks``: how masks with rows are checked (:class:`Deferred`): an
    eager forward's of a model in ``OUTER_MASKS``, read once when it ends; its recomputation's,
    not read; None, read in each call. ``below``: the entry under it (the stack is a chain from
    the top, :func:`push`)."""

    policy: Policy
    checkpoint_mask: torch.Tensor | None = None
    owner: object = None
    checks: object = None  # a Deferred or None
    below: Entry | None = None


def current() -> Entry | None:
    """The innermost entry on this thread, or None outside every enabled forward."""
    return getattr(_local, "top", None)


def push(entry: Entry) -> None:
    """Put a new ``entry`` on top of this thread's stack. The stack is a chain from its top, not
    a list: compiled code reads (and guards on) the top alone, which is the same in every
    forward; a list's length differs between a forward and its checkpoint recomputation, and a
    list appended to while dynamo traces a hook made it recompile the hook at the next call."""
    entry.below = current()
    _local.top = entry


def pop() -> None:
    _local.top = _local.top.below


def pop_entry_of(owner) -> None:
    """Take ``owner``'s entry off the top of this thread's stack, if it is there."""
    top = current()
    if top is not None and top.owner is owner:
        _local.top = top.below


class active:  # noqa: N801 - a context manager
    """``with active(entry):`` SDPA calls on this thread are varlen_attn's, with ``entry.policy``."""

    def __init__(self, entry: Entry):
        self.entry = entry

    def __enter__(self):
        push(self.entry)
        return self.entry

    def __exit__(self, *exc):
        pop()
        return False
