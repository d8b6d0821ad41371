"""Host-side (Python) profile of varlen_attn's attention path on a GPU (not a test).

    python benchmarks/host_profile.py [--shape chroma512] [--backend flash_attn_4]
"""

import argparse
import cProfile
import pstats

import torch

import varlen_attn as va
from benchmarks_shapes import make


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="chroma512")
    ap.add_argument("--backend", default="flash_attn_4")
    args = ap.parse_args()
    q, k, v, plan = make(args.shape)

    def step():
        out = va.attention(q, k, v, plan=plan, backend=args.backend)
        out.backward(torch.ones_like(out))

    for _ in range(10):
        step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        step()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
