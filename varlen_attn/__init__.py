"""varlen_attn: masked attention at the speed of unmasked attention, equal to masked SDPA.

Layers, bottom up: ``masks`` (read a mask as segments) -> ``plan`` (once per batch, one sync)
-> ``pack`` (gather/scatter with exact autograd) -> ``kernels`` (varlen backends) ->
``functional`` and ``padding`` (the entries users call).
"""

from ._errors import (
    BackendUnavailableError,
    InputTypeError,
    InputValueError,
    NotPackableError,
    VarlenAttnError,
)
from ._stats import reset_stats, stats
from .functional import attention, scaled_dot_product_attention
from .integration import VarlenAttnProcessor, disable_varlen, enable_varlen, varlen
from .kernels import available_backends
from .pack import pack, unpack
from .padding import pad_input, unpad_input
from .plan import VarlenPlan, build_plan, plan_from_seqlens

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "InputTypeError",
    "InputValueError",
    "NotPackableError",
    "VarlenAttnError",
    "VarlenAttnProcessor",
    "VarlenPlan",
    "attention",
    "available_backends",
    "build_plan",
    "disable_varlen",
    "enable_varlen",
    "pack",
    "pad_input",
    "plan_from_seqlens",
    "reset_stats",
    "scaled_dot_product_attention",
    "stats",
    "unpack",
    "unpad_input",
    "varlen",
]
