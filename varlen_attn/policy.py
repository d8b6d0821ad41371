"""What the caller asked for (:class:`Policy`) and the plan one attention call runs with
(:func:`resolve_plan`).

Every path that needs a plan asks :func:`resolve_plan`: the functional entries, enabled models
and processors (through them) and the custom op that runs under ``torch.compile``. A plan is
built from the call's own mask (:func:`varlen_attn.plan.call_plan`), or is the one the caller
passed: nothing is looked up by a mask's identity or history, so no write to a mask, anywhere,
can make a call run with another mask's plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._errors import InputTypeError, InputValueError, check_bool, warn_once
from .kernels import SDPA, requested_backend
from .plan import VarlenPlan, call_plan, full_plan


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


def resolve_plan(mask4: torch.Tensor | None, *, batch: int, seqlen_q: int, seqlen_k: int, device: torch.device,
                 policy: Policy, plan: VarlenPlan | None = None, host: bool = False) -> VarlenPlan | None:
    """The plan an attention call runs with, or None for a call without a mask that runs plain
    SDPA (:attr:`Policy.unmasked_is_sdpa`): the caller's ``plan``; for no mask, None or the
    all-valid plan; else the plan of the call's mask ``mask4`` (its ``[B|1, H|1, Sq|1, Sk]``
    view), built now (:func:`~varlen_attn.plan.call_plan`). A float 0/1 mask is read as boolean
    when ``policy.float_mask`` is ``"bool"`` (one warning per process) and refused under
    ``"error"``; ``"bias"`` keeps SDPA's reading. ``host``: segment lengths on the host
    (:func:`~varlen_attn.plan.call_plan`)."""
    if plan is not None:
        return plan
    if mask4 is None:
        return None if policy.unmasked_is_sdpa else full_plan(batch, seqlen_q, seqlen_k, device)
    found = call_plan(mask4, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                      float01_as_bool=policy.float_mask != "bias", host=host)
    if found.read_as_bool:
        float_mask_read_as_bool(policy.float_mask, mask_info(mask4.dtype, mask4.shape))
    return found


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

