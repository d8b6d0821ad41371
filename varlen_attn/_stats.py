"""Process-wide diagnostics: which backend ran, how often, every fallback and why.

Counters are plain ints behind a lock; reading them never touches a tensor. Each distinct
fallback reason is logged once as a warning (then at DEBUG level), not once per call.
Calls are counted where they run: eagerly, or inside the custom op under ``torch.compile``;
code being traced by dynamo records nothing (a lock cannot be traced).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

import torch

logger = logging.getLogger("varlen_attn")

_lock = threading.Lock()
_backends: Counter[str] = Counter()
_fallbacks: Counter[str] = Counter()
_counts: Counter[str] = Counter()
_routes: Counter[str] = Counter()


_local = threading.local()


class quiet:
    """Within the block, this thread's attention calls are not counted: a backward that
    recomputes a forward (varlen_attn.op) would otherwise count it twice."""

    def __enter__(self):
        _local.quiet = getattr(_local, "quiet", 0) + 1

    def __exit__(self, *exc):
        _local.quiet -= 1
        return False


def _muted() -> bool:
    # Compiling first: traced, the thread-local is not read, so no graph guards on it (a guard on
    # its ``quiet`` recompiled compiled blocks after another model's op backward had set it).
    return torch.compiler.is_compiling() or bool(getattr(_local, "quiet", 0))


def record_backend(name: str) -> None:
    if _muted():
        return
    with _lock:
        _backends[name] += 1
    logger.debug("attention ran on backend %r", name)


def record_fallback(reason: str) -> None:
    if _muted():
        return
    with _lock:
        first = reason not in _fallbacks
        _fallbacks[reason] += 1
    (logger.warning if first else logger.debug)("varlen_attn fell back to masked SDPA: %s", reason)


def record_route(reason: str, backend: str | None = None) -> None:
    """auto chose a call's route by cost (varlen_attn.costs): ``reason`` names it and why;
    ``backend``: the call ran there already (stock's SDPA), counted with it in one step."""
    if _muted():
        return
    with _lock:
        _routes[reason] += 1
        if backend is not None:
            _backends[backend] += 1


def record_plan_build() -> None:
    with _lock:
        _counts["plan_builds"] += 1


def record_trim(tokens: int) -> None:
    """A forward ran with ``tokens`` text tokens (summed over the batch) cut (varlen_attn.trim)."""
    with _lock:
        _counts["text_trims"] += 1
        _counts["trimmed_tokens"] += tokens


def record_host_sync() -> None:
    with _lock:
        _counts["host_syncs"] += 1


def stats() -> dict:
    """Snapshot: ``{"backends": {name: calls}, "fallbacks": {reason: calls},
    "routes": {reason: calls}, "plan_builds": n, "host_syncs": n, "text_trims": n,
    "trimmed_tokens": n}`` since the last :func:`reset_stats`. ``routes`` counts the masked calls
    auto routed by cost, by the route taken and why (:mod:`varlen_attn.costs`); ``text_trims`` the
    forwards whose padded text columns were cut, ``trimmed_tokens`` the tokens cut (summed over
    samples, :mod:`varlen_attn.trim`)."""
    with _lock:
        return {
            "backends": dict(_backends),
            "fallbacks": dict(_fallbacks),
            "routes": dict(_routes),
            "plan_builds": _counts["plan_builds"],
            "host_syncs": _counts["host_syncs"],
            "text_trims": _counts["text_trims"],
            "trimmed_tokens": _counts["trimmed_tokens"],
        }


def reset_stats() -> None:
    """Zero every counter (fallback warnings are shown again afterwards)."""
    with _lock:
        _backends.clear()
        _fallbacks.clear()
        _routes.clear()
        _counts.clear()
