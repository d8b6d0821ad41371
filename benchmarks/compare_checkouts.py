"""Time one attention layer (fwd+bwd, a plan built once) with the varlen_attn found first on
sys.path, for side-by-side runs of two checkouts in separate processes:

    PYTHONPATH=<old checkout> python benchmarks/compare_checkouts.py --label before
    PYTHONPATH=$PWD           python benchmarks/compare_checkouts.py --label after

Uses only API both sides have (``build_plan``, ``attention``). Prints ``label shape median_ms``
per shape: the median of ``--reps`` CUDA-event timings of ``--iters`` back-to-back layers.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import varlen_attn as va

SHAPES = {"chroma512": (512, 1024), "chroma1024": (512, 4096)}  # text (padded), image tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", default=va.__file__)
    ap.add_argument("--shapes", default="chroma512,chroma1024")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    dev = torch.device("cuda")
    for name in args.shapes.split(","):
        text, image = SHAPES[name]
        b, h, d = 3, 24, 128
        lens = torch.tensor([77, 300, 2])
        keep = torch.cat([torch.arange(text)[None] < lens[:, None], torch.ones(b, image, dtype=torch.bool)], 1).to(dev)
        mask = keep[:, None, :, None] & keep[:, None, None, :]
        s = text + image
        q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        g = torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16)
        plan = va.build_plan(mask, num_heads=h, convention="torch")

        def layer():
            out = va.attention(q, k, v, mask, plan=plan)
            out.backward(g)

        for _ in range(5):
            layer()
        times = []
        for _ in range(args.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(args.iters):
                layer()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / args.iters)
        print(f"{args.label} {name} {statistics.median(times):.3f} ms fwd+bwd (stats {va.stats()['backends']})")


if __name__ == "__main__":
    main()
