"""``flex``: PyTorch's FlexAttention on the *padded* tensors, with a block mask made once per plan.

No install beyond torch, and no packing: the kernel reads ``[B, S, H, D]`` where it lies and
skips the blocks the plan leaves empty, so a call issues no gather or scatter at all (the packed
backends issue up to ten launches for them per forward and backward, which is what a host-bound
step pays for). The plan's segments become a segment id per padded position (-1 for padding);
a query and a key interact when their ids are equal and not -1. From those ids the block mask's
tables are computed on the device (:func:`block_mask_of`): no dense ``Sq x Sk`` mask and no host
read. Query rows in no segment come out as zeros, as SDPA's rows with no valid key.

On CUDA the kernel is ``torch.compile(flex_attention)``, compiled once per shape and dtype;
FlexAttention has no backward on the CPU, so ``auto`` never picks it there and the backend
declares CUDA only (its forward runs on the CPU for tests: :func:`flex_padded`). Eager callers
only: inside a ``torch.compile`` graph (varlen_attn's custom op) dynamo compiles nothing, so the
backend declares itself unable there and ``auto`` takes the next one.
"""

from __future__ import annotations

import functools
import weakref

import torch

from ..pack import _side
from ._base import Backend, VarlenInputs, inside_compiled_graph

BLOCK = 128  # FlexAttention's default sparse block size


def segment_ids(plan, which: str) -> torch.Tensor:
    """``[B, S]`` int64: the plan's segment of each padded query (``"q"``) or key (``"k"``)
    position, -1 where it is in none. Device ops only (static plans too: no host value read)."""
    _, seqlen, _, inverse, padding = _side(plan, which)
    cu = plan.cu_seqlens_q if which == "q" else plan.cu_seqlens_k
    seg = torch.searchsorted(cu.to(torch.int64), inverse, right=True) - 1
    if padding.dtype == torch.bool:
        seg = seg.masked_fill(padding, -1)
    elif padding.numel():
        seg = seg.index_fill(0, padding, -1)
    return seg.view(plan.batch_size, seqlen)


def _block_stats(seg: torch.Tensor):
    """Per ``BLOCK`` positions of ``seg [B, S]``: (lowest id, highest id, every position valid),
    padding ids (-1) left out; an empty block has lowest > highest."""
    b, s = seg.shape
    n = -(-s // BLOCK)
    blocks = torch.nn.functional.pad(seg, (0, n * BLOCK - s), value=-1).view(b, n, BLOCK)
    valid = blocks >= 0
    big = torch.iinfo(seg.dtype).max
    return (torch.where(valid, blocks, big).amin(-1), blocks.amax(-1), valid.all(-1))


def _ordered(blocks: torch.Tensor):
    """``[B, nq, nk]`` bool -> (count ``[B, 1, nq]``, column indices ``[B, 1, nq, nk]``, the
    marked ones first): a BlockMask's table layout (one head: the mask is the same for all)."""
    count = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count[:, None], order[:, None]


def block_mask_of(seg_q: torch.Tensor, seg_k: torch.Tensor):
    """FlexAttention's ``BlockMask`` for "query and key in the same segment" over padded
    positions with segment ids ``seg_q [B, Sq]``, ``seg_k [B, Sk]``. A block pair is skipped when
    no segment is in both blocks, full (no mask_mod call) when both blocks are one segment with
    no padding, partial otherwise (conservatively: id ranges that overlap)."""
    from torch.nn.attention.flex_attention import BlockMask

    qlo, qhi, qall = _block_stats(seg_q)
    klo, khi, kall = _block_stats(seg_k)
    touch = (qhi[:, :, None] >= klo[:, None, :]) & (khi[:, None, :] >= qlo[:, :, None])
    full = (touch & (qall & (qlo == qhi))[:, :, None] & (kall & (klo == khi))[:, None, :]
            & (qlo[:, :, None] == klo[:, None, :]))
    partial = touch & ~full

    def same_segment(b, h, q_idx, kv_idx):
        sq = seg_q[b, q_idx]
        return (sq == seg_k[b, kv_idx]) & (sq >= 0)

    # The backward's tables (per key block) from the same booleans, transposed: not through
    # BlockMask.from_kv_blocks, whose vmap fails inside a custom op (the compiled path's).
    tables = {}
    for name, blocks in (("", partial), ("full_", full)):
        tables[name + "kv_num_blocks"], tables[name + "kv_indices"] = _ordered(blocks)
        tables[name + "q_num_blocks"], tables[name + "q_indices"] = _ordered(blocks.transpose(1, 2))
    return BlockMask(seq_lengths=(seg_q.shape[1], seg_k.shape[1]), BLOCK_SIZE=(BLOCK, BLOCK),
                     mask_mod=same_segment, **tables)


# plan -> (block mask, query rows in a segment [B, 1, Sq, 1]): made at a plan's first flex call,
# shared by every layer of the forward (and its recomputation), gone with the plan.
_masks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _mask_of(plan):
    entry = _masks.get(plan)
    if entry is None:
        seg_q, seg_k = segment_ids(plan, "q"), segment_ids(plan, "k")
        entry = _masks[plan] = (block_mask_of(seg_q, seg_k), (seg_q >= 0)[:, None, :, None])
    return entry


@functools.lru_cache(maxsize=1)
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention

    # A model's shapes are fixed (one graph each); a second shape makes dynamo compile a graph
    # with symbolic sizes, which serves every later one.
    return torch.compile(flex_attention)


def flex_padded(q, k, v, plan, scale: float, *, compiled: bool = True) -> torch.Tensor:
    """Padded ``[B, S, H, D]`` q, k, v -> ``[B, Sq, Hq, Dv]``: attention within the plan's
    segments, zeros at query positions in none. ``compiled`` False runs FlexAttention's eager
    (reference) implementation, forward only on the CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    block_mask, rows = _mask_of(plan)
    fn = _compiled() if compiled else flex_attention
    gqa = q.shape[2] != k.shape[2]
    out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask, scale=scale,
             enable_gqa=gqa)
    # A query row with no key in any block comes out as whatever the kernel left: zeros, as SDPA.
    return out.masked_fill(~rows, 0).transpose(1, 2)


class FlexBackend(Backend):
    NAME = "flex"
    REQUIRES = ("torch.nn.attention.flex_attention",)
    SUPPORTED_DEVICES = frozenset({"cuda"})  # no FlexAttention backward on the CPU
    SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
    MIN_COMPUTE_CAPABILITY = (8, 0)
    SUPPORTS_CAUSAL = False
    SUPPORTS_DROPOUT = False
    SUPPORTS_DIFFERENT_V_DIM = False
    PADDED = True

    def not_supported_reasons(self, inp: VarlenInputs) -> list[str]:
        reasons = super().not_supported_reasons(inp)
        d = inp.q.shape[-1]
        if d < 16 or d & (d - 1):
            reasons.append(f"head dim {d} is not a power of two >= 16 (FlexAttention's compiled kernel)")
        if inside_compiled_graph():
            # Inside a running compiled graph dynamo does not compile, and FlexAttention's eager
            # implementation fails there (its vmap, below autograd): seen on an H100.
            reasons.append("called from a torch.compile graph, where FlexAttention cannot compile (eager only)")
        return reasons

    def forward_padded(self, q, k, v, plan, scale: float, causal: bool) -> torch.Tensor:
        return flex_padded(q, k, v, plan, scale)
