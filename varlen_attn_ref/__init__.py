"""Pure-PyTorch reference for flash-attention 2's varlen API.

This package is the project's numerical oracle and its CPU backend. See
:mod:`varlen_attn_ref.varlen` for the exact semantics.
"""

from .varlen import attention_ref, flash_attn_varlen_func, same_segment, varlen_attention_dense

__all__ = ["attention_ref", "flash_attn_varlen_func", "same_segment", "varlen_attention_dense"]
