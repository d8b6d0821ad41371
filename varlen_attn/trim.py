"""Trim, before a model's forward, the trailing text columns that every sample of the batch masks.

Packing skips padded text only inside attention; linear layers, norms and MLPs still run on it.
Where a model masks its text padding as keys and keeps text tokens apart elsewhere, a column every
sample masks never reaches a kept token, so cutting it changes no kept value. :data:`TEXT_INPUTS`
lists the diffusers transformers where this was read and tested (tests/test_trim.py); Flux and SD3
attend their padding and are not listed. The kept length is rounded up to :data:`BUCKET` (one host
read per forward); a batch where some sample keeps no text column is not trimmed. docs/design.md.
"""

from __future__ import annotations

import inspect

import torch

from . import _stats

# diffusers class name -> (the [B, >= T] keep-mask argument, the arguments holding T text tokens
# along dim -2). A joint mask (Chroma's [B, T + N], text first) loses the same text columns.
TEXT_INPUTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "ChromaTransformer2DModel": ("attention_mask", ("encoder_hidden_states", "txt_ids")),
    "QwenImageTransformer2DModel": ("encoder_hidden_states_mask", ("encoder_hidden_states",)),
    "HunyuanVideoTransformer3DModel": ("encoder_attention_mask", ("encoder_hidden_states",)),
    "SanaTransformer2DModel": ("encoder_attention_mask", ("encoder_hidden_states",)),
    "PixArtTransformer2DModel": ("encoder_attention_mask", ("encoder_hidden_states",)),
    "LTXVideoTransformer3DModel": ("encoder_attention_mask", ("encoder_hidden_states",)),
}

# Kept lengths are rounded up to a multiple of this. Chroma 1024 px LoRA steps on an H200 (FA4,
# prompts of 78/301/3 kept columns of 512; benchmarks/NOTES.md entry 67), faster than trimming off
# by: 1 (301 columns) 3.7%, 8 and 16 (304) 3.5%, 32 and 64 (320) 2.4%; in another process 16
# 3.5%, 64 2.6%, 128 (384) 1.6%. Blocks compiled with dynamic shapes (dynamo's default) compile
# twice whatever the bucket (tests/test_trim.py); with dynamic=False they see up to T / 16 text
# lengths. Lengths off a multiple of 128 are safe for stock's kernels: masks with rows never
# reach cuDNN's attention (varlen_attn.costs.cudnn_rows_fail), and Chroma 512 px's key-padding
# calls at 1,328 tokens ran on it for 41 rounds (entry 67).
BUCKET = 16


_SPECS: dict[type, tuple[str, tuple[str, ...]] | None] = {}


def spec_of(cls: type) -> tuple[str, tuple[str, ...]] | None:
    """The :data:`TEXT_INPUTS` entry of a model class, or of the listed class it inherits its
    ``forward`` from (a subclass that overrides ``forward`` is not listed)."""
    if cls not in _SPECS:
        _SPECS[cls] = next((TEXT_INPUTS[base.__name__] for base in cls.__mro__
                            if base.__name__ in TEXT_INPUTS and cls.forward is base.forward), None)
    return _SPECS[cls]


_PARAM_NAMES: dict[type, tuple[str, ...] | None] = {}


@torch._dynamo.assume_constant_result  # traced: called once while tracing, its result a constant
def param_names(cls) -> tuple[str, ...] | None:
    """The names of a module class's forward parameters (without ``self``), once per class."""
    if cls not in _PARAM_NAMES:
        try:
            _PARAM_NAMES[cls] = tuple(list(inspect.signature(cls.forward).parameters)[1:])
        except (TypeError, ValueError):
            _PARAM_NAMES[cls] = None
    return _PARAM_NAMES[cls]


def kept_length(keep: torch.Tensor) -> int:
    """One past the last column of ``keep`` ([B, T] bool) that some sample keeps; T where some
    sample keeps none. One host transfer."""
    t = keep.shape[1]
    last = (keep.any(0) * torch.arange(1, t + 1, device=keep.device)).amax()
    _stats.record_host_sync()
    return int(torch.where(keep.any(1).all(), last, t))


def trim_text(cls: type, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` of a call of ``cls.forward`` with the trailing text columns every sample
    masks removed, or None where nothing is cut (a class not listed, no 2-D mask, nothing to cut)."""
    spec = spec_of(cls)
    names = param_names(cls) if spec is not None else None
    if names is None:
        return None
    mask_name, text_names = spec
    bound = {**dict(zip(names, args)), **kwargs}
    mask, text = bound.get(mask_name), bound.get(text_names[0])
    if not (isinstance(mask, torch.Tensor) and isinstance(text, torch.Tensor)) or mask.ndim != 2 or text.ndim < 2:
        return None
    t = text.shape[-2]
    # Nothing to cut below one bucket (no read then); a tensor under vmap or grad transforms has
    # no value to read.
    if t <= BUCKET or mask.shape[0] != text.shape[0] or mask.shape[1] < t \
            or torch._C._functorch.is_functorch_wrapped_tensor(mask):
        return None
    n = kept_length(mask[:, :t] != 0)
    n = min(t, -(-n // BUCKET) * BUCKET)
    if n >= t:
        return None
    _stats.record_trim(text.shape[0] * (t - n))
    cut = {mask_name: torch.cat([mask[:, :n], mask[:, t:]], 1)}
    for name in text_names:
        x = bound.get(name)
        if isinstance(x, torch.Tensor) and x.ndim >= 2 and x.shape[-2] == t:
            cut[name] = x.narrow(-2, 0, n)
    args = tuple(cut.get(name, a) for name, a in zip(names, args))
    kwargs = {k: cut.get(k, v) for k, v in kwargs.items()}
    return args, kwargs
