"""Masks in, meaning out: read an attention mask as a set of packed segments, on the device.

:func:`analyze` gives ``seg_q[b, i]`` / ``seg_k[b, j]`` (segment id = position of its first key,
-1 for a query attending nothing / a key no query attends) such that ``keep[b, h, i, j] ==
(seg_q[b, i] == seg_k[b, j] >= 0)``: what a varlen kernel computes. No host sync: packability
comes back as device flags. A float mask keeps the keys at its row maximum and drops those at
least :data:`DROP_GAP` below (exp(-1000) underflows to zero); anything between is a bias (not
packable), as is a row swamped by :data:`SWAMP`. Bool masks: True keeps. docs/design.md has more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._errors import InputTypeError, InputValueError, describe

DROP_GAP = 1000.0
"""A float mask value this far below its row's maximum drops the key (exp(-1000) == 0.0)."""

# Order of the device flags that decide packability; the plan layer turns them into reasons.
FLAG_NAMES = ("nan", "posinf", "bias", "per_head", "swamped", "structure")

SWAMP = 1e5
"""A row whose kept keys carry this much below zero or more (``finfo.min`` on a row with no valid
key): SDPA adds the value to the scores, and its rounding there (float32: 0.004 at 1e5, the whole
score at ``finfo.min``, a uniform row) is no softmax a varlen kernel computes."""


@dataclass(frozen=True, eq=False)
class MaskAnalysis:
    """Device-side reading of a mask; see the module docstring. No field has been synced."""

    seg_q: torch.Tensor  # [B, Sq] int64, -1 = query attends nothing
    seg_k: torch.Tensor  # [B, Sk] int64, -1 = key attended by no query
    flags: torch.Tensor  # [len(FLAG_NAMES)] int64, in FLAG_NAMES order


def canonical_mask(
    attn_mask: torch.Tensor,
    *,
    batch_size: int,
    num_heads: int | None,
    seqlen_q: int,
    seqlen_k: int,
    convention: str = "model",
) -> torch.Tensor:
    """View ``attn_mask`` as ``[B|1, H|1, Sq|1, Sk]`` without copying.

    ``convention="torch"`` broadcasts exactly as ``F.scaled_dot_product_attention`` does (a 2-D
    mask is ``[Sq, Sk]``). ``convention="model"`` reads the layouts models hand around, batch
    first: ``[Sk]``, ``[B, Sk]``, ``[B, 1|Sq, Sk]``, ``[B*H, 1|Sq, Sk]`` (diffusers'
    ``prepare_attention_mask``, needs ``num_heads``) and ``[B, 1|H, 1|Sq, Sk]``.
    """
    if not isinstance(attn_mask, torch.Tensor):
        raise InputTypeError(f"attn_mask must be a torch.Tensor or None, got {describe(attn_mask)}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise InputTypeError(
            f"attn_mask must be bool (True = keep) or floating point (added to the scores), "
            f"got dtype {attn_mask.dtype}"
        )
    heads = num_heads if num_heads is not None else 1
    full = (batch_size, heads, seqlen_q, seqlen_k)
    m = attn_mask
    if convention == "torch":
        if m.dim() > 4 or m.dim() == 0:
            raise InputValueError(
                f"attn_mask must have 1 to 4 dims broadcastable to [B, H, Sq, Sk] = {list(full)}, "
                f"got shape {tuple(m.shape)}"
            )
        m = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))
    elif convention == "model":
        if m.dim() == 1:
            m = m.view(1, 1, 1, -1)
        elif m.dim() == 2:
            m = m[:, None, None, :]
        elif m.dim() == 3:
            if num_heads and num_heads > 1 and m.shape[0] == batch_size * num_heads != batch_size:
                m = m.view(batch_size, num_heads, m.shape[1], m.shape[2])
            else:
                m = m[:, None]
        elif m.dim() != 4:
            raise InputValueError(
                f"attn_mask must be [Sk], [B, Sk], [B, Sq, Sk], [B*H, Sq, Sk] or [B, H, Sq, Sk] "
                f"with B={batch_size}, H={num_heads}, Sq={seqlen_q}, Sk={seqlen_k}; "
                f"got shape {tuple(m.shape)}"
            )
    else:
        raise InputValueError(f"convention must be 'torch' or 'model', got {convention!r}")
    for axis, (got, want) in enumerate(zip(m.shape, full)):
        if got != want and got != 1 and not (axis == 1 and num_heads is None):
            raise InputValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                f"[B, H, Sq, Sk] = {list(full)}: dim {axis} is {got}, expected {want} or 1"
            )
    if m.shape[-1] != seqlen_k:
        if m.shape[-1] != 1:
            raise InputValueError(
                f"attn_mask's last dim must be the key length Sk={seqlen_k} (or 1, broadcast), "
                f"got shape {tuple(attn_mask.shape)}"
            )
        m = m.expand(*m.shape[:-1], seqlen_k)  # one value for every key, as SDPA broadcasts it
    return m


