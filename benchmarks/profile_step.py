"""Where a training step's time goes: ``train_step.py``'s workload at reduced depth, each variant
warmed up, then one step under ``torch.profiler``; prints the top ops by self CUDA time and by
self CPU time, and the step's CPU enqueue time against its GPU end. Stock runs first and again
last, so a host that slows over the run is not read as the cost of the variants in between.

    python benchmarks/profile_step.py --px 512 --compile blocks --double 2 --single 4
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import train_step as T

import varlen_attn as va


def main():
    sys.argv += [] if "--rounds" in sys.argv else ["--rounds", "1"]
    args = T.parse_args()
    dev = torch.device("cuda")
    torch.backends.cuda.enable_cudnn_sdp(False)
    T.raise_recompile_limits()
    base, cfg = T.build_model(args, dev, torch.bfloat16)
    T.add_lora(base, args.lora_rank)
    if args.checkpointing == "on":
        base.enable_gradient_checkpointing()
    batch = T.Batch(args, cfg, dev, torch.bfloat16)
    backends = args.backends.split(",") if args.backends else ["auto", "torch"]
    # stock again at the end: a host that slows over the run (order, allocator or heap growth)
    # shows there, not only in the variants that happen to run later.
    for name in ["stock", *(f"varlen:{b}" for b in backends), "stock (again)"]:
        model = T.sharing_copy(base)
        if name.startswith("varlen:"):
            T.enable(model, name.split(":", 1)[1])
        if args.compile == "blocks":
            for block in T.blocks_of(model):
                block.compile(fullgraph=True, mode=args.compile_mode)
        v = T.Variant(name, model, masked=True, lr=args.lr)
        for _ in range(3):
            v.step(batch)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            v.step(batch)
            enq = (time.perf_counter() - t0) * 1e3
            torch.cuda.synchronize()
            end = (time.perf_counter() - t0) * 1e3
        print(f"==== {name}: CPU enqueue {enq:.1f} ms, step ends {end:.1f} ms (profiled)")
        if name.startswith("varlen:"):  # Python time per function inside the attention calls
            import cProfile
            import pstats

            pr = cProfile.Profile()
            pr.enable()
            v.step(batch)
            torch.cuda.synchronize()
            pr.disable()
            st = pstats.Stats(pr)
            st.sort_stats("tottime").print_stats(r"varlen_attn|flash_attn|cute|_library", 30)
            st.sort_stats("cumtime").print_stats(r"varlen_attn|flash_attn|cute", 25)
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
        del v, model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
