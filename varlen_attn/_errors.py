"""The library's one exception family.

Every error varlen_attn raises on bad input derives from :class:`VarlenAttnError` and from the
built-in type a caller would expect (``ValueError`` or ``TypeError``), so ``except ValueError``
keeps working for code written against ``torch.nn.functional.scaled_dot_product_attention``.
Messages name the argument, what was expected and what was received.
"""

from __future__ import annotations

import logging
import operator

import torch


class VarlenAttnError(Exception):
    """Base class of every error raised by varlen_attn."""


class InputValueError(VarlenAttnError, ValueError):
    """An argument has the right type but a wrong shape, value, device or size."""


class InputTypeError(VarlenAttnError, TypeError):
    """An argument has the wrong type or dtype."""


class NotPackableError(VarlenAttnError, ValueError):
    """``strict=True`` was asked for and the mask cannot be packed (the message says why)."""


class BackendUnavailableError(VarlenAttnError, RuntimeError):
    """An explicitly requested backend cannot run these inputs (the message lists why)."""


class KernelRefusedError(BackendUnavailableError):
    """A kernel library refused a call its backend had declared it could run (its own check
    failed, e.g. flash-attn-4 on a GPU or head dim it does not support). The backend remembers
    the refusal, so selection skips it for calls of that kind from then on; ``auto`` runs the
    refused call on its next backend."""


def describe(x: object) -> str:
    """Short description of a received value for error messages."""
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)}, dtype {x.dtype}, device {x.device}"
    kind = type(x).__name__ if type(x).__module__ == "builtins" else f"{type(x).__module__}.{type(x).__name__}"
    return f"{kind} {x!r}"


# Argument checks shared by every entry, with the conversions torch's own argument parser makes
# for SDPA's ``float``, ``int`` and ``bool`` parameters (numpy scalars and 0-d tensors included).

def check_size(name: str, value: object, minimum: int = 0) -> int:
    """An int (or numpy integer, 0-d integer tensor) >= ``minimum``; not a bool."""
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise InputTypeError(f"{name} must be an int, got {describe(value)}") from None
    if n < minimum:
        raise InputValueError(f"{name} must be >= {minimum}, got {n}")
    return n


def check_bool(name: str, value: object) -> bool:
    """A bool, as SDPA's ``is_causal`` and ``enable_gqa`` take it: not None, 1 or a numpy bool."""
    if isinstance(value, bool):
        return value
    raise InputTypeError(f"{name} must be a bool, got {describe(value)}")


def as_real(name: str, value: object, expected: str = "a float or a 0-d tensor"):
    """A real number as SDPA's ``float`` parameters take it: a Python or numpy int or float, or
    a 0-d real tensor that needs no gradient (read once on the host, as SDPA reads it). Python
    numbers come back as they are (what dynamo traces, symbolic floats included)."""
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and not value.is_complex():
            if value.requires_grad:  # SDPA refuses it too: its float parameters are not differentiable
                raise InputTypeError(f"{name} must not require grad (SDPA takes it as a number), got {describe(value)}")
            return float(value)
    elif (type(value).__module__ == "numpy" and type(value).__name__ != "ndarray"
          and getattr(getattr(value, "dtype", None), "kind", "") in ("b", "i", "u", "f")):  # numpy scalars, bool too
        return float(value)
    raise InputTypeError(f"{name} must be {expected}, got {describe(value)}")


_warned: set[str] = set()


def warn_once(key: str, message: str, *args) -> None:
    """Log ``message % args`` as a warning of the ``varlen_attn`` logger, once per process per
    ``key`` (formatted only then)."""
    if key not in _warned:
        _warned.add(key)
        logging.getLogger("varlen_attn").warning(message, *args)
