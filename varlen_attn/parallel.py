"""Ulysses context parallelism for masked attention, on ``torch.distributed`` only.

Each rank holds a contiguous slice of the sequence (``[B, S_r, H, D]``); :func:`ulysses_attention`
exchanges the slices by all-to-all so each rank holds the whole sequence for ``H / P`` heads, runs
:func:`varlen_attn.attention` with the full mask (the single-process plan, unchanged), and
exchanges back. Uneven lengths use split sizes (:func:`shard_sequence`'s convention, that of
``torch.tensor_split``). docs/multi_gpu.md ("Ulysses context parallelism") has the story.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ._errors import InputTypeError, InputValueError, describe
from .functional import _check_qkv, attention
from .plan import VarlenPlan


def shard_sizes(seq_len: int, world_size: int) -> list[int]:
    """Tokens per rank for a sequence of ``seq_len`` split over ``world_size`` ranks: the sizes
    of ``torch.tensor_split`` (the first ``seq_len % world_size`` ranks hold one more)."""
    base, extra = divmod(seq_len, world_size)
    return [base + (r < extra) for r in range(world_size)]


def _group_info(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise InputValueError(
            f"group: ulysses_attention needs an initialized torch.distributed process group, got "
            f"group={group!r} with torch.distributed {'not initialized' if dist.is_available() else 'unavailable'}")
    return dist.get_rank(group), dist.get_world_size(group)


def shard_sequence(x: torch.Tensor, *, group=None, dim: int = 1) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (default: the sequence dim of ``[B, S, ...]``),
    in the convention :func:`ulysses_attention` expects (``torch.tensor_split`` in rank order)."""
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"x must be a torch.Tensor, got {describe(x)}")
    rank, world = _group_info(group)
    return torch.tensor_split(x, world, dim=dim)[rank]


class _AllToAll(torch.autograd.Function):
    """All-to-all along dim 0 with split sizes, differentiable (the gradient goes back with the
    sizes swapped). The functional collective, waited for at once: a plain tensor eagerly (some
    kernels cannot take an ``AsyncCollectiveTensor``), traced as is by torch.compile."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        pg = dist.group.WORLD if group is None else group
        return funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), recv, send, pg))

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _seq_to_heads(xs: list[torch.Tensor], sizes: list[int], world: int, group) -> list[torch.Tensor]:
    """``[B, S_r, H_i, D_i]`` (this rank's tokens, all heads) -> ``[B, S, H_i/P, D_i]`` (all tokens,
    this rank's head group), for tensors of one batch, length and dtype in one exchange (one copy
    into the send buffer; the results are views of the received one)."""
    b, s = xs[0].shape[:2]
    heads = [(x.shape[2] // world, x.shape[3]) for x in xs]
    send = torch.cat([x.reshape(b, s, world, h, d).permute(2, 1, 0, 3, 4).flatten(3)
                      for x, (h, d) in zip(xs, heads)], dim=3)
    out = _AllToAll.apply(send.reshape(world * s, b, -1), [s] * world, sizes, group)
    # split, not slicing: its gradient is one cat into the buffer sent back
    parts = out.split([h * d for h, d in heads], dim=2)
    return [y.unflatten(2, hd).permute(1, 0, 2, 3) for y, hd in zip(parts, heads)]


def _heads_to_seq(x: torch.Tensor, sizes: list[int], rank: int, world: int, group) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads` for one tensor: ``[B, S, H/P, D]`` -> ``[B, S_r, H, D]``."""
    b, _, h, d = x.shape
    s = sizes[rank]
    out = _AllToAll.apply(x.permute(1, 0, 2, 3), sizes, [s] * world, group)  # [P * S_r, B, H/P, D]
    return out.reshape(world, s, b, h, d).permute(2, 1, 0, 3, 4).reshape(b, s, world * h, d)


def _full_length(name: str, local: int, hint: int | None, hint_name: str, rank: int, world: int) -> int:
    """The full sequence length behind a local slice: ``hint`` (from the plan or the mask) when
    known, checked against the sharding convention; else ``P * local`` (even shards)."""
    if hint is None:
        return local * world
    expected = shard_sizes(hint, world)[rank]
    if local != expected:
        raise InputValueError(
            f"{name}: rank {rank} of {world} must hold {expected} of the {hint} tokens given by "
            f"{hint_name} (split as torch.tensor_split / shard_sequence), got {local}")
    return hint


