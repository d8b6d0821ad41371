"""Training steps of one variant in a loop, for a sampling profiler of the host (not a test):

    py-spy record -r 200 -f raw --threads -o stock.txt -- python benchmarks/host_profile.py --variant stock --model qwen --px 512 --layers 20
    py-spy record ... -- python benchmarks/host_profile.py --variant varlen:auto ...

``train_step.py``'s workload (its arguments), one variant per process, ``--seconds`` of steps
after a warm-up; a full garbage collection before each step, as there. Compare the samples of
two variants per function (the steps' stacks only) to see where a variant's host time goes.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch

import train_step as T


def main():
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--variant", default="stock", help="stock, nomask or varlen:<backend>")
    own.add_argument("--seconds", type=float, default=20.0)
    mine, rest = own.parse_known_args()
    variant, seconds = mine.variant, mine.seconds
    sys.argv = [sys.argv[0], *rest]  # the rest is train_step.py's
    args = T.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dev.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    model, cfg = T.build_model(args, dev, dtype)
    T.add_lora(model, args.lora_rank)
    if args.checkpointing == "on":
        model.enable_gradient_checkpointing()
    batch = T.Batch(args, cfg, dev, dtype)
    if variant.startswith("varlen:"):
        T.enable(model, variant.split(":", 1)[1])
    v = T.Variant(variant, model, masked=variant != "nomask", lr=args.lr)
    for _ in range(3):
        v.step(batch)
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        gc.collect()
        v.step(batch)
        steps += 1
    if dev.type == "cuda":
        torch.cuda.synchronize()
    print(f"{variant}: {steps} steps, {(time.perf_counter() - t0) / steps * 1e3:.1f} ms per step (gc included)")


if __name__ == "__main__":
    main()
