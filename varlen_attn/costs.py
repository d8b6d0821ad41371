"""Whether ``auto`` leaves a masked call to stock SDPA or packs it: measured costs, as data.

:func:`decide` answers for one call from its signature only (device, dtype, heads, head dims,
lengths, mask layout, stock's kernel, the kernel packing would take), never from the mask's values,
by reading a table of measured costs: ``costs.json``, or the file ``$VARLEN_ATTN_COSTS`` names
(``python benchmarks/crossovers.py --out FILE``). A table applies to its GPU's name or compute
capability; where none applies, auto packs every packable call. Costs (host + GPU time per call,
the key-padding curves for every layout: :data:`CURVES`) are interpolated log-log, giving one
:func:`crossover` per kind of call: stock below, packing above. docs/performance.md and
benchmarks/NOTES.md entries 50 and 56 have the measurements.
"""

from __future__ import annotations

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
    2.11: cuDNN's attention first where :func:`_cudnn_first`; a mask keeps flash out; then
    memory-efficient, then math): ``"cudnn"``, ``"efficient"``, ``"math"`` or ``"cpu"``. Runs at
    every masked call auto routes: only the switches a program may flip are read here."""
    if device.type != "cuda":
        return device.type
    b = torch.backends.cuda
    if dtype in (torch.float16, torch.bfloat16) and b.cudnn_sdp_enabled() and _cudnn_first(device):
        return "cudnn"
    return "efficient" if b.mem_efficient_sdp_enabled() else "math"


@functools.lru_cache(maxsize=None)
def _cudnn_first(device: torch.device) -> bool:
    """Whether PyTorch puts cuDNN's attention first on ``device``: compute capability 9.0 or 10.0,
    cuDNN >= 9.9, and ``TORCH_CUDNN_SDPA_PREFERRED`` not 0. torch reads that variable once per
    process (``check_prefer_cudnn_attention``, a static in sdp_utils.cpp), and so does this. Read
    at every call with cuDNN's version, they cost 3.8 us a call on the development CPU (0.8 us for
    ``stock_kernel`` now), the variable alone 0.9 ms of a 512 px step's main thread under cProfile
    on an H200 (benchmarks/NOTES.md entry 65)."""
    return (os.environ.get("TORCH_CUDNN_SDPA_PREFERRED", "1") != "0"
            and (torch.backends.cudnn.version() or 0) >= 90900
            and _capability(device) in ((9, 0), (10, 0)))


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
    if CURVES not in layouts:
        bad(f"'layouts' must hold {CURVES!r} (auto weighs every call on its curves), got {sorted(layouts)}")
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
    clear()


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


def crossover_tokens(layout: dict, route: str, stock: str) -> float | None:
    """Tokens per sequence below which ``stock``'s curve costs no more than ``route``'s (log-log
    between measured points, held at the ends): 0 where ``route`` is cheaper everywhere,
    ``inf`` where it is never cheaper at the largest point, else the last crossing, where the
    two curves meet on their way to ``route`` staying cheaper. None where a curve is missing."""
    rows = layout["routes"]
    if route not in rows or stock not in rows:
        return None
    xs = [math.log(x) for x in layout["tokens"]]
    diff = [math.log(p) - math.log(c) for p, c in zip(rows[route]["cost"], rows[stock]["cost"])]
    if diff[-1] >= 0:
        return math.inf
    last = max((i for i, d in enumerate(diff) if d >= 0), default=None)
    if last is None:
        return 0.0
    w = diff[last] / (diff[last] - diff[last + 1])
    return math.exp(xs[last] + w * (xs[last + 1] - xs[last]))


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


# cuDNN's attention (9.19, torch 2.11, H200) fails on masks with rows: a non-finite query gradient
# at every S = 64 (mod 128) measured (benchmarks/cudnn_crash_probe.py), illegal memory accesses in
# full-depth Chroma steps (docs/versions.md). Such masks get crossover 0 (kernel_crossover).
def cudnn_rows_fail(kernel: str, layout: str) -> bool:
    """Whether stock's masked SDPA would take cuDNN's attention with a mask that has rows."""
    return kernel == "cudnn" and layout == "outer"


@dataclass(frozen=True)
class Crossover:
    """Where auto leaves calls of one kind to stock: those with fewer than ``tokens`` tokens per
    sequence (``tokens ** 2`` > Sq x Sk), each with its :class:`Decision`."""

    tokens: float
    below: Decision
    above: Decision


# Every call is weighed on the key-padding curves, whatever its mask's layout. A mask with rows
# costs stock's SDPA about what its keys' mask costs on the kernel that takes rows (memory-efficient,
# H200 table: 3.58 against 3.38 ms a call at 1,536 tokens, 23.1 against 22.3 at 4,608); where
# stock's kernel is cuDNN, auto's stock route for it is the keys' mask, then the rows
# (hook._left_to_stock, execution.attend_outer, op._outer_as_keys in compiled blocks); packed, it runs on
# the keys of its outer plan.
# Routed to stock on the kernel that takes rows, a boolean such call goes as it came: the keys'
# mask and rows there cost Chroma 512 px (1,325 tokens, cuDNN off) 722 ms a step against 663
# (stock 645; H200, NOTES entry 56). A float 0/1 mask read as boolean gets the model's boolean
# outer product in its place (stock would read a bias). The table's outer rows stay as measured.
CURVES = "key_padding"


@functools.lru_cache(maxsize=256)
def kernel_crossover(device: torch.device, dtype, kernel: str | None, layout: str, stock: str) -> Crossover:
    """The :class:`Crossover` between stock's SDPA on kernel ``stock`` (:func:`stock_kernel`)
    and packing on backend ``kernel``, for calls of ``dtype`` and mask ``layout`` on ``device``."""
    table = table_for(device, dtype)
    at = None
    if table is None or kernel is None:  # every table has CURVES (_check_table)
        why = f"no cost table for {_gpu_name(device)} ({dtype})"
    else:
        at = crossover_tokens(table["layouts"][CURVES], kernel, f"sdpa:{stock}")
        why = (f"{table['gpu']}'s cost table has no curve for {kernel} or stock SDPA ({stock}), "
               f"{CURVES} masks"
               if at is None else None)
    if at is not None and cudnn_rows_fail(stock, layout):
        at, why = None, "stock's cuDNN attention fails on masks with rows"
    if at is None:
        packed = Decision(False, f"{kernel}: {why}")
        return Crossover(0.0, packed, packed)
    where = f"{round(at) if math.isfinite(at) else at} tokens ({layout} mask, stock on {stock}, {table['gpu']}'s table)"
    return Crossover(at, Decision(True, f"sdpa: cheaper than {kernel} below {where}"),
                     Decision(False, f"{kernel}: cheaper than stock from {where}"))


@functools.lru_cache(maxsize=256)
def crossover(device: torch.device, dtype, hq: int, hk: int, d: int, dv: int, layout: str,
              order: tuple[str, ...] | None, stock: str, epoch: int) -> Crossover:
    """:func:`kernel_crossover` for the kernel auto would pack such calls with (first in ``order``
    that runs them, default :func:`~varlen_attn.kernels.priority`); ``epoch``:
    :func:`~varlen_attn.kernels._base.refusals` (a kernel's refusal changes which kernel that is)."""
    if table_for(device, dtype) is None:  # no kernel probed where no table could weigh it
        return kernel_crossover(device, dtype, "packed", layout, stock)
    kernel = packed_kernel(device, dtype, hq, hk, d, dv, priority(device) if order is None else order)
    return kernel_crossover(device, dtype, kernel, layout, stock)


def clear() -> None:
    """Forget the crossovers worked out (after the tables or auto's priority changed)."""
    crossover.cache_clear()
    kernel_crossover.cache_clear()


def decide(device: torch.device, dtype, hq: int, hk: int, d: int, dv: int, sq: int, sk: int, layout: str,
           order: tuple[str, ...] | None = None) -> Decision:
    """Where auto sends a masked call of this signature (:class:`Decision`): to stock below its
    kind's :func:`crossover`, whose length is the square sequence of the call's work,
    ``sqrt(Sq x Sk)``. The same signature always gets the same answer."""
    c = crossover(device, dtype, hq, hk, d, dv, layout, order, stock_kernel(device, dtype), refusals())
    return c.below if sq * sk < c.tokens * c.tokens else c.above


def layout_of(mask_shape) -> str:
    """A mask's layout from its shape alone: one row of keys per batch element and head
    (``[.., 1, Sk]``, broadcast over queries) is key padding; anything else is an outer layout."""
    return "key_padding" if len(mask_shape) < 2 or mask_shape[-2] == 1 else "outer"
