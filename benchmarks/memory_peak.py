"""What is alive at a training step's peak of GPU memory, per variant (not a test; run on a GPU):

    python benchmarks/memory_peak.py --model chroma --px 1024 --double 2 --single 4 [--backends auto]

``train_step.py``'s workload (its arguments) at reduced depth. Each variant (stock, then varlen
with each backend) runs two warm-up steps and one step under
``torch.cuda.memory._record_memory_history``; replaying the trace gives the peak of allocated
bytes over the step's start and the blocks alive at it, grouped by size (a packed tensor, a
padded one, a mask each have theirs). Recorded without stacks: torch 2.11 raised
``SystemError: error return without exception set`` recording Python stacks inside a
checkpoint's recomputation.
"""

from __future__ import annotations

import collections

import torch

import train_step as T

import varlen_attn as va


def peak_of(events) -> tuple[int, collections.Counter]:
    """The peak of bytes allocated over the trace's start, and the sizes alive at it (MiB ->
    bytes), from the allocations and frees the trace records."""
    live, now, peak, peak_at = {}, 0, 0, -1
    for i, ev in enumerate(events):  # the peak's position
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev["size"]
            now += ev["size"]
            if now > peak:
                peak, peak_at = now, i
        elif ev["action"] == "free_requested" and ev["addr"] in live:
            now -= live.pop(ev["addr"])
    live = {}
    for ev in events[:peak_at + 1]:  # what is alive there
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev["size"]
        elif ev["action"] == "free_requested":
            live.pop(ev["addr"], None)
    groups = collections.Counter()
    for size in live.values():
        groups[f"blocks of {size / 2**20:.1f} MiB"] += size
    return peak, groups


def main():
    args = T.parse_args()
    dev = torch.device("cuda")
    torch.backends.cuda.enable_cudnn_sdp(False)
    base, cfg = T.build_model(args, dev, torch.bfloat16)
    T.add_lora(base, args.lora_rank)
    if args.checkpointing == "on":
        base.enable_gradient_checkpointing()
    batch = T.Batch(args, cfg, dev, torch.bfloat16)
    backends = args.backends.split(",") if args.backends else ["auto"]
    results = {}
    names = ["stock", *(f"varlen:{b}" for b in backends)]
    if args.model == "chroma" and args.checkpointing == "on":
        # diffusers leaves Chroma's single blocks without their mask under checkpointing (stock runs
        # them unmasked); enable_varlen gives it back unless restore_checkpoint_mask=False.
        names += [f"varlen:{b} restore_checkpoint_mask=False" for b in backends]
    for name in names:
        model = T.sharing_copy(base)
        if name.startswith("varlen:"):
            spec, _, restore = name.split(":", 1)[1].partition(" ")
            va.enable_varlen(model, backend=spec, restore_checkpoint_mask=not restore)
        v = T.Variant(name, model, masked=True, lr=args.lr)
        for _ in range(2):
            v.step(batch)
        torch.cuda.synchronize()
        base_bytes = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(context=None, max_entries=2_000_000)
        v.step(batch)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        peak, groups = peak_of(snap["device_traces"][0])
        results[name] = groups
        print(f"== {name}: max_memory_allocated {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB; "
              f"allocated before the step {base_bytes / 2**20:.1f} MiB; traced peak over it {peak / 2**20:.1f} MiB")
        for where, size in groups.most_common(12):
            print(f"   {size / 2**20:9.1f} MiB  {where}")
        del v, model
        torch.cuda.empty_cache()
    if len(results) > 1:
        stock = results["stock"]
        for name, groups in results.items():
            if name == "stock":
                continue
            diff = collections.Counter({k: groups.get(k, 0) - stock.get(k, 0) for k in set(groups) | set(stock)})
            print(f"== {name} minus stock at the peak, by block size (MiB):")
            for where, d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:12]:
                if d:
                    print(f"   {d / 2**20:+9.1f}  {where}")


if __name__ == "__main__":
    main()
