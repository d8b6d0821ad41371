"""The plan: a mask turned into what a varlen kernel needs.

:func:`call_plan`: one attention call's plan from its own mask (no host read for boolean key
padding, one otherwise). :func:`build_plan`: the explicit API, one host read, by mask object.
Both keep their plans in one cache, confirmed by the mask's values (:class:`_PlanCache`).
docs/design.md ("One attention call, eager") has the story.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import weakref
from dataclasses import dataclass

import torch

from . import _stats
from ._errors import InputTypeError, InputValueError, NotPackableError, check_bool, check_size, describe, warn_once
from .masks import FLAG_NAMES, PADDING_FLAG_NAMES, analyze, canonical_mask, read_padding

# Why a mask cannot be packed, by device flag (masks.FLAG_NAMES, PADDING_FLAG_NAMES): the reason a
# plan records, and what the CUDA-graph path says when it refuses a mask.
REASONS = {
    "bias": (
        "attn_mask is an additive bias, not a padding pattern: some values are neither the "
        "row maximum nor at least 1000 below it (a float 0/1 mask, ALiBi or a learned bias)"
    ),
    "per_head": "attn_mask keeps different keys in different heads",
    "swamped": (
        "attn_mask has a row whose kept keys all carry a large negative value (at least 1e5 below "
        "zero, e.g. finfo.min on a row with no valid key): SDPA adds it to the scores and rounds "
        "them, which no varlen kernel reproduces"
    ),
    "structure": (
        "attn_mask is not a padding/segment pattern: two queries attend overlapping but "
        "different key sets (e.g. causal, sliding-window or arbitrary per-query masks)"
    ),
    # A static plan's own (masks.read_padding): what it cannot hold, though a dynamic plan may.
    "not_padding": (
        "attn_mask is not a padding mask: queries attend different key sets, or an element holds "
        "several segments"
    ),
}


def unpackable_reason(flags: dict) -> str | None:
    """The reason of the first flag raised among those that make a mask unpackable (:data:`REASONS`),
    in the flags' order; None where none is. ``flags``: flag name -> the value read on the host."""
    return next((REASONS[name] for name, raised in flags.items() if raised and name in REASONS), None)


def refuse_nan_inf(flags: dict, dtype, shape) -> None:
    """Raise for a mask whose device flags (read on the host) found NaN or +inf: SDPA would
    return NaN. ``dtype`` and ``shape`` are the mask's, for the message."""
    if flags["nan"] or flags["posinf"]:
        what = "NaN" if flags["nan"] else "+inf"
        raise InputValueError(
            f"attn_mask must not contain {what} (SDPA would return NaN), got a "
            f"{dtype} mask of shape {tuple(shape)} containing {what}"
        )


