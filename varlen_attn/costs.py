"""Whether ``auto`` leaves a masked call to stock SDPA or packs it: measured costs, as data.

A masked attention call can run on stock's masked SDPA (no plan, no pack) or packed on a varlen
kernel. Which is faster depends on the GPU, the kernel stock's SDPA takes there (cuDNN's
attention on H100/H200/B200, the memory-efficient kernel on A100 and RTX GPUs or with cuDNN's
off), the mask's layout and the tokens per sequence: on an H200 with cuDNN, stock's masked call
is faster below a few thousand tokens, packing above (``benchmarks/crossovers.py``).

:func:`decide` answers for one call from its signature only (device, dtype, heads,
head dims, lengths, mask layout, compiled or not, the kernel stock would take, the kernel
packing would take), never from the mask's values or from earlier calls, by reading a table of
measured costs: ``costs.json`` in this package, or the file ``$VARLEN_ATTN_COSTS`` names (the
output of ``python benchmarks/crossovers.py --out FILE`` on your GPU). A table applies to the
GPU it was measured on, and to another GPU of the same name or compute capability (an H100
takes the H200's: the same chip and kernels). Where no table applies (the CPU, a GPU class
nobody measured) auto packs every packable call, as it did before routing by cost.

A route's cost is its host time plus its GPU time per call (forward + backward), interpolated
between the measured token counts (log-log) and held at the ends. The packed route's cost is
that of the kernel auto's priority order picks (:func:`varlen_attn.kernels.priority`); if the
table has no curve for it, the call packs.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import os
from dataclasses import dataclass
from importlib import resources

import torch

from ._errors import InputValueError
from .kernels import VarlenInputs, priority, select
from .kernels._base import refusals
from .plan import VarlenPlan

ENV_VAR = "VARLEN_ATTN_COSTS"
FORMAT = 1
LAYOUTS = ("key_padding", "outer")  # the mask's layout: [.., 1, Sk] (one row per batch/head) or [.., Sq, Sk]


@dataclass(frozen=True)
class Decision:
    """Where auto sends a masked call: ``stock`` (masked SDPA) or packed, and why."""

    stock: bool
    reason: str


def stock_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """The kernel PyTorch's SDPA takes for a masked call on ``device`` (its own rule, torch
    2.11: cuDNN's attention first on compute capability 9.0 and 10.0 with cuDNN >= 9.9 unless
    ``TORCH_CUDNN_SDPA_PREFERRED=0``; a mask keeps flash out; then memory-efficient, then math):
    ``"cudnn"``, ``"efficient"``, ``"math"`` or ``"cpu"``."""
    if device.type != "cuda":
        return device.type
    b = torch.backends.cuda
    if (dtype in (torch.float16, torch.bfloat16) and b.cudnn_sdp_enabled()
            and os.environ.get("TORCH_CUDNN_SDPA_PREFERRED", "1") != "0"
            and (torch.backends.cudnn.version() or 0) >= 90900
            and _capability(device) in ((9, 0), (10, 0))):
        return "cudnn"
    return "efficient" if b.mem_efficient_sdp_enabled() else "math"


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device.index if device.index is not None else torch.cuda.current_device())


def _gpu_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device.index if device.index is not None else torch.cuda.current_device())


# ------------------------------------------------------------------------------------ the tables

def _check_table(t: dict, source: str) -> dict:
    """One measured table, validated: every error names the file and the field."""
    def bad(what):
        raise InputValueError(f"cost table {source}: {what}")

    if not isinstance(t.get("gpu"), str):
        bad(f"'gpu' must be a string, got {t.get('gpu')!r}")
    if not isinstance(getattr(torch, str(t.get("dtype")), None), torch.dtype):
        bad(f"'dtype' must name a torch dtype (\"bfloat16\"), got {t.get('dtype')!r}")
    cap = t.get("capability")
    if cap is not None and not (isinstance(cap, list) and len(cap) == 2 and all(isinstance(c, int) for c in cap)):
        bad(f"'capability' must be [major, minor] or null, got {cap!r}")
    layouts = t.get("layouts")
    if not isinstance(layouts, dict) or not layouts:
        bad("'layouts' must map a mask layout to its measurements")
    for name, lay in layouts.items():
        if name not in LAYOUTS:
            bad(f"layout {name!r} is not one of {LAYOUTS}")
        toks = lay.get("tokens")
        if not (isinstance(toks, list) and toks and all(isinstance(x, int) and x > 0 for x in toks)
                and toks == sorted(set(toks))):
            bad(f"layouts.{name}.tokens must be increasing positive ints, got {toks!r}")
        for route, row in lay.get("routes", {}).items():
            cost = row.get("cost") if isinstance(row, dict) else None
            if not (isinstance(cost, list) and len(cost) == len(toks)
                    and all(isinstance(c, (int, float)) and c > 0 for c in cost)):
                bad(f"layouts.{name}.routes.{route}.cost must be {len(toks)} positive numbers (ms), got {cost!r}")
    return t


def load(path: str | None = None) -> list[dict]:
    """The tables of ``path`` (default: ``$VARLEN_ATTN_COSTS``, else the packaged ``costs.json``)."""
    path = path or os.environ.get(ENV_VAR) or None
    source = path or "varlen_attn/costs.json"
    try:
        text = open(path).read() if path else resources.files(__package__).joinpath("costs.json").read_text()
        data = json.loads(text)
    except (OSError, ValueError) as e:
        raise InputValueError(f"cost table {source} ({ENV_VAR}) could not be read: {e}") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("tables"), list):
        raise InputValueError(f"cost table {source}: expected {{'format': {FORMAT}, 'tables': [...]}}")
    return [_check_table(t, source) for t in data["tables"]]


_tables: list = []  # [tables] once loaded (a list: tests swap it)


def tables() -> list[dict]:
    if not _tables:
        _tables.append(load())
    return _tables[0]


def use(path_or_tables: str | list | None) -> None:
    """Read the tables again from ``path_or_tables`` (a file, a list of tables, or None: the
    default): for tests and for a table measured in this process."""
    _tables.clear()
    _tables.append(load(path_or_tables) if not isinstance(path_or_tables, list)
                   else [_check_table(t, "given") for t in path_or_tables])
    _decide.cache_clear()


def table_for(device: torch.device, dtype: torch.dtype) -> dict | None:
    """The table measured on this GPU (by name), else on one of its compute capability, in a
    dtype of this element size (float16 takes bfloat16's: the same kernels at the same speed)."""
    tabs = [t for t in tables() if getattr(torch, t["dtype"]).itemsize == dtype.itemsize]
    name = _gpu_name(device)
    found = [t for t in tabs if t["gpu"] == name]
    if not found and device.type == "cuda":
        cap = list(_capability(device))
        found = [t for t in tabs if t.get("capability") == cap]
    return found[0] if found else None


def cost_at(layout: dict, route: str, tokens: float) -> float | None:
    """``route``'s ms per call at ``tokens`` (log-log between measured points, held at the ends)."""
    row = layout["routes"].get(route)
    if row is None:
        return None
    xs, ys = layout["tokens"], row["cost"]
    i = bisect.bisect_left(xs, tokens)
    if i == 0:
        return ys[0]
    if i == len(xs):
        return ys[-1]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    w = (math.log(tokens) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))


