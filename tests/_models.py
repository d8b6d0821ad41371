"""Tiny random-initialised diffusers models and their inputs, shared by the model tests.

Each factory seeds torch's global generator itself (``seed``), so a model is the same wherever
it is built; ``dtype``/``device`` move it after initialisation (the weights are drawn in float32
on the CPU, then converted, so a float64 CPU model and a bf16 GPU model share their weights up
to rounding). Input builders draw from their own ``torch.Generator`` in float64 on the CPU, then
convert floating tensors to ``dtype``/``device``.

The configs are deliberately tiny (two heads of 8 or 16, one or two blocks of each kind): a
forward and backward takes milliseconds on the CPU and still goes through every attention path
of the real model (joint text+image rows, token refiners, cross-attention, checkpointing).
"""

from __future__ import annotations


import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="the diffusers extra is not installed")

F64 = torch.float64


def _on(t: torch.Tensor, dtype, device) -> torch.Tensor:
    return t.to(device, dtype) if t.is_floating_point() else t.to(device)


def _model(cls, seed, dtype, device, **config):
    torch.manual_seed(seed)
    return cls(**config).to(device, dtype)


def loss(out: torch.Tensor) -> torch.Tensor:
    """The loss every model test differentiates: its upstream gradient ``2 out + 1`` is dense and
    nowhere zero, so every parameter that influences the output gets a gradient."""
    return out.pow(2).sum() + out.sum()


def step(model, inputs: dict):
    """``(output, {parameter name: gradient})`` of one forward and backward under :func:`loss`;
    ``model`` may be compiled or wrapped. Gradients are reset (to None) first."""
    model.zero_grad(set_to_none=True)
    out = model(**{"return_dict": False, **inputs})[0]
    loss(out).backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def own_names(result):
    """A :func:`step` result with the names of a compiled model's parameters as the model's own
    (torch.compile's wrapper prefixes them with ``_orig_mod.``)."""
    return result[0], {n.replace("_orig_mod.", ""): g for n, g in result[1].items()}


# ------------------------------------------------------------------------------------------------
# Chroma: joint [text; image] sequence, outer-product mask re-derived in every block.

CHROMA_B, CHROMA_T, CHROMA_N = 3, 7, 16  # batch, padded text length, image tokens
CHROMA_ATTN_LAYERS = 4  # two double-stream and two single-stream blocks


def stock_and_enabled(stock, checkpointing: bool = False):
    """``(stock, an enabled deep copy of it)``, both with gradient checkpointing where asked."""
    import copy

    import varlen_attn as va

    model = va.enable_varlen(copy.deepcopy(stock))
    if checkpointing:
        stock.enable_gradient_checkpointing()
        model.enable_gradient_checkpointing()
    return stock, model


def tiny_chroma(seed=0, dtype=F64, device="cpu"):
    return _model(diffusers.ChromaTransformer2DModel, seed, dtype, device,
                  patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 4, 8),
                  approximator_num_channels=8, approximator_hidden_dim=16, approximator_layers=1)


def chroma_inputs(lengths=(5, 2, 0), seed=1, mask_dtype=torch.bool, with_mask=True, dtype=F64, device="cpu"):
    """Text lengths per sample (right padded to CHROMA_T), then CHROMA_N image tokens; the mask is
    ``[B, T + N]`` (text first) in ``mask_dtype``."""
    b, t, n = CHROMA_B, CHROMA_T, CHROMA_N
    g = torch.Generator().manual_seed(seed)
    text = torch.arange(t)[None] < torch.tensor(lengths)[:, None]
    mask = torch.cat([text, torch.ones(b, n, dtype=torch.bool)], 1).to(mask_dtype)
    inputs = {"hidden_states": torch.randn(b, n, 4, generator=g, dtype=F64),
              "encoder_hidden_states": torch.randn(b, t, 32, generator=g, dtype=F64),
              "timestep": torch.rand(b, generator=g, dtype=F64),
              "img_ids": torch.randn(n, 3, generator=g, dtype=F64),
              "txt_ids": torch.zeros(t, 3, dtype=F64)}
    inputs = {k: _on(v, dtype, device) for k, v in inputs.items()}
    inputs["attention_mask"] = mask.to(device) if with_mask else None
    inputs["return_dict"] = False
    return inputs


# ------------------------------------------------------------------------------------------------
# Qwen-Image and Flux: joint [text; image] rows with the text padding in the middle.

QF_B, QF_T = 3, 7  # batch, padded prompt length
QF_H, QF_W = 4, 5
QF_N = QF_H * QF_W  # image tokens
QWEN_ATTN_LAYERS = 2  # two double-stream blocks
FLUX_ATTN_LAYERS = 2  # one double-stream block, one single-stream block


def qwen_model(seed=0, dtype=F64, device="cpu"):
    return _model(diffusers.QwenImageTransformer2DModel, seed, dtype, device,
                  patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))


def flux_model(seed=0, dtype=F64, device="cpu"):
    return _model(diffusers.FluxTransformer2DModel, seed, dtype, device,
                  patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=8,
                  axes_dims_rope=(4, 6, 6))


