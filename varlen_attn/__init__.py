"""varlen_attn: masked attention run on varlen kernels (valid tokens packed), equal to masked SDPA.

Layers, bottom up (a module imports only from layers below it; docs/design.md):
``masks`` (a mask read as segments) -> ``plan`` (a call's plan, from its own mask) -> ``pack``
(gather/scatter, exact autograd) -> ``kernels`` (varlen backends) -> ``policy`` (what the caller
asked for, and which plan a call runs with) -> ``fused`` -> ``execution`` (one call with its plan:
route and run) -> adapters: ``op`` (torch.compile), ``functional``, ``hook`` (which SDPA calls
are varlen_attn's), ``model`` (enable_varlen), ``processor`` (VarlenAttnProcessor) and
``parallel`` (Ulysses context parallelism), then ``launch`` (``python -m varlen_attn script.py``:
enables every diffusers transformer an unmodified script builds; not imported here). ``padding``
stands beside ``pack``.
"""

from ._errors import (
    BackendUnavailableError,
    InputTypeError,
    InputValueError,
    KernelRefusedError,
    NotPackableError,
    VarlenAttnError,
)
from ._stats import reset_stats, stats
from .functional import attention, scaled_dot_product_attention
from .kernels import available_backends
from .model import disable_varlen, enable_varlen, varlen
from .pack import pack, unpack
from .parallel import shard_sequence, ulysses_attention
from .padding import pad_input, unpad_input
from .plan import VarlenPlan, build_plan, clear_plan_cache, plan_from_seqlens
from .processor import VarlenAttnProcessor

# The one place the version is written: pyproject.toml reads it from here without importing.
__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "InputTypeError",
    "InputValueError",
    "KernelRefusedError",
    "NotPackableError",
    "VarlenAttnError",
    "VarlenAttnProcessor",
    "VarlenPlan",
    "attention",
    "available_backends",
    "build_plan",
    "clear_plan_cache",
    "disable_varlen",
    "enable_varlen",
    "pack",
    "pad_input",
    "plan_from_seqlens",
    "reset_stats",
    "scaled_dot_product_attention",
    "shard_sequence",
    "stats",
    "unpack",
    "ulysses_attention",
    "unpad_input",
    "varlen",
]
