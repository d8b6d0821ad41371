"""What the check of flash-attn-4 on a GPU where it was not measured costs (FA4's forward and
backward on 64 tokens against float32 math before the first call of each kind of call): the first
training call (forward + backward) of one kind in a fresh process, with the check forced on
(``--check``) or off. Run each way in its own process, alternated, and compare.

    python benchmarks/fa4_check_cost.py [--check] [--heads 24] [--head-dim 128] [--tokens 4608]
"""

from __future__ import annotations

import argparse
import time

import torch

import varlen_attn as va
from varlen_attn.kernels import flash


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=4608)
    args = ap.parse_args()
    flash._FORCE_CHECK = args.check
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    b, s, h, d = 3, args.tokens, args.heads, args.head_dim
    q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    keep = torch.arange(s, device=dev)[None, :] < torch.tensor([[s], [s // 2], [7]], device=dev)
    mask = keep[:, None, None, :]
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = va.scaled_dot_product_attention(q, k, v, mask, backend="flash_attn_4")
        out.sum().backward()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    verdicts = dict(va.kernels.BACKENDS["flash_attn_4"]._verdicts)
    print(f"check {'on ' if args.check else 'off'}: first call {times[0]:8.1f} ms, then {times[1]:.1f}, {times[2]:.1f} ms; "
          f"verdicts {list(verdicts.values())}")


if __name__ == "__main__":
    main()
