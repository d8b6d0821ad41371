"""Training steps of one variant in a loop, for a sampling profiler of the host (not a test):

    py-spy record -r 200 -f raw --threads -o stock.txt -- python benchmarks/host_profile.py --variant stock --model qwen --px 512 --layers 20
    py-spy record ... -- python benchmarks/host_profile.py --variant varlen:auto ...

``train_step.py``'s workload (its arguments), one variant per process, ``--seconds`` of steps
after a warm-up; a full garbage collection before each step, as there. Compare the samples of
two variants per function (the steps' stacks only) to see where a variant's host time goes.

Where no sampling profiler is installed (the device machine), ``--cprofile FILE`` profiles the
timed steps with cProfile instead and writes its stats to FILE (``pstats``). The backward then
runs on the main thread (``torch.autograd.set_multithreading_enabled(False)``): cProfile sees
one thread only, and the backward (with checkpointing: the recomputed forwards) would be
missing. cProfile's own cost inflates every Python call; compare functions, not totals.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import sys
import time

import torch

import train_step as T


def main():
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--variant", default="stock", help="stock, nomask or varlen:<backend>")
    own.add_argument("--seconds", type=float, default=20.0)
    own.add_argument("--cprofile", default=None, help="write cProfile stats of the timed steps here")
    mine, rest = own.parse_known_args()
    variant, seconds, prof = mine.variant, mine.seconds, None
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
    if mine.cprofile:
        torch.autograd.set_multithreading_enabled(False)  # the backward on this thread, profiled
        prof = cProfile.Profile()
    for _ in range(3):
        v.step(batch)
    if prof is not None:
        prof.enable()
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        gc.collect()
        v.step(batch)
        steps += 1
    if dev.type == "cuda":
        torch.cuda.synchronize()
    if prof is not None:
        prof.disable()
        prof.dump_stats(mine.cprofile)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    print(f"{variant}: {steps} steps, {(time.perf_counter() - t0) / steps * 1e3:.1f} ms per step (gc included)")


if __name__ == "__main__":
    main()