@dataclass(frozen=True, eq=False)
class VarlenPlan:
    """Packing metadata for one batch; build it with :func:`build_plan` or :func:`plan_from_seqlens`.

    A packed tensor holds the valid tokens of every segment back to back, segments in batch
    order and, within a batch element, in order of their first key's position; tokens of a
    segment keep their order. Segment ``s`` covers packed rows
    ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` of the queries and ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``
    of the keys. Query positions in no segment attend nothing: attention returns zeros there.

    Attributes:
        batch_size, seqlen_q, seqlen_k: the padded shape ``[B, Sq]`` / ``[B, Sk]``.
        packable: False when the mask is not a padding pattern; ``reason`` says why and every
            tensor field is None (attention then goes to SDPA with the original mask).
        cu_seqlens_q, cu_seqlens_k: ``[num_segments + 1]`` int32 on the mask's device.
        indices_q, indices_k: ``[total_q]`` / ``[total_k]`` int64 positions into ``B*Sq`` / ``B*Sk``.
        seqlens_q, seqlens_k: host tuples of segment lengths; ``segment_batch`` their batch index.
        max_seqlen_q, max_seqlen_k, total_q, total_k: Python ints.
        q_identity, k_identity: True when the packed order is the padded order (nothing to gather).
        self_aligned: True when queries and keys are the same positions in the same segments
            (self-attention), so causal masking by rank within a segment equals causal by position.
        read_as_bool: True when a float 0/1 mask was read as boolean (``float01_as_bool``);
            an SDPA fallback must then use ``mask != 0``.
        inverse_q/k, padding_q/k: padded position -> packed row (0 for padding) and the padding
            positions, int64 on the device, so unpacking is a gather plus a fill of the padding.
            In a static plan ``padding_q/k`` is a bool mask over the padded positions instead.
        static: True for a plan built with no host read (:func:`static_plan_tensors_of`, read by
            :func:`static_plan_of`): the packed
            tensors keep all ``B*S`` rows, valid tokens first (segments in batch order), the
            padding after ``cu_seqlens[-1]`` where no kernel reads it; ``max_seqlen_q/k`` are the
            bounds ``Sq``/``Sk``, ``total_q/k`` are ``B*Sq``/``B*Sk``, and no segment length is on
            the host (``seqlens_q/k`` are empty). What CUDA graphs can capture.
        dead: ``[B]`` bool on the device, or None: batch elements none of whose queries attends a
            key. A static plan gives them one full segment (no kernel sees an empty one) and
            attention zeroes their output rows, as SDPA returns zeros there.
        token: a one-element CPU tensor that stands for this plan where only tensors can go
            (a ``torch.compile`` graph passes it to the custom op in :mod:`varlen_attn.op`): it
            holds a number unique to the plan, which names the plan (also in a copy of the
            token) while the plan lives, and keeps nothing alive.
    """

    batch_size: int
    seqlen_q: int
    seqlen_k: int
    packable: bool
    reason: str | None = None
    device: torch.device | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    indices_q: torch.Tensor | None = None
    indices_k: torch.Tensor | None = None
    seqlens_q: tuple[int, ...] = ()
    seqlens_k: tuple[int, ...] = ()
    segment_batch: tuple[int, ...] = ()
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    total_q: int = 0
    total_k: int = 0
    q_identity: bool = False
    k_identity: bool = False
    self_aligned: bool = False
    read_as_bool: bool = False
    inverse_q: torch.Tensor | None = None
    inverse_k: torch.Tensor | None = None
    padding_q: torch.Tensor | None = None
    padding_k: torch.Tensor | None = None
    static: bool = False
    dead: torch.Tensor | None = None

    def __post_init__(self):
        # A static plan is built in an attention call for that call: its token, which only a plan
        # handed to compiled code needs, is made on first use (a host tensor costs microseconds).
        if not self.static:
            self.token  # noqa: B018

    @property
    def token(self) -> torch.Tensor:
        token = self.__dict__.get("_token")
        if token is None:
            ident = next(_token_ids)
            token = torch.tensor([ident], dtype=torch.int64)
            object.__setattr__(self, "_token", token)
            _plans_by_token[ident] = self
        return token

    def __reduce__(self):
        # Copies and pickles are rebuilt through the constructor, so each gets its own token.
        return (_rebuild, (type(self), {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}))

    @property
    def seqused_q(self) -> torch.Tensor | None:
        """The queries of each segment a kernel computes (``[B]`` int32): all, none for a dead
        element; None where the plan has none. Made once per plan (its forward and backward)."""
        if self.dead is None:
            return None
        found = self.__dict__.get("_seqused_q")
        if found is None:
            found = torch.diff(self.cu_seqlens_q).masked_fill_(self.dead, 0)
            object.__setattr__(self, "_seqused_q", found)
        return found

    @property
    def num_segments(self) -> int:
        return self.batch_size if self.static else len(self.seqlens_q)

    def __repr__(self) -> str:
        if not self.packable:
            return f"VarlenPlan(B={self.batch_size}, Sq={self.seqlen_q}, Sk={self.seqlen_k}, not packable: {self.reason})"
        if self.static:
            return f"VarlenPlan(B={self.batch_size}, Sq={self.seqlen_q}, Sk={self.seqlen_k}, static)"
        return (
            f"VarlenPlan(B={self.batch_size}, Sq={self.seqlen_q}, Sk={self.seqlen_k}, "
            f"segments={self.num_segments}, total_q={self.total_q}, total_k={self.total_k}, "
            f"max_seqlen_q={self.max_seqlen_q}, max_seqlen_k={self.max_seqlen_k})"
        )


def _rebuild(cls, fields: dict) -> VarlenPlan:
    return cls(**fields)


# token value -> plan, while the plan lives: a copy of a token (from saved-tensor hooks such as
# save_on_cpu) still names its plan.
_token_ids = itertools.count(1)
_plans_by_token: "weakref.WeakValueDictionary[int, VarlenPlan]" = weakref.WeakValueDictionary()


def plan_of_token(token: torch.Tensor) -> VarlenPlan | None:
    """The plan whose :attr:`VarlenPlan.token` is ``token`` or a copy of it, or None once that
    plan is freed. Read on the host only: a token moved to a device names no plan."""
    if token.device.type != "cpu":
        return None
    return _plans_by_token.get(int(token.item()))


def _host(t: torch.Tensor) -> list[int]:
    """The plan layer's single device-to-host transfer; counted so tests can prove it."""
    _stats.record_host_sync()
    return t.tolist()


