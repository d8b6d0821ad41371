"""What the caller asked for (:class:`Policy`), and how a float 0/1 mask read as boolean is told
(:func:`float_mask_read_as_bool`)."""

from __future__ import annotations

from dataclasses import dataclass

from ._errors import InputTypeError, InputValueError, check_bool, warn_once
from .kernels import SDPA, requested_backend


FLOAT_POLICIES = ("bool", "bias", "error")


@dataclass(frozen=True)
class Policy:
    """What the caller asked for; see :func:`varlen_attn.enable_varlen` for the meanings.

    ``backend`` is already resolved (the argument, else ``$VARLEN_ATTN_BACKEND``, else
    ``"auto"``): ``"auto"``, ``"sdpa"`` or a varlen backend name. ``model`` is True for the
    policy of an enabled model or processor, whose ``backend`` and ``strict`` are about its
    masked attention: there a call without a mask always runs stock SDPA.
    """

    backend: str = "auto"
    strict: bool = False
    float_mask: str = "bias"
    model: bool = False
    # Compiled code of an enabled model: a key-padding mask's attention runs in the graph itself
    # (varlen_attn.op, "In the graph").
    in_graph: bool = False

    @classmethod
    def of(cls, backend: str | None = None, strict: bool = False, float_mask: str = "bias",
           model: bool = False, in_graph: bool = False) -> "Policy":
        """Validate the arguments and resolve the backend name."""
        if float_mask not in FLOAT_POLICIES:
            raise InputValueError(f"float_mask must be one of {FLOAT_POLICIES}, got {float_mask!r}")
        check_bool("strict", strict)
        return cls(requested_backend(backend), strict, float_mask, model, in_graph)

    @property
    def unmasked_is_sdpa(self) -> bool:
        """A call without a mask runs plain SDPA (already the fastest kernel) instead of a
        varlen backend over one all-valid plan: always inside a model, and for the functional
        entries unless a varlen backend or ``strict`` was asked for."""
        return self.model or (self.backend in ("auto", SDPA) and not self.strict)


def mask_info(dtype, shape) -> str:
    """How errors name a mask: ``"dtype torch.float32, shape (3, 1, 12, 12)"``."""
    return f"dtype {dtype}, shape {tuple(shape)}"


def float_mask_read_as_bool(policy: str, info: str) -> None:
    """A float 0/1 mask (``info``: :func:`mask_info`) was read as boolean: raise under
    ``float_mask="error"``, else warn once."""
    if policy == "error":
        raise InputTypeError(
            f"a float 0/1 attention mask ({info}) reached "
            f"attention and float_mask='error'; pass a bool mask (True = keep), or choose "
            f"float_mask='bool' (read as keep-mask) or 'bias' (SDPA's additive reading)"
        )
    warn_once("float01", "varlen_attn: a float 0/1 attention mask reached attention (Chroma's pipeline "
              "passes one); reading it as boolean (1 = keep), as the pipeline means it, not as SDPA's "
              "additive bias. float_mask='bias' keeps the stock reading.")

