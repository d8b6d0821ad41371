"""Kernel backends and their selection.

``select(inputs, backend)`` walks a priority list per device and returns the first backend
that reports no reason against the inputs; an explicit name either fits or raises one error
listing why, with the input shapes and dtypes. It never falls back silently.
"""

from __future__ import annotations

import functools
import os

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .._errors import BackendUnavailableError, InputValueError
from ._base import TORCH_SDPA, Backend, VarlenInputs
from .flash import FlashAttn2Backend, FlashAttn3Backend, FlashAttn4Backend
from .reference import ReferenceBackend
from .split_sdpa import SplitSdpaBackend
from .torch_varlen import TorchVarlenBackend

BACKENDS: dict[str, Backend] = {
    b.NAME: b
    for b in (FlashAttn4Backend(), FlashAttn3Backend(), FlashAttn2Backend(), TorchVarlenBackend(),
              SplitSdpaBackend(), ReferenceBackend())
}

# Priority for backend="auto", per device class (sources: docs/versions.md, "Why auto's priority
# list is what it is"; measurements: benchmarks/NOTES.md, "Backends").
# sm90+: FA4, FA3, then `torch`, which beat split_sdpa in Chroma steps at 1024 px (H200: 1948
# against 1974 ms; 2053 against 2086 with cuDNN off, NOTES entry 59) though split_sdpa is faster
# per call: its host read a call drains the queue. auto weighs only the first kernel here
# against stock: split_sdpa beat stock's cuDNN in a Qwen-Image 1024 px step (2047 against 2172
# ms) and lost to `torch` in Chroma's; the per-call table cannot see the reads. One order for
# every row length eagerly: FA4 beat `torch` in four of six H100 512 px steps and every 1024 px
# one (docs/versions.md).
# sm80-89: FA2 varlen first (docs/versions.md). CPU: one SDPA per segment beats explicit matmuls.
PRIORITY: dict[str, tuple[str, ...]] = {
    "cpu": ("split_sdpa", "reference"),
    "cuda_sm90": ("flash_attn_4", "flash_attn_3", "torch", "split_sdpa", "flash_attn", "reference"),
    "cuda": ("flash_attn", "torch", "split_sdpa", "reference"),
}


# In compiled blocks' graphs a traced kernel (`torch`) has no Python at run time, FA4's opaque op
# does: at short rows (host-bound) `torch` wins, at long rows FA4. H100 steps, in-graph FA4 /
# `torch` against stock: 1536 keys Chroma 1.00x / 1.06x, Qwen-Image 0.98x / 1.12x; 4608 keys
# Chroma 1.43x / 1.19x (benchmarks/NOTES.md entries 24-26); nothing measured between. A symbolic
# length counts as long (no guard).
TRACED_FIRST_MAX_KEYS = 2048
TRACED_FIRST: dict[str, tuple[str, ...]] = {"cuda_sm90": ("torch",)}


def rows_are_short(seqlen_k) -> bool:
    """Rows of ``seqlen_k`` keys count as short for :func:`in_graph_priority`: known to be at
    most ``TRACED_FIRST_MAX_KEYS`` (read while tracing; a symbolic length counts as long and
    adds no guard)."""
    return statically_known_true(seqlen_k <= TRACED_FIRST_MAX_KEYS)


def in_graph_priority(device: torch.device, short_rows: bool) -> tuple[str, ...]:
    """auto's order for attention in a compiled block's graph: :func:`priority`, with the traced
    kernels of :data:`TRACED_FIRST` moved first where ``short_rows`` (at most
    ``TRACED_FIRST_MAX_KEYS`` keys)."""
    order = priority(device)
    first = TRACED_FIRST.get(_device_class(device), ()) if short_rows else ()
    return first + tuple(n for n in order if n not in first)


@functools.lru_cache(maxsize=None)
def _cuda_class(index: int) -> str:
    return "cuda_sm90" if torch.cuda.get_device_capability(index) >= (9, 0) else "cuda"


def _device_class(device: torch.device) -> str | None:
    """The key of ``device`` in :data:`PRIORITY` (None: CUDA absent, or a type not listed)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        return _cuda_class(device.index if device.index is not None else torch.cuda.current_device())
    return device.type if device.type in PRIORITY else None


def priority(device: torch.device) -> tuple[str, ...]:
    """auto's order for ``device``."""
    cls = _device_class(device)
    if cls is None:
        return () if device.type == "cuda" else tuple(BACKENDS)
    return PRIORITY[cls]

ENV_VAR = "VARLEN_ATTN_BACKEND"
SDPA = "sdpa"  # masked SDPA on the padded tensors; the adapters run it, not a varlen backend


def requested_backend(backend: str | None) -> str:
    """The backend the caller asked for: the argument, else ``$VARLEN_ATTN_BACKEND``, else auto."""
    name = backend if backend is not None else os.environ.get(ENV_VAR, "auto") or "auto"
    if name != "auto" and name != SDPA and name not in BACKENDS:
        source = "backend" if backend is not None else ENV_VAR
        raise InputValueError(
            f"{source} must be 'auto', {SDPA!r} or one of {sorted(BACKENDS)}, got {name!r}"
        )
    return name


def select(inp: VarlenInputs, name: str, order: tuple[str, ...] | None = None) -> Backend:
    """The backend that runs ``inp``: ``name`` itself, or for ``"auto"`` the first that fits, in
    ``order`` (default: :func:`priority` of the device)."""
    if name != "auto":
        reasons = BACKENDS[name].not_supported_reasons(inp)
        if reasons:
            raise BackendUnavailableError(
                f"backend {name!r} cannot run {inp.describe()}: " + "; ".join(reasons)
            )
        return BACKENDS[name]
    why = {}
    for candidate in priority(inp.q.device) if order is None else order:
        reasons = BACKENDS[candidate].not_supported_reasons(inp)
        if not reasons:
            return BACKENDS[candidate]
        why[candidate] = reasons
    listing = "; ".join(f"{n}: {', '.join(r)}" for n, r in why.items())
    raise BackendUnavailableError(f"no backend can run {inp.describe()} ({listing})")


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Installed backends for a device type, in auto's priority order."""
    device = torch.device(device)
    return [n for n in priority(device)
            if BACKENDS[n].installed() and device.type in BACKENDS[n].SUPPORTED_DEVICES]


__all__ = ["BACKENDS", "PRIORITY", "TORCH_SDPA", "TRACED_FIRST", "TRACED_FIRST_MAX_KEYS", "Backend", "VarlenInputs", "available_backends",
           "in_graph_priority", "priority", "rows_are_short", "select"]