def qwen_flux_inputs(seed=1, dtype=F64, device="cpu") -> dict:
    """The batch both models share (Qwen ignores ``pooled_projections``); no mask, no ids."""
    b, t, n = QF_B, QF_T, QF_N
    g = torch.Generator().manual_seed(seed)
    inputs = {
        "hidden_states": torch.randn(b, n, 4, generator=g, dtype=F64),
        "encoder_hidden_states": torch.randn(b, t, 32, generator=g, dtype=F64),
        "pooled_projections": torch.randn(b, 8, generator=g, dtype=F64),
        "timestep": torch.tensor([0.1, 0.5, 0.9], dtype=F64),
    }
    return {k: _on(v, dtype, device) for k, v in inputs.items()}


def flux_ids(text_len=QF_T, dtype=F64, device="cpu"):
    """``(txt_ids [text_len, 3], img_ids [N, 3])`` for Flux's rotary embedding."""
    txt = torch.zeros(text_len, 3, dtype=F64)
    img = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(float(QF_H)), torch.arange(float(QF_W)),
                                     indexing="ij"), -1).reshape(-1, 3).double()
    return _on(txt, dtype, device), _on(img, dtype, device)


def prefix_keep(lens, length=QF_T) -> torch.Tensor:
    """[B, length] bool: sample b keeps its first lens[b] tokens."""
    return torch.arange(length)[None, :] < torch.tensor(lens)[:, None]


# ------------------------------------------------------------------------------------------------
# HunyuanVideo: joint [image; text] rows and a token refiner with its own [B, 1, T, T] mask.

HY_T = 6  # padded text length
HY_FRAMES, HY_HEIGHT, HY_WIDTH = 2, 3, 4  # patch size 1: 24 image tokens
HY_TEXT_DIM, HY_POOLED_DIM, HY_CHANNELS = 16, 8, 4


def hunyuan_model(num_refiner_layers=1, num_layers=1, seed=0, dtype=F64, device="cpu"):
    return _model(diffusers.HunyuanVideoTransformer3DModel, seed, dtype, device,
                  in_channels=HY_CHANNELS, out_channels=HY_CHANNELS, num_attention_heads=2,
                  attention_head_dim=16, num_layers=num_layers, num_single_layers=num_layers,
                  num_refiner_layers=num_refiner_layers, patch_size=1, patch_size_t=1, guidance_embeds=True,
                  text_embed_dim=HY_TEXT_DIM, pooled_projection_dim=HY_POOLED_DIM, rope_axes_dim=(4, 6, 6))


def hunyuan_inputs(batch: int, seed: int = 0, dtype=F64, device="cpu") -> dict:
    """Everything but ``encoder_attention_mask``."""
    g = torch.Generator().manual_seed(seed)
    inputs = {
        "hidden_states": torch.randn(batch, HY_CHANNELS, HY_FRAMES, HY_HEIGHT, HY_WIDTH, generator=g,
                                     dtype=F64),
        "timestep": torch.randint(0, 1000, (batch,), generator=g),
        "encoder_hidden_states": torch.randn(batch, HY_T, HY_TEXT_DIM, generator=g, dtype=F64),
        "pooled_projections": torch.randn(batch, HY_POOLED_DIM, generator=g, dtype=F64),
        "guidance": torch.full((batch,), 6000.0, dtype=F64),
    }
    return {k: _on(v, dtype, device) for k, v in inputs.items()}


def hunyuan_text_mask(rows) -> torch.Tensor:
    """[B, HY_T] bool; ``rows``: per sample, a prompt length (right padded) or an explicit 0/1 list."""
    return torch.stack([torch.arange(HY_T) < r if isinstance(r, int) else torch.tensor(r, dtype=torch.bool)
                        for r in rows])


# ------------------------------------------------------------------------------------------------
# Sana and PixArt: text cross-attention through legacy processors (-10000 additive masks).

SP_B, SP_T, SP_CAPTION = 3, 6, 12  # batch, padded text length, caption channels
SP_LAYERS = 2


def sana_model(seed=0, dtype=F64, device="cpu"):
    return _model(diffusers.SanaTransformer2DModel, seed, dtype, device,
                  in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                  num_layers=SP_LAYERS, num_cross_attention_heads=2, cross_attention_head_dim=8,
                  cross_attention_dim=16, caption_channels=SP_CAPTION, sample_size=4, patch_size=1)


def pixart_model(seed=1, dtype=F64, device="cpu"):
    return _model(diffusers.PixArtTransformer2DModel, seed, dtype, device,
                  num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
                  num_layers=SP_LAYERS, cross_attention_dim=16, sample_size=8, patch_size=2,
                  num_embeds_ada_norm=8, use_additional_conditions=False, caption_channels=SP_CAPTION)


SANA_LATENT = (SP_B, 4, 4, 4)
PIXART_LATENT = (SP_B, 4, 8, 8)  # patch 2: 16 image tokens


def sana_pixart_inputs(latent_shape, seed=42, timestep=(10, 500, 999), generator=None, dtype=F64,
                       device="cpu") -> dict:
    """Latents and caption embeddings (no mask). ``generator`` continues an existing stream
    instead of seeding a new one."""
    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    inputs = {
        "hidden_states": torch.randn(latent_shape, generator=g, dtype=F64),
        "encoder_hidden_states": torch.randn(SP_B, SP_T, SP_CAPTION, generator=g, dtype=F64),
        "timestep": torch.tensor(timestep),
    }
    return {k: _on(v, dtype, device) for k, v in inputs.items()}