def _cu(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def _order(bins: torch.Tensor, total: int) -> torch.Tensor:
    """Positions sorted by segment bin (stable: in order within a segment), valid ones only."""
    return torch.sort(bins, stable=True).indices[:total]


def read_float01_as_bool(mask4: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask, as_bool)``: a float mask whose values are all 0 or 1, with at least one 1, turned
    into 0 (keep) / -inf (drop), else unchanged; ``as_bool`` says which, a device scalar. Decided
    on the device, so the choice costs no sync of its own."""
    as_bool = ((mask4 == 0) | (mask4 == 1)).all() & (mask4 == 1).any()
    return torch.where(as_bool, torch.where(mask4 != 0, 0.0, float("-inf")).to(mask4.dtype), mask4), as_bool


def build_plan(
    attn_mask: torch.Tensor | None,
    *,
    batch_size: int | None = None,
    seqlen_q: int | None = None,
    seqlen_k: int | None = None,
    num_heads: int | None = None,
    convention: str = "model",
    strict: bool = False,
    device: torch.device | str | None = None,
    float01_as_bool: bool = False,
    cache: bool = True,
) -> VarlenPlan:
    """Turn a mask into a :class:`VarlenPlan`, with at most one device-to-host sync.

    Args:
        attn_mask: bool (True = keep) or additive float mask, in one of the layouts of
            :func:`varlen_attn.masks.canonical_mask`; ``[B, S]`` is a key-padding mask (valid
            keys may sit anywhere in the row). None means every token is valid (give
            ``batch_size``, ``seqlen_q`` and ``device``).
        batch_size, seqlen_q, seqlen_k: the attention shape; inferred from the mask where it
            has those dims (``seqlen_q`` defaults to ``seqlen_k``: self-attention).
        num_heads: needed to read diffusers' ``[B*H, 1, Sk]`` layout, and to check a per-head mask.
        convention: ``"model"`` (batch first, see above) or ``"torch"`` (SDPA's broadcasting).
        strict: raise :class:`NotPackableError` instead of returning a non-packable plan.
        float01_as_bool: read a float mask whose values are all 0 or 1, with at least one 1, as
            boolean (1 = keep) instead of SDPA's additive reading; decided on the device and read
            in the same single sync (``plan.read_as_bool`` tells which reading was taken). Left
            False, such a mask (other than all ones) keeps SDPA's reading, with one warning per
            process, and its plan takes a second sync.
        cache: look the plan up in, and store it into, the plan cache, by mask object;
            False always builds (one sync) and leaves the cache untouched.

    Returns:
        A frozen plan. Cached by mask object: calling again with the same mask tensor and shape
        returns the same plan after one device-side comparison with a copy of the mask (a
        host read, no build); a mask changed in any way, also through ``.data``, numpy, its
        storage or under ``torch.inference_mode``, gets a new plan.

    Raises:
        InputValueError: NaN or +inf in the mask, or a shape that does not fit; a mask whose last
            dim is 1 under a longer query dim (``[B, S, 1]``) unless ``seqlen_k`` is given.
        NotPackableError: with ``strict=True``, when the mask is not a padding pattern.
    """
    batch_size, seqlen_q, seqlen_k, num_heads = (
        None if n is None else check_size(name, n, low)
        for name, n, low in (("batch_size", batch_size, 0), ("seqlen_q", seqlen_q, 0), ("seqlen_k", seqlen_k, 0),
                             ("num_heads", num_heads, 1)))
    for name, flag in (("strict", strict), ("float01_as_bool", float01_as_bool), ("cache", cache)):
        check_bool(name, flag)
    if attn_mask is None:
        if batch_size is None or seqlen_q is None:
            raise InputValueError("build_plan(None) needs batch_size and seqlen_q, got None")
        return full_plan(batch_size, seqlen_q, seqlen_k if seqlen_k is not None else seqlen_q,
                         torch.device(device or "cpu"))
    if not isinstance(attn_mask, torch.Tensor):
        raise InputTypeError(f"attn_mask must be a torch.Tensor or None, got {describe(attn_mask)}")
    if attn_mask.dim() == 0 or attn_mask.shape[-1] == 0:
        raise InputValueError(f"attn_mask must have a key dim of at least one key, got {describe(attn_mask)}")
    if attn_mask.is_meta:
        raise InputValueError(f"attn_mask must hold data (a plan reads its values), got {describe(attn_mask)}")
    if seqlen_k is None:
        if attn_mask.shape[-1] == 1 and attn_mask.dim() >= (2 if convention == "torch" else 3) and attn_mask.shape[-2] > 1:
            # [B, S, 1] (a keep-mask shaped for multiplying hidden states) would read as one key per query.
            raise InputValueError(
                f"attn_mask's last dim is the key length, got shape {tuple(attn_mask.shape)} (Sk=1 under "
                f"Sq={attn_mask.shape[-2]}): a key-padding mask is [B, Sk] (attn_mask.squeeze(-1)); pass "
                f"seqlen_k to broadcast one value over every key, or seqlen_k=1 for a single key")
        seqlen_k = attn_mask.shape[-1]
    if batch_size is None:
        batch_size = _infer_batch(attn_mask, convention, num_heads)
    if seqlen_q is None:
        seqlen_q = attn_mask.shape[-2] if attn_mask.dim() >= 3 and attn_mask.shape[-2] > 1 else seqlen_k
    float01_as_bool = float01_as_bool and attn_mask.is_floating_point()
    key = (batch_size, seqlen_q, seqlen_k, num_heads, convention, float01_as_bool)

    def build(mask):
        _stats.record_plan_build()
        # A float 0/1 mask read additively is almost surely a keep-mask: the build's one read tells;
        # then it warns once and reads it as SDPA does.
        probe = not float01_as_bool and mask.is_floating_point()
        plan = _build(mask, batch_size, seqlen_q, seqlen_k, num_heads, convention, float01_as_bool or probe)
        if probe and plan.read_as_bool:
            if plan.packable and plan.q_identity and plan.k_identity:  # all ones: both readings keep every key
                return dataclasses.replace(plan, read_as_bool=False)
            warn_once("build_plan_float01", (
                f"varlen_attn: build_plan got a float attn_mask of 0s and 1s ({mask.dtype}, shape "
                f"{tuple(mask.shape)}), read as SDPA reads a float mask: an additive bias (0 masks "
                f"nothing out, 1 adds one to the scores). For a keep-mask pass a bool mask or "
                f"float01_as_bool=True."))
            _stats.record_plan_build()
            plan = _build(mask, batch_size, seqlen_q, seqlen_k, num_heads, convention, False)
        return plan

    plan = _PLANS.plan(attn_mask, ("build_plan", *key), build, weak=True) if cache else build(attn_mask)
    if strict and not plan.packable:
        raise NotPackableError(plan.reason)
    return plan


def plan_from_seqlens(
    seqlens_q: list[int] | tuple[int, ...],
    seqlens_k: list[int] | tuple[int, ...] | None = None,
    *,
    seqlen_q: int | None = None,
    seqlen_k: int | None = None,
    device: torch.device | str = "cpu",
) -> VarlenPlan:
    """Plan for right-padded batches from host lengths: sample ``b`` keeps its first ``seqlens[b]``
    tokens. Builds everything from host data: no sync at all (xformers' ``from_seqlens`` idea)."""
    seqlens_k = list(seqlens_q if seqlens_k is None else seqlens_k)
    seqlens_q = list(seqlens_q)
    if len(seqlens_q) != len(seqlens_k):
        raise InputValueError(
            f"seqlens_q and seqlens_k must have the same length (one per batch element), "
            f"got {len(seqlens_q)} and {len(seqlens_k)}"
        )
    for name, lens in (("seqlens_q", seqlens_q), ("seqlens_k", seqlens_k)):
        if any((not isinstance(n, int)) or n < 0 for n in lens):
            raise InputValueError(f"{name} must be non-negative ints, got {lens}")
    sq = seqlen_q if seqlen_q is not None else max(seqlens_q, default=0)
    sk = seqlen_k if seqlen_k is not None else max(seqlens_k, default=0)
    if any(n > sq for n in seqlens_q) or any(n > sk for n in seqlens_k):
        raise InputValueError(
            f"a length exceeds the padded length: seqlens_q={seqlens_q} (Sq={sq}), "
            f"seqlens_k={seqlens_k} (Sk={sk})"
        )
    device = torch.device(device)
    # Caption dropout leaves samples with no key: their queries attend nothing (zero rows).
    keep = [(b, lq, lk) for b, (lq, lk) in enumerate(zip(seqlens_q, seqlens_k)) if lq > 0 and lk > 0]
    idx_q = [b * sq + i for b, lq, _ in keep for i in range(lq)]
    idx_k = [b * sk + j for b, _, lk in keep for j in range(lk)]
    lq = tuple(x[1] for x in keep)
    lk = tuple(x[2] for x in keep)
    return _make_plan(len(seqlens_q), sq, sk, device, lq, lk, tuple(x[0] for x in keep),
                      _to_device(idx_q, torch.int64, device), _to_device(idx_k, torch.int64, device))


def _infer_batch(mask: torch.Tensor, convention: str, num_heads: int | None) -> int:
    if convention == "torch" or mask.dim() == 1:
        return mask.shape[0] if mask.dim() == 4 else 1
    if mask.dim() == 3 and num_heads and num_heads > 1 and mask.shape[0] % num_heads == 0:
        raise InputValueError(
            f"attn_mask of shape {tuple(mask.shape)} with num_heads={num_heads} is ambiguous "
            f"([B, Sq, Sk] or [B*H, Sq, Sk]): pass batch_size"
        )
    return mask.shape[0]


_FULL_PLANS: dict[tuple, VarlenPlan] = {}


def full_plan(batch: int, sq: int, sk: int, device: torch.device) -> VarlenPlan:
    """Plan with every token valid, cached by shape and device (built from host data, no sync)."""
    key = (batch, sq, sk, str(device))
    plan = _FULL_PLANS.get(key)
    if plan is None:
        if len(_FULL_PLANS) >= 64:
            _FULL_PLANS.clear()
        plan = _FULL_PLANS[key] = plan_from_seqlens(
            [sq] * batch, [sk] * batch, seqlen_q=sq, seqlen_k=sk, device=device)
    return plan


def _to_device(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host list -> device tensor without a blocking copy (pinned staging on CUDA)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _make_plan(batch, sq, sk, device, lens_q, lens_k, seg_batch, idx_q, idx_k,
               cu_q=None, cu_k=None, aligned=None) -> VarlenPlan:
    total_q, total_k = sum(lens_q), sum(lens_k)
    inv_q, pad_q = _inverse(idx_q, batch * sq, total_q)
    inv_k, pad_k = _inverse(idx_k, batch * sk, total_k)
    if cu_q is None:
        cu_q = _cu(_to_device(list(lens_q), torch.int32, device))
        cu_k = _cu(_to_device(list(lens_k), torch.int32, device))
    one_per_batch = list(seg_batch) == list(range(batch))
    return VarlenPlan(
        batch_size=batch, seqlen_q=sq, seqlen_k=sk, packable=True, device=device,
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        indices_q=idx_q, indices_k=idx_k,
        seqlens_q=tuple(lens_q), seqlens_k=tuple(lens_k), segment_batch=tuple(seg_batch),
        max_seqlen_q=max(lens_q, default=0), max_seqlen_k=max(lens_k, default=0),
        total_q=total_q, total_k=total_k,
        q_identity=one_per_batch and total_q == batch * sq,
        k_identity=one_per_batch and total_k == batch * sk,
        self_aligned=(sq == sk and lens_q == lens_k) if aligned is None else aligned,
        inverse_q=inv_q, inverse_k=inv_k, padding_q=pad_q, padding_k=pad_k,
    )


def _inverse(indices: torch.Tensor, rows: int, total: int):
    """Row -> packed position (0 where padding) and the padding rows; device work, no sync."""
    inverse = torch.zeros(rows, dtype=torch.int64, device=indices.device)
    inverse.index_copy_(0, indices, torch.arange(total, dtype=torch.int64, device=indices.device))
    valid = torch.zeros(rows, dtype=torch.uint8, device=indices.device).index_fill_(0, indices, 1)
    return inverse, _order(valid, rows - total)


def _build(mask, batch, sq, sk, num_heads, convention, float01_as_bool=False) -> VarlenPlan:
    m4 = canonical_mask(mask, batch_size=batch, num_heads=num_heads, seqlen_q=sq, seqlen_k=sk,
                        convention=convention)
    as_bool = torch.zeros((), dtype=torch.bool, device=mask.device)
    if float01_as_bool:
        m4, as_bool = read_float01_as_bool(m4)
    a = analyze(m4, batch_size=batch, seqlen_q=sq)
    device = mask.device
    nbins = batch * sk
    # Segment bin = b * Sk + segment id; invalid positions go to the past-the-end bin.
    base_q = torch.arange(batch, device=device)[:, None] * sk
    bins_q = torch.where(a.seg_q >= 0, a.seg_q + base_q, nbins).reshape(-1)
    bins_k = torch.where(a.seg_k >= 0, a.seg_k + base_q, nbins).reshape(-1)
    ones = torch.ones((), dtype=torch.int64, device=device)
    cnt_q = torch.zeros(nbins + 1, dtype=torch.int64, device=device).index_add_(0, bins_q, ones.expand_as(bins_q))
    cnt_k = torch.zeros(nbins + 1, dtype=torch.int64, device=device).index_add_(0, bins_k, ones.expand_as(bins_k))
    aligned = (a.seg_q == a.seg_k).all() if sq == sk else torch.zeros((), dtype=torch.bool, device=device)
    host = _host(torch.cat([as_bool.to(torch.int64)[None], a.flags, aligned.to(torch.int64)[None],
                            cnt_q[:nbins], cnt_k[:nbins]]))
    read_as_bool, host = bool(host[0]), host[1:]

    nflags = len(FLAG_NAMES)
    flags = dict(zip(FLAG_NAMES, host[:nflags]))
    refuse_nan_inf(flags, mask.dtype, mask.shape)
    reason = unpackable_reason(flags)
    if reason is not None:
        return VarlenPlan(batch_size=batch, seqlen_q=sq, seqlen_k=sk, packable=False,
                          reason=reason, device=device, read_as_bool=read_as_bool)
    aligned = bool(host[nflags])
    hq, hk = host[nflags + 1:nflags + 1 + nbins], host[nflags + 1 + nbins:]
    segs = [i for i in range(nbins) if hk[i]]
    lens_q = tuple(hq[i] for i in segs)
    lens_k = tuple(hk[i] for i in segs)
    seg_batch = tuple(i // sk for i in segs)
    idx_q = _order(bins_q, sum(lens_q))
    idx_k = _order(bins_k, sum(lens_k))
    # cu_seqlens from the device counts (non-empty bins first, in bin order): no host->device copy.
    seg_bins = _order((cnt_k[:nbins] == 0).to(torch.uint8), len(segs))
    cu_q = _cu(cnt_q[seg_bins].to(torch.int32))
    cu_k = _cu(cnt_k[seg_bins].to(torch.int32))
    plan = _make_plan(batch, sq, sk, device, lens_q, lens_k, seg_batch, idx_q, idx_k, cu_q, cu_k, aligned)
    return dataclasses.replace(plan, read_as_bool=True) if read_as_bool else plan


# What a static plan's ``problems`` vector reports, in order: the padding reading's flags, then a
# float 0/1 mask that was read as boolean.
STATIC_PROBLEMS = PADDING_FLAG_NAMES + ("float01",)


def static_plan_tensors_of(mask4: torch.Tensor, *, batch: int, seqlen_q: int, seqlen_k: int,
                           float01_as_bool: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A plan from a ``[B|1, H|1, Sq|1, Sk]`` mask with **no host read** (what a CUDA graph can
    capture), as tensors: ``(plan tensors, problems)``, the plan's order, inverse and cu_seqlens
    in one int64 vector (:func:`static_plan_of` reads it); shapes fixed by ``B``, ``Sq``, ``Sk``.
    One segment per batch element: fits padding masks (:func:`varlen_attn.masks.read_padding`).
    ``problems``: int64 in :data:`STATIC_PROBLEMS` order, all zero when the plan is exact (the
    caller checks). Tensor ops only, so ``torch.compile`` traces it into the graph."""
    as_bool = torch.zeros((), dtype=torch.bool, device=mask4.device)
    if float01_as_bool and mask4.is_floating_point():
        mask4, as_bool = read_float01_as_bool(mask4)
    valid_q, valid_k, flags = read_padding(mask4, batch_size=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    problems = torch.cat([flags, as_bool.to(torch.int64)[None]])
    return torch.cat([*_static_side(valid_q), *_static_side(valid_k)]), problems


def static_plan_of(tensors: torch.Tensor, *, batch: int, seqlen_q: int, seqlen_k: int) -> VarlenPlan:
    """The static plan whose tensors :func:`static_plan_tensors_of` put in one int64 vector; a
    padded position is padding where its packed row lies past the last segment."""
    rq, rk = batch * seqlen_q, batch * seqlen_k
    pq, iq, cq, pk, ik, ck = torch.split(tensors, [rq, rq, batch + 1, rk, rk, batch + 1])
    cq, ck = cq.to(torch.int32), ck.to(torch.int32)
    return _padding_plan(batch, seqlen_q, seqlen_k, (pq, iq, cq, iq >= cq[-1]), (pk, ik, ck, ik >= ck[-1]), None)


def _static_side(valid: torch.Tensor):
    """``valid [B, S]`` -> (order, inverse, cu_seqlens), all int64: the valid positions of each
    element in order, elements in batch order, then every padding position; no host read.
    Rows are counted, not sorted for: a stable sort took 62 of a plan's 330 us on an H100
    (benchmarks/NOTES.md, entry 12)."""
    b, s = valid.shape
    cu = torch.nn.functional.pad(valid.sum(dim=1).cumsum(0), (1, 0))
    before_valid = valid.to(torch.int64).cumsum(dim=1) - 1
    before_padding = (~valid).reshape(-1).to(torch.int64).cumsum(dim=0).view(b, s) - 1
    inverse = torch.where(valid, cu[:-1, None] + before_valid, cu[-1] + before_padding).reshape(-1)
    # Into zeros, not empty: compilers merge equal subexpressions but never two torch.empty.
    order = torch.zeros_like(inverse).scatter_(0, inverse, torch.arange(b * s, device=valid.device))
    return order, inverse, cu


class _PlanCache:
    """Plans kept with a copy of the mask each was built from (:func:`_compact_copy`), by the
    call's structure (the mask's shape, dtype and device, and how it is read). A plan is taken
    only where the mask equals a kept copy in value: one comparison on the device with every copy
    of that structure, one host read. So a mask changed in any way is built anew, and masks that
    take turns (a conditional and an unconditional batch) each keep their plan. ``weak``: keyed
    also by the mask object, whose collection drops the entry (a new mask then costs its build's
    read alone, not a comparison as well). At most ``per_key`` copies of one key, ``capacity``
    entries and ``limit`` bytes of copies in all; the least recently used goes first."""

    def __init__(self, per_key: int, capacity: int, limit: int):
        self._entries: list[tuple] = []  # (key, copy, plan, weak reference or None), most recently used last
        # Reentrant: a mask collected while the lock is held (a GC pass inside it) calls _evict here.
        self._lock = threading.RLock()
        self._per_key, self._capacity, self._limit = per_key, capacity, limit

    def plan(self, mask: torch.Tensor, key: tuple, build, weak: bool = False) -> VarlenPlan:
        """A kept plan of ``key`` whose copy equals ``mask`` (NaN equals nothing), else
        ``build(copy)``: built from the copy, the kept plan is the copy's even if ``mask`` changes."""
        key = (id(mask) if weak else None, tuple(mask.shape), mask.dtype, mask.device, *key)
        with self._lock:
            kept = [e for e in self._entries if e[0] == key and (e[3] is None or e[3]() is mask)]
        if kept:
            differs = [torch.ne(copy, mask).any() for _, copy, _, _ in kept]
            differs = _host(torch.stack(differs)) if len(differs) > 1 else [_host(differs[0])]
            hit = next((e for e, d in zip(kept, differs) if not d), None)
            if hit is not None:
                with self._lock:
                    self._entries = [e for e in self._entries if e is not hit] + [hit]
                return hit[2]
        copy = _compact_copy(mask, self._limit)
        if copy is None:
            return build(mask)
        plan = build(copy.expand(mask.shape))
        ref = weakref.ref(mask, self._evict) if weak else None
        with self._lock:
            same_key = [e for e in self._entries if e[0] == key]
            oldest = same_key[0] if len(same_key) >= self._per_key else None
            entries = [e for e in self._entries if e is not oldest] + [(key, copy, plan, ref)]
            size = sum(_nbytes(e[1]) for e in entries)
            while len(entries) > self._capacity or size > self._limit:
                size -= _nbytes(entries.pop(0)[1])
            self._entries = entries
        return plan

    def _evict(self, ref: weakref.ref) -> None:
        with self._lock:
            self._entries = [e for e in self._entries if e[3] is not ref]

    def clear(self) -> None:
        with self._lock:
            self._entries = []


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _compact_copy(mask: torch.Tensor, limit: int) -> torch.Tensor | None:
    """A copy of ``mask`` with its broadcast (stride-0) dims kept at size 1 (a mask expanded over
    heads costs one head's memory; compared with a mask by broadcasting), or None past ``limit``
    bytes."""
    index = tuple(slice(0, 1) if st == 0 and n > 1 else slice(None) for n, st in zip(mask.shape, mask.stride()))
    view = mask.detach()[index]
    return view.clone() if _nbytes(view) <= limit else None


# The plans of attention calls (call_plan) and of build_plan (by mask object too), one cache: up
# to 4 masks of one structure, 32 in all, 1 GiB of copies (Chroma's 1024 px [3, 1, 4608, 4608]
# bool mask is 64 MiB).
_PLANS = _PlanCache(per_key=4, capacity=32, limit=1 << 30)


def clear_plan_cache() -> None:
    """Forget every plan cached by :func:`build_plan` and by attention calls (:func:`call_plan`;
    this frees their copies of the masks), and the cached all-valid plans: the next call on any
    mask builds anew. Plans already handed out stay valid."""
    _PLANS.clear()
    _FULL_PLANS.clear()


# -- the plan of one attention call ----------------------------------------------------------

_IDENTITY_CU: dict[tuple, torch.Tensor] = {}


def _identity_cu(batch: int, seqlen: int, device: torch.device) -> torch.Tensor:
    """``[0, S, 2S, ..., B*S]`` int32: every row valid, one segment per element (a constant per
    shape and device, made once)."""
    key = (batch, seqlen, device)
    cu = _IDENTITY_CU.get(key)
    if cu is None:
        if len(_IDENTITY_CU) >= 64:
            _IDENTITY_CU.clear()
        cu = _IDENTITY_CU[key] = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)
    return cu


def padding_side(valid: torch.Tensor):
    """``valid [B, S]`` -> ``(order, inverse, cu_seqlens int32, padding)`` of a static plan's side
    (:attr:`VarlenPlan.static`): tensor ops only, no host read, so it traces into a graph."""
    order, inverse, cu = _static_side(valid)
    cu = cu.to(torch.int32)
    return order, inverse, cu, inverse >= cu[-1]


def key_padding_side(mask4: torch.Tensor, *, batch: int, seqlen_k: int):
    """A boolean key-padding mask ``[B|1, 1, 1, Sk]`` -> ``(dead [B], (order, inverse, cu_seqlens
    int32, padding))``: the elements with no valid key (:attr:`VarlenPlan.dead`), and the static
    layout of the valid keys, where a dead element keeps all its keys (one full segment, never an
    empty one). The inverse makes unpacking a gather: 47 against 126 us for ``index_copy`` per dk,
    dv at Qwen-Image 1024 px (H200, benchmarks/NOTES.md entry 53). A stable sort, not counting
    (:func:`padding_side`): one torch call against a dozen, in every attention call."""
    valid = mask4[:, 0, 0].expand(batch, seqlen_k)
    dead = valid.any(dim=1).logical_not()
    valid = valid | dead[:, None]
    padding = valid.reshape(-1).logical_not()
    order = torch.argsort(padding, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))
    cu = torch.nn.functional.pad(valid.sum(dim=1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    return dead, (order, inverse, cu, padding)


def outer_plan(keep_q: torch.Tensor, keep_k: torch.Tensor) -> VarlenPlan:
    """The static plan of the outer product ``keep_q[:, None, :, None] & keep_k[:, None, None, :]``
    (Chroma's mask) from ``keep_q [B, Sq]`` and ``keep_k [B, Sk]`` (bool), on the device, no
    host read: padded queries are never computed (their rows zeros); an element where no query
    attends a key is dead (:attr:`VarlenPlan.dead`)."""
    dead = (keep_q.any(dim=1) & keep_k.any(dim=1)).logical_not()
    q_side = padding_side(keep_q | dead[:, None])
    k_side = q_side if keep_k is keep_q else padding_side(keep_k | dead[:, None])
    return _padding_plan(keep_q.shape[0], keep_q.shape[1], keep_k.shape[1], q_side, k_side, dead,
                         self_aligned=keep_k is keep_q)


def _padding_plan(batch: int, sq: int, sk: int, q_side, k_side, dead, read_as_bool: bool = False,
                  self_aligned: bool = False) -> VarlenPlan:
    """A static plan (:attr:`VarlenPlan.static`) from its sides (:func:`padding_side`); ``q_side``
    None: every query row in its place (nothing to gather)."""
    pq, iq, cq, padq = q_side if q_side is not None else (None, None, _identity_cu(batch, sq, k_side[2].device), None)
    pk, ik, ck, padk = k_side
    return VarlenPlan(
        batch_size=batch, seqlen_q=sq, seqlen_k=sk, packable=True, device=ck.device,
        cu_seqlens_q=cq, cu_seqlens_k=ck, indices_q=pq, indices_k=pk,
        max_seqlen_q=sq, max_seqlen_k=sk, total_q=batch * sq, total_k=batch * sk,
        q_identity=q_side is None, inverse_q=iq, inverse_k=ik, padding_q=padq, padding_k=padk,
        static=True, dead=dead, read_as_bool=read_as_bool, self_aligned=self_aligned,
    )


def call_plan(mask4: torch.Tensor, *, batch: int, seqlen_q: int, seqlen_k: int,
              float01_as_bool: bool = False, host: bool = False) -> VarlenPlan:
    """The plan of one attention call, from that call's own mask ``mask4`` (its
    ``[B|1, H|1, Sq|1, Sk]`` view, :func:`~varlen_attn.masks.canonical_mask`).

    * A boolean key-padding mask (``[B|1, 1, 1, Sk]``: every query attends the same keys): a
      static plan built on the device with **no host read**; queries stay in place.
    * Any other mask: a kept plan of an equal mask (:data:`_PLANS`, one host read), else
      read as a padding mask in one host read: a static plan, an unpackable plan saying why, or,
      for several segments per element, the general plan (:func:`build_plan`, one more read).

    An element with no attended key keeps one full segment and is named in
    :attr:`VarlenPlan.dead` (its rows zeroed, as SDPA's).

    ``host``: the general plan, segment lengths on the host (one read), for a backend that cannot
    run a static plan (``split_sdpa`` on a GPU)."""
    if is_key_padding(mask4) and not host:
        _stats.record_plan_build()
        dead, k_side = key_padding_side(mask4, batch=batch, seqlen_k=seqlen_k)
        return _padding_plan(batch, seqlen_q, seqlen_k, None, k_side, dead)
    # A kept plan is taken only where it was built: the same stream (its tensors were queued
    # there) and the same inference mode (inference tensors cannot be saved for backward).
    stream = torch.cuda.current_stream(mask4.device).stream_id if mask4.is_cuda else None
    key = (batch, seqlen_q, seqlen_k, float01_as_bool, host, stream, torch.is_inference_mode_enabled())
    return _PLANS.plan(mask4, ("call", *key), lambda m: _built_plan(m, batch, seqlen_q, seqlen_k, float01_as_bool, host))


def _built_plan(mask4, batch, seqlen_q, seqlen_k, float01_as_bool, host) -> VarlenPlan:
    """:func:`call_plan`'s build for a mask that is not boolean key padding (or for ``host``)."""
    _stats.record_plan_build()
    if host:
        return _build(mask4, batch, seqlen_q, seqlen_k, None, "torch", float01_as_bool and mask4.is_floating_point())
    m4, as_bool = mask4, None
    if float01_as_bool and m4.is_floating_point():
        m4, as_bool = read_float01_as_bool(m4)
    valid_q, valid_k, flags = read_padding(m4, batch_size=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    dead = valid_k.any(dim=1).logical_not_()
    # Self-attention whose queries and keys are the same positions: causal by rank in a segment
    # is causal by position there (VarlenPlan.self_aligned).
    aligned = (valid_q == valid_k).all() if seqlen_q == seqlen_k else dead.new_zeros(())
    facts = [valid_q.all(), dead.any(), aligned] + ([] if as_bool is None else [as_bool])
    host = _host(torch.cat([flags, torch.stack(facts).to(torch.int64)]))
    n = len(PADDING_FLAG_NAMES)
    found = dict(zip(PADDING_FLAG_NAMES, host[:n]))
    all_q, any_dead, aligned = host[n], host[n + 1], bool(host[n + 2])
    read_as_bool = as_bool is not None and bool(host[n + 3])
    refuse_nan_inf(found, mask4.dtype, mask4.shape)
    reason = unpackable_reason({k: v for k, v in found.items() if k != "not_padding"})
    if reason is not None:
        return VarlenPlan(batch_size=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, packable=False,
                          reason=reason, device=mask4.device, read_as_bool=read_as_bool)
    if found["not_padding"]:
        return _build(mask4, batch, seqlen_q, seqlen_k, None, "torch", as_bool is not None)
    if any_dead:
        valid_q, valid_k = valid_q | dead[:, None], valid_k | dead[:, None]
    return _padding_plan(batch, seqlen_q, seqlen_k, None if all_q else padding_side(valid_q), padding_side(valid_k),
                         dead if any_dead else None, read_as_bool, aligned)


def is_key_padding(mask4: torch.Tensor) -> bool:
    """A ``[B|1, H|1, Sq|1, Sk]`` mask is a boolean key-padding mask: every query of an element,
    in every head, keeps the same keys (read from its dtype and shape, known while tracing)."""
    return mask4.dtype == torch.bool and mask4.shape[1] == 1 and mask4.shape[2] == 1
