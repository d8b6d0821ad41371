"""Shared benchmark inputs: Chroma-like joint batches on the GPU, as [B, S, H, D] bf16 tensors
with an outer-product mask plan (padded queries are zero rows)."""

import torch

import varlen_attn as va

SHAPES = {"chroma1024": (3, 512, 4096, [77, 300, 2]), "chroma512": (3, 512, 1024, [77, 300, 2])}


def make(name, h=24, d=128, dtype=torch.bfloat16):
    b, t, n, lengths = SHAPES[name]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    keep = torch.cat([torch.arange(t, device=dev)[None] < torch.tensor(lengths, device=dev)[:, None],
                      torch.ones(b, n, dtype=torch.bool, device=dev)], 1)
    q, k, v = (torch.randn(b, t + n, h, d, device=dev, dtype=dtype, generator=g).requires_grad_() for _ in range(3))
    plan = va.build_plan(keep[:, None, :, None] & keep[:, None, None, :], convention="torch")
    return q, k, v, plan
