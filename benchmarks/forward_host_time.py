"""Host time of a model's forward on the CPU, stock against enable_varlen (not a test).

    python benchmarks/forward_host_time.py                 # 60-layer Qwen-Image with LoRA, 150 rounds
    python benchmarks/forward_host_time.py --layers 20 --rounds 50

At 512 px a training step is bound by the host (docs/performance.md), so every microsecond of
Python that enable_varlen adds to a forward is a microsecond of the step. This measures it where
nothing else differs: diffusers' Qwen-Image at full depth (60 layers) and ``train_step.py``'s CPU
widths, with its LoRA (r=16 on the attention projections), its text mask padded, no gradient,
one thread, with a cost table that leaves every masked call to stock's
SDPA on cuDNN (as on an H100/H200 at 512 px) and ``trim_text=False`` (the same tensors as stock).
Variants take turns, one forward each per round; the thread's CPU time per forward, its 10th
percentile and median over rounds (the CPU is shared: the low percentile is the steadier).
Besides stock and enable_varlen, three variants of enable_varlen each without one of its costs,
which say what each costs (they are not correct in general): ``no walk`` (the per-forward look
for compiled submodules, ``model._install_compiled``), ``no attention hooks`` (the attention
modules' hooks, which route calls outside the model's forward) and ``no route`` (the hook's cost
lookup for a call left to stock, ``hook._left_to_stock``, replaced by the call itself).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=60)
    p.add_argument("--rounds", type=int, default=150)
    p.add_argument("--lora", type=int, default=16, help="LoRA rank on the attention projections, as a trainer's (0: none)")
    args = p.parse_args()
    torch.set_num_threads(1)
    from types import SimpleNamespace

    import _common as C
    import varlen_attn as va
    from train_step import LORA_TARGETS, add_lora, build_model
    from varlen_attn import costs, hook, model as vm

    costs.stock_kernel = lambda device, dtype: "cudnn"  # stock's kernel on an H100/H200
    C.stock_cheaper_on_cpu("cudnn")
    cpu = torch.device("cpu")

    def make():  # train_step.py's CPU widths at the depth asked for, its LoRA on the attention projections
        m, cfg = build_model(SimpleNamespace(model="qwen", layers=args.layers, double=None, single=None), cpu,
                             torch.float32)
        if args.lora:  # peft's modules (about 7 per adapted projection) are most of a trainer's module tree
            add_lora(m, args.lora)
        return m.eval(), cfg

    b, t, side = 3, 16, 4
    keep = torch.arange(t)[None] < torch.tensor([7, 16, 2])[:, None]
    (stock, cfg), (ours, _) = make(), make()
    ours = va.enable_varlen(ours, trim_text=False)
    inputs = dict(hidden_states=torch.randn(b, side * side, cfg["in_channels"]),
                  encoder_hidden_states=torch.randn(b, t, cfg["joint_dim"]), timestep=torch.rand(b),
                  img_shapes=[[(1, side, side)]] * b, return_dict=False)
    attention = [m for m in ours.modules() if "_varlen_owner" in m.__dict__]
    walk, route = vm._install_compiled, hook._left_to_stock

    def use(name):  # enable_varlen as it is, or without one of its costs
        vm._install_compiled = (lambda model, state: None) if name == "no walk" else walk
        hook._left_to_stock = (lambda e, a, k, m: hook._replaced[0](*a, **k)) if name == "no route" else route
        for m in attention:
            vm._remove_hooks(m, vm._enter_attention, vm._leave_attention)
            if name != "no attention hooks":
                vm._add_hooks(m, vm._enter_attention, vm._leave_attention)

    names = ["stock", "enable_varlen", "no walk", "no attention hooks", "no route"]
    times = {name: [] for name in names}
    with torch.no_grad():
        for r in range(args.rounds + 3):
            for name in names:
                use(name)
                m = stock if name == "stock" else ours
                start = time.thread_time()
                m(**inputs, encoder_hidden_states_mask=keep.clone())
                if r >= 3:  # warm-up rounds
                    times[name].append((time.thread_time() - start) * 1e3)
    use("enable_varlen")
    base = sorted(times["stock"])[len(times["stock"]) // 10]
    print(f"torch {torch.__version__}, 1 thread, Qwen-Image {args.layers} layers at train_step.py's CPU widths, "
          f"LoRA r={args.lora} on {len(LORA_TARGETS)} projections a block, "
          f"{sum(1 for _ in ours.modules())} modules, {len(attention)} attention calls a forward; "
          f"ms per forward over {args.rounds} rounds")
    for name, ts in times.items():
        ts.sort()
        p10 = ts[len(ts) // 10]
        print(f"  {name:20s} p10 {p10:7.2f} ({p10 - base:+5.2f})   median {statistics.median(ts):7.2f}")


if __name__ == "__main__":
    main()