def _local_heads(mask, batch: int, heads: int, rank: int, world: int):
    """A mask with a head dim of all ``heads`` -> this rank's head group. Other masks hold for
    every head and are used as given."""
    if mask is None or heads == 1 or not isinstance(mask, torch.Tensor):
        return mask
    h = heads // world
    if mask.dim() == 4 and mask.shape[1] == heads:
        return mask[:, rank * h:(rank + 1) * h]
    if mask.dim() == 3 and mask.shape[0] == batch * heads and batch * heads != batch:
        # diffusers' prepared [B*H, Sq|1, Sk] layout
        return mask.reshape(batch, heads, *mask.shape[1:])[:, rank * h:(rank + 1) * h]
    return mask


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    group=None,
    plan: VarlenPlan | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    backend: str | None = None,
    strict: bool = False,
) -> torch.Tensor:
    """Masked attention over a sequence split across the ranks of ``group`` (Ulysses).

    Args:
        query: ``[B, Sq_r, Hq, D]``, this rank's slice of the queries; key, value:
            ``[B, Sk_r, Hkv, D|Dv]``. Slices in the convention of :func:`shard_sequence`.
            ``Hq`` and ``Hkv`` must be divisible by the group's size.
        attn_mask: the mask of the **whole** sequence, the same on every rank, in any layout
            :func:`varlen_attn.attention` accepts (``[B, Sk]`` key padding, ``[B, 1, Sq, Sk]``,
            ...). A mask with a head dim of all ``Hq`` heads is cut to this rank's heads.
        group: the process group (default: the world).
        plan: the plan of the whole sequence's mask (``build_plan(mask)``), as for
            :func:`varlen_attn.attention`: built once per batch, reused by every layer.
        dropout_p, is_causal, scale, enable_gqa, backend, strict: as
            :func:`varlen_attn.attention`.

    Returns:
        ``[B, Sq_r, Hq, Dv]``, this rank's slice of the output; equal to the same slice of
        ``varlen_attn.attention`` on the whole sequence. Differentiable in q, k and v.

    Full lengths come from the plan, else from the mask (``Sk`` is its last dim; ``Sq`` is
    ``Sk`` when the local slices are equally long, else the mask's query dim if it has one);
    without either the slices must be even (``S = P * S_r``).
    """
    # attention's checks, on the slices: q, k and v of one batch, dtype and device pack together
    _check_qkv(query, key, value, enable_gqa, "bshd")
    rank, world = _group_info(group)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.shape[2] % world:
            raise InputValueError(
                f"{name} has {t.shape[2]} heads; Ulysses splits heads across the {world} ranks of "
                f"group, so they must be divisible by {world}")
    options = dict(plan=plan, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                   backend=backend, strict=strict)
    if world == 1:
        return attention(query, key, value, attn_mask, **options)
    mask_sq = mask_sk = None
    if isinstance(attn_mask, torch.Tensor) and attn_mask.dim() >= 1:
        mask_sk = attn_mask.shape[-1]
        if attn_mask.dim() >= 3 and attn_mask.shape[-2] > 1:
            mask_sq = attn_mask.shape[-2]
    if plan is not None:
        sk_hint, sk_from = plan.seqlen_k, "plan.seqlen_k"
        sq_hint, sq_from = plan.seqlen_q, "plan.seqlen_q"
    else:
        sk_hint, sk_from = mask_sk, "attn_mask's last dim"
        sq_hint, sq_from = mask_sq, "attn_mask's query dim"
        if sq_hint is None and query.shape[1] == key.shape[1]:
            sq_hint, sq_from = sk_hint, "attn_mask's last dim (self-attention)"
    sk = _full_length("key", key.shape[1], sk_hint, sk_from, rank, world)
    sq = _full_length("query", query.shape[1], sq_hint, sq_from, rank, world)
    q_sizes, k_sizes = shard_sizes(sq, world), shard_sizes(sk, world)
    if sq == sk:  # q, k and v in one exchange (GQA and a different Dv too)
        q, k, v = _seq_to_heads([query, key, value], q_sizes, world, group)
    else:  # cross-attention: q's slices are not k's and v's
        (q,) = _seq_to_heads([query], q_sizes, world, group)
        k, v = _seq_to_heads([key, value], k_sizes, world, group)
    mask = _local_heads(attn_mask, query.shape[0], query.shape[2], rank, world)
    out = attention(q, k, v, mask, **options)
    return _heads_to_seq(out, q_sizes, rank, world, group)
