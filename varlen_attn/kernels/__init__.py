"""Kernel backends and their selection.

``select(inputs, backend)`` walks a priority list per device and returns the first backend
that reports no reason against the inputs; an explicit name either fits or raises one error
listing why, with the input shapes and dtypes. It never falls back silently.
"""

from __future__ import annotations

import os

import torch

from .._errors import BackendUnavailableError, InputValueError
from ._base import Backend, VarlenInputs
from .reference import ReferenceBackend
from .split_sdpa import SplitSdpaBackend

BACKENDS: dict[str, Backend] = {b.NAME: b for b in (ReferenceBackend(), SplitSdpaBackend())}

# Per-device priority for backend="auto". On the CPU one dense SDPA call per segment beats
# the reference kernel's explicit matmuls; the GPU list is refined by measurement (issue 3).
PRIORITY: dict[str, tuple[str, ...]] = {
    "cpu": ("split_sdpa", "reference"),
    "cuda": ("split_sdpa", "reference"),
}

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
    for candidate in PRIORITY.get(inp.q.device.type, tuple(BACKENDS)):
        reasons = BACKENDS[candidate].not_supported_reasons(inp)
        if not reasons:
            return BACKENDS[candidate]
        why[candidate] = reasons
    listing = "; ".join(f"{n}: {', '.join(r)}" for n, r in why.items())
    raise BackendUnavailableError(f"no backend can run {inp.describe()} ({listing})")


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Installed backends for a device type, in auto's priority order."""
    dev = torch.device(device).type
    order = PRIORITY.get(dev, tuple(BACKENDS))
    return [n for n in order if BACKENDS[n].is_installed() and dev in BACKENDS[n].SUPPORTED_DEVICES]


__all__ = ["BACKENDS", "PRIORITY", "Backend", "VarlenInputs", "available_backends", "select"]
