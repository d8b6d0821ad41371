"""Kernel backends and their selection.

``select(inputs, backend)`` walks a priority list per device and returns the first backend
that reports no reason against the inputs; an explicit name either fits or raises one error
listing why, with the input shapes and dtypes. It never falls back silently.
"""

from __future__ import annotations

import functools
import os

import torch

from .._errors import BackendUnavailableError, InputValueError
from ._base import Backend, VarlenInputs
from .flash import FlashAttn2Backend, FlashAttn3Backend, FlashAttn4Backend
from .reference import ReferenceBackend
from .split_sdpa import SplitSdpaBackend
from .torch_varlen import TorchVarlenBackend

BACKENDS: dict[str, Backend] = {
    b.NAME: b
    for b in (FlashAttn4Backend(), FlashAttn3Backend(), FlashAttn2Backend(), TorchVarlenBackend(),
              SplitSdpaBackend(), ReferenceBackend())
}

# Priority for backend="auto", per device class (measurements and sources: docs/versions.md,
# "Why auto's priority list is what it is").
# Hopper and newer (sm90+): the Hopper-class kernels first (FA4, FA3); then one dense SDPA call
# per segment, which beat FA2-class varlen kernels on an H200 (measured again by
# benchmarks/backends.py); FA2 and PyTorch's built-in FA2 varlen after it.
# Ampere/Ada (sm80-89): FA2 varlen wins there (masked SDPA drops to the mem-efficient kernel;
# public reports listed in docs/versions.md); the built-in FA2 kernel needs no install.
# CPU: one dense SDPA call per segment beats the reference kernel's explicit matmuls.
# Hopper, short rows (every row's longest segment at most SHORT_SEQLEN keys; 512 px joint rows
# are 1536): PyTorch's built-in varlen first. Measured in the LoRA training step
# (benchmarks/train_step.py, Chroma full depth, H100, torch 2.11, FA4 4.0.0b36): at 512 px it
# took 719 ms against FA4's 807 eagerly and 654 against 1092 with every block compiled, while at
# 1024 px (4608 keys) FA4 won eagerly (1861 against 2127) and tied compiled (1744 against 1761).
# The built-in kernel also beat one SDPA call per segment in the step (H200: 1948 against 1974
# ms at 1024 px, 646 against 659 at 512 px), so it comes before split_sdpa in both lists.
SHORT_SEQLEN = 2048
PRIORITY: dict[str, tuple[str, ...]] = {
    "cpu": ("split_sdpa", "reference"),
    "cuda_sm90": ("flash_attn_4", "flash_attn_3", "torch", "split_sdpa", "flash_attn", "reference"),
    "cuda_sm90_short": ("torch", "flash_attn_4", "flash_attn_3", "split_sdpa", "flash_attn", "reference"),
    "cuda": ("flash_attn", "torch", "split_sdpa", "reference"),
}


@functools.lru_cache(maxsize=None)
def _cuda_class(index: int) -> str:
    return "cuda_sm90" if torch.cuda.get_device_capability(index) >= (9, 0) else "cuda"


def priority(device: torch.device, max_seqlen_k: int | None = None) -> tuple[str, ...]:
    """auto's order for ``device`` (and, on Hopper, for rows of ``max_seqlen_k`` keys)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return ()
        idx = device.index if device.index is not None else torch.cuda.current_device()
        cls = _cuda_class(idx)
        if cls == "cuda_sm90" and max_seqlen_k is not None and max_seqlen_k <= SHORT_SEQLEN:
            cls = "cuda_sm90_short"
        return PRIORITY[cls]
    return PRIORITY.get(device.type, tuple(BACKENDS))

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


def select(inp: VarlenInputs, name: str) -> Backend:
    """The backend that runs ``inp``: ``name`` itself, or for ``"auto"`` the first that fits."""
    if name != "auto":
        reasons = BACKENDS[name].not_supported_reasons(inp)
        if reasons:
            raise BackendUnavailableError(
                f"backend {name!r} cannot run {inp.describe()}: " + "; ".join(reasons)
            )
        return BACKENDS[name]
    why = {}
    for candidate in priority(inp.q.device, inp.plan.max_seqlen_k):
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


__all__ = ["BACKENDS", "PRIORITY", "Backend", "VarlenInputs", "available_backends", "priority", "select"]