# ------------------------------------------------------------------------------------ the choice

def packed_kernel(device: torch.device, dtype, hq: int, hk: int, d: int, dv: int, order: tuple[str, ...]) -> str | None:
    """The backend auto takes for a call of this kind (first in ``order`` that runs it), or None."""
    q = torch.empty((1, hq, d), dtype=dtype, device=device)
    probe = VarlenPlan(batch_size=1, seqlen_q=1, seqlen_k=1, packable=True, device=device,
                       seqlens_q=(1,), seqlens_k=(1,), max_seqlen_q=1, max_seqlen_k=1, total_q=1, total_k=1)
    try:
        return select(VarlenInputs(q, q.new_empty((1, hk, d)), q.new_empty((1, hk, dv)), probe, d ** -0.5),
                      "auto", order).NAME
    except Exception:  # noqa: BLE001 - no backend runs it: packing raises its own error later
        return None


@functools.lru_cache(maxsize=512)
def _decide(device: torch.device, dtype, hq: int, hk: int, d: int, dv: int, sq: int, sk: int, layout: str,
            order: tuple[str, ...] | None, stock: str, epoch: int) -> Decision:
    table = table_for(device, dtype)
    kernel = packed_kernel(device, dtype, hq, hk, d, dv, priority(device) if order is None else order)
    if table is None or kernel is None or layout not in table["layouts"]:
        return Decision(False, f"{kernel}: no cost table for {_gpu_name(device)} ({dtype}, {layout} masks)")
    lay = table["layouts"][layout]
    tokens = math.sqrt(sq * sk)  # a call's work grows with Sq * Sk: the square sequence of that work
    mine, theirs = cost_at(lay, kernel, tokens), cost_at(lay, f"sdpa:{stock}", tokens)
    if mine is None or theirs is None:
        missing = kernel if mine is None else f"stock SDPA ({stock})"
        return Decision(False, f"{kernel}: {table['gpu']}'s cost table has no {missing} for {layout} masks")
    where = f"{round(tokens)} tokens, {layout} mask, stock on {stock} ({table['gpu']}'s table)"
    if theirs <= mine:
        return Decision(True, f"sdpa: cheaper than {kernel} at {where}")
    return Decision(False, f"{kernel}: cheaper than stock at {where}")


def decide(device: torch.device, dtype, hq: int, hk: int, d: int, dv: int, sq: int, sk: int, layout: str,
           order: tuple[str, ...] | None = None) -> Decision:
    """Where auto sends a masked call of this signature (:class:`Decision`); the same signature
    always gets the same answer (memoised; a kernel's refusal makes the answers be worked out
    again, as it does auto's kernel choice)."""
    return _decide(device, dtype, hq, hk, d, dv, sq, sk, layout, order, stock_kernel(device, dtype), refusals())


def layout_of(mask_shape) -> str:
    """A mask's layout from its shape alone: one row of keys per batch element and head
    (``[.., 1, Sk]``, broadcast over queries) is key padding; anything else is an outer layout."""
    return "key_padding" if len(mask_shape) < 2 or mask_shape[-2] == 1 else "outer"