def _keep(mask4: torch.Tensor):
    """``(keep [B|1, Sq|1, Sk], nan, posinf, bias, per_head, swamped)``: which keys each query
    keeps (head 0's; see the module docstring) and the device flags that reading found."""
    if mask4.dtype == torch.bool:
        keep = mask4
        nan = posinf = bias = swamped = torch.zeros((), dtype=torch.bool, device=mask4.device)
    else:
        nan = torch.isnan(mask4).any()
        posinf = torch.isposinf(mask4).any()
        row_max = mask4.amax(dim=-1, keepdim=True)
        # -inf row max: every key dropped, SDPA returns a zero row.
        keep = (mask4 == row_max) & (row_max > float("-inf"))
        bias = ((mask4 != row_max) & (mask4 > row_max - DROP_GAP)).any()
        swamped = ((row_max <= -SWAMP) & (row_max > float("-inf"))).any()
    if keep.shape[1] > 1:
        per_head = (keep != keep[:, :1]).any()
    else:
        per_head = torch.zeros((), dtype=torch.bool, device=mask4.device)
    return keep[:, 0], nan, posinf, bias, per_head, swamped


def analyze(mask4: torch.Tensor, *, batch_size: int, seqlen_q: int) -> MaskAnalysis:
    """Read a ``[B|1, H|1, Sq|1, Sk]`` mask as segments (see the module docstring). No sync."""
    keep, nan, posinf, bias, per_head, swamped = _keep(mask4)
    seqlen_k = keep.shape[-1]
    row_any = keep.any(dim=-1)
    # argmax returns the first maximal index: the first kept key of each row is its segment id.
    seg_row = torch.where(row_any, keep.to(torch.uint8).argmax(dim=-1), -1)
    col_any = keep.any(dim=-2)
    first_row = keep.to(torch.uint8).argmax(dim=-2)
    seg_col = torch.where(col_any, seg_row.gather(-1, first_row), -1)
    rebuilt = (seg_row[..., :, None] == seg_col[..., None, :]) & (seg_row[..., :, None] >= 0)
    structure = (rebuilt != keep).any()

    seg_q = seg_row.expand(batch_size, seqlen_q)
    seg_k = seg_col.expand(batch_size, seqlen_k)
    flags = torch.stack([nan, posinf, bias, per_head, swamped, structure]).to(torch.int64)
    return MaskAnalysis(seg_q, seg_k, flags)


# Order of read_padding's device flags: a padding mask raises none.
PADDING_FLAG_NAMES = ("nan", "posinf", "bias", "per_head", "swamped", "not_padding")


def read_padding(mask4: torch.Tensor, *, batch_size: int, seqlen_q: int, seqlen_k: int):
    """Read a ``[B|1, H|1, Sq|1, Sk]`` mask as a *padding* mask: ``(valid_q [B, Sq], valid_k
    [B, Sk], flags)``, bool valid positions and int64 flags in :data:`PADDING_FLAG_NAMES` order.

    A padding mask is the outer product of ``valid_q`` (queries that attend a key) and
    ``valid_k`` (keys some query attends): one segment per element; ``not_padding`` flags any
    other mask. Elementwise work and reductions only, no sync, so a compiler fuses it."""
    keep, nan, posinf, bias, per_head, swamped = _keep(mask4)
    # Dims counted from the front: AOTAutograd's CSE hashes a node's arguments, hash(-1) ==
    # hash(-2) in CPython, and the colliding second reduction was never merged across layers.
    valid_q = keep.any(dim=2)  # [B|1, Sq|1]
    valid_k = keep.any(dim=1)  # [B|1, Sk]
    not_padding = (keep != (valid_q[..., :, None] & valid_k[..., None, :])).any()
    flags = torch.stack([nan, posinf, bias, per_head, swamped, not_padding]).to(torch.int64)
    return valid_q.expand(batch_size, seqlen_q), valid_k.expand(batch_size, seqlen_k), flags


def outer_factors(mask4: torch.Tensor):
    """A boolean ``[B|1, 1, Sq, Sk]`` mask read as the outer product it may be (Chroma's
    ``m[:, None, None, :] * m[:, None, :, None]``): ``(keep_q [B|1, Sq], keep_k [B|1, Sk], bad)``.

    ``keep_q``: the queries that attend a key; ``keep_k``: the keys some query attends, every
    key where none is (no kernel sees an element without keys). ``bad``: a 0-d bool on the
    device, False exactly when the mask equals ``keep_q`` x ``keep_k``; then masked SDPA equals
    SDPA with key padding ``keep_k``, rows multiplied by ``keep_q``. No sync."""
    m = mask4[:, 0]  # dims counted from the front (read_padding says why)
    keep_q, keep_k = m.any(dim=2), m.any(dim=1)
    bad = m.ne(keep_q[:, :, None] & keep_k[:, None, :]).any()
    return keep_q, torch.where(keep_q.any(dim=1, keepdim=True), keep_k, True), bad
