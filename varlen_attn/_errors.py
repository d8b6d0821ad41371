"""The library's one exception family.

Every error varlen_attn raises on bad input derives from :class:`VarlenAttnError` and from the
built-in type a caller would expect (``ValueError`` or ``TypeError``), so ``except ValueError``
keeps working for code written against ``torch.nn.functional.scaled_dot_product_attention``.
Messages name the argument, what was expected and what was received.
"""

from __future__ import annotations


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
    shape = getattr(x, "shape", None)
    if shape is not None and hasattr(x, "dtype"):
        return f"tensor of shape {tuple(shape)}, dtype {x.dtype}, device {x.device}"
    return f"{type(x).__name__} {x!r}"
