"""Measure the cost of each route of one masked attention call on this GPU, and write the table
``enable_varlen``'s auto routing reads (``varlen_attn/costs.json`` format).

    python benchmarks/crossovers.py --out my_gpu.json            # then VARLEN_ATTN_COSTS=my_gpu.json
    python benchmarks/crossovers.py --out my_gpu.json --png crossovers.png
    python benchmarks/crossovers.py --device cpu --out /tmp/x.json   # smoke run: toy sizes

One call is forward + backward, batch 3 (``--batch``), 24 heads of 128, bf16, a joint
``[text; image]`` sequence: 512 text tokens of which 77, 300 and 2 are valid (cycled over a
larger batch: ``split_sdpa`` launches a kernel per sequence), then N image tokens, all valid; the
mask as Chroma gives it (outer product ``[B, 1, S, S]``: padded queries attend nothing) and as
Qwen-Image gives it (key padding ``[B, 1, 1, S]``). Routes: stock masked SDPA with the kernel
PyTorch picks by default and with cuDNN's attention off (the memory-efficient kernel: what
A100 and RTX GPUs get), and ``varlen_attn.scaled_dot_product_attention`` with each installed
backend named (a plan built from the call's own mask every call, as in a model).

A route's cost is its host time plus its GPU time per call, in ms: a training step pays GPU time
where the GPU is its bottleneck and host time where Python and launches are (512 px steps), so a
route is taken only where it saves more GPU time than it adds host time. GPU time: CUDA events
around ``--calls`` calls issued while the GPU first runs a sleep kernel long enough for the host
to queue them all (the events see the kernels back to back). Host time: the process's CPU time
(every thread: autograd's backward thread too) spent issuing them. A route that reads the host
(``host_syncs``) cannot queue ahead: its cost is the wall time per call of back-to-back calls.
The median over ``--rounds`` rounds, the routes taking turns in each.

auto reads the key-padding curves for calls of both layouts (``varlen_attn.costs.CURVES``); the
outer-product rows show what that rests on: stock's memory-efficient kernel costs the same with
a mask's rows as with its keys' mask.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import _common as C
import torch

import varlen_attn as va

TEXT, LENGTHS = 512, (77, 300, 2)


def inputs(image: int, device, dtype, heads: int, head_dim: int, batch: int = 3):
    lengths = tuple(LENGTHS[i % len(LENGTHS)] for i in range(batch))
    shape = C.Shape(batch, TEXT, image, lengths, heads=heads, head_dim=head_dim)
    keep = C.joint_keep(shape, device)
    g = torch.Generator(device=device).manual_seed(0)
    s = TEXT + image
    q, k, v = (torch.randn(batch, heads, s, head_dim, device=device, dtype=dtype, generator=g)
               .requires_grad_() for _ in range(3))
    masks = {"outer": keep[:, None, :, None] & keep[:, None, None, :], "key_padding": keep[:, None, None, :]}
    return q, k, v, masks


def routes(device, dtype) -> dict:
    """label -> fn(q, k, v, mask) -> out, and whether cuDNN's attention stays on for it. Stock
    is labelled by the kernel it takes (``sdpa:cudnn``, ``sdpa:efficient``, ...), as the
    router names it (``varlen_attn.costs.stock_kernel``)."""
    def stock(q, k, v, m):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)

    out = {}
    for cudnn in (True, False):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        out.setdefault(f"sdpa:{va.costs.stock_kernel(device, dtype)}", (stock, cudnn))
    torch.backends.cuda.enable_cudnn_sdp(True)
    for name in C.varlen_backends(device):
        out[name] = ((lambda n: lambda q, k, v, m: va.scaled_dot_product_attention(q, k, v, m, backend=n))(name),
                     True)
    return out


def one_round(fn, q, k, v, m, device, calls: int, syncs: bool) -> tuple[float, float]:
    """``(host ms, gpu ms)`` per call, or ``(wall ms, 0)`` for a route that reads the host."""
    def call():
        fn(q, k, v, m).sum().backward()

    C.sync(device)
    if device.type != "cuda" or syncs:
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        C.sync(device)
        return (time.perf_counter() - t0) / calls * 1e3, 0.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(2e6 * 60))  # ~60 ms at ~2 GHz: the host queues every call meanwhile
    start.record()
    h0 = time.process_time()
    for _ in range(calls):
        call()
    host = (time.process_time() - h0) / calls * 1e3
    end.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / calls


def measure(images, device, dtype, heads, head_dim, calls, rounds, batch: int = 3) -> dict:
    """``{layout: {"tokens": [...], "valid": [...], "routes": {label: {"host": [...], "gpu": [...],
    "cost": [...]}}}}``."""
    table = {}
    labels = routes(device, dtype)
    for image in images:
        q, k, v, masks = inputs(image, device, dtype, heads, head_dim, batch)
        for layout, m in masks.items():
            entry = table.setdefault(layout, {"tokens": [], "routes": {}})
            entry["tokens"].append(TEXT + image)
            samples = {}
            for label, (fn, cudnn) in labels.items():
                torch.backends.cuda.enable_cudnn_sdp(cudnn)
                try:
                    va.reset_stats()
                    for _ in range(2):  # warm-up (FA4 compiles a new shape here)
                        fn(q, k, v, m).sum().backward()
                    syncs = va.stats()["host_syncs"] > 0
                    samples[label] = (syncs, [])
                except Exception as exc:  # reported, not hidden
                    print(f"  {layout} S={TEXT + image} {label}: {type(exc).__name__}: {str(exc)[:120]}")
                finally:
                    torch.backends.cuda.enable_cudnn_sdp(True)
            for r in range(rounds):
                order = list(samples) if r % 2 == 0 else list(samples)[::-1]
                for label in order:
                    fn, cudnn = labels[label]
                    torch.backends.cuda.enable_cudnn_sdp(cudnn)
                    samples[label][1].append(one_round(fn, q, k, v, m, device, calls, samples[label][0]))
                    torch.backends.cuda.enable_cudnn_sdp(True)
                    q.grad = k.grad = v.grad = None
            for label, (syncs, xs) in samples.items():
                host = statistics.median(x[0] for x in xs)
                gpu = statistics.median(x[1] for x in xs)
                row = entry["routes"].setdefault(label, {"host": [], "gpu": [], "cost": [], "syncs": syncs})
                row["host"].append(round(host, 4))
                row["gpu"].append(round(gpu, 4))
                row["cost"].append(round(host + gpu, 4))
                print(f"  {layout:<11} S={TEXT + image:>6} {label:<14} host {host:8.3f} gpu {gpu:8.3f} "
                      f"cost {host + gpu:8.3f} ms{'  (reads the host: wall time)' if syncs else ''}", flush=True)
        del q, k, v, masks
    return table


def crossovers(layout_table: dict) -> dict:
    """For each stock kernel and varlen route: the tokens per sequence from which the route costs
    less than stock, as auto's router works it out (``varlen_attn.costs.crossover_tokens``;
    ``inf``: not within the range measured)."""
    routes = layout_table["routes"]
    return {stock: {label: va.costs.crossover_tokens(layout_table, label, stock) for label in routes
                    if not label.startswith("sdpa:")} for stock in routes if stock.startswith("sdpa:")}


def chart(result: dict, path: str, steps: str | None = None) -> None:
    """Cost per call against tokens per sequence, a panel per mask layout, FA4's crossovers
    marked; with ``steps`` (a folder of ``train_step.py --json`` files named ``<model><px>.json``),
    a third panel: the training step's speed-up against resolution."""
    plt = C.pyplot(path)
    if plt is None:
        return
    layouts = result["layouts"]
    fig, axes = plt.subplots(1, len(layouts) + bool(steps), figsize=(6 * (len(layouts) + bool(steps)), 5))
    for ax, (layout, t) in zip(axes, layouts.items()):
        for label, row in t["routes"].items():
            ax.plot(t["tokens"], row["cost"], "-" if label.startswith("sdpa") else "--", marker="o", label=label)
        for stock, marks in result["crossovers"].get(layout, {}).items():
            at = marks.get("flash_attn_4")
            if at and math.isfinite(at):
                ax.axvline(at, ls=":", color="grey")
                ax.annotate(f"FA4 cheaper than {stock} from {at:.0f}", (at, t["routes"][stock]["cost"][0]), fontsize=7,
                            rotation=90)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tokens per sequence")
        ax.set_ylabel("ms per call, forward + backward (host + GPU)")
        ax.set_title(f"{result['gpu']}: one call, {layout.replace('_', ' ')} mask, batch {result['batch']}, "
                     f"{result['heads']}x{result['head_dim']}, {result.get('dtype', '')}")
        ax.legend(fontsize=7)
    if steps:
        ax = axes[-1]
        for model, marker in (("qwen", "o"), ("chroma", "s")):
            for suffix, label in (("", "vs stock (PyTorch's default)"), ("/nocudnn", "vs stock, cuDNN off")):
                pts = []
                for px in (512, 1024, 2048):
                    f = os.path.join(steps, f"{model}{px}.json")
                    r = json.load(open(f))["results"].get("varlen:auto" + suffix) if os.path.exists(f) else None
                    if r and r.get("stock_over_variant"):
                        pts.append((px, r["stock_over_variant"]))
                if pts:
                    ax.plot(*zip(*pts), marker=marker, label=f"{model}, eager, {label}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks([512, 1024, 2048], ["512", "1024", "2048"])
        ax.set_xlabel("resolution (px)")
        ax.set_ylabel("training step, stock / enable_varlen")
        ax.set_title("full-depth LoRA step (train_step.py)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", default="512,1024,2048,4096,8192,16384",
                    help="image tokens per sequence (plus 512 text tokens)")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=3,
                    help="sequences per call (default 3, the packaged table's); prompt lengths 77, 300, 2 "
                         "cycled")
    ap.add_argument("--out", default=None, help="write the table here (varlen_attn's costs format)")
    ap.add_argument("--png", default=None)
    ap.add_argument("--from-json", default=None, help="chart a saved table (no GPU needed)")
    ap.add_argument("--steps", default=None, help="with --png: a folder of train_step.py JSON files "
                    "(<model><px>.json) for a panel of step speed-up against resolution")
    C.add_device_argument(ap)
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as fh:
            chart(json.load(fh)["tables"][0], args.png, args.steps)
        return
    device = C.device_of(args)
    cuda = device.type == "cuda"
    images = [int(x) for x in args.images.split(",")] if cuda else [16, 48]
    heads, head_dim = (24, 128) if cuda else (2, 32)
    env = C.environment(device)
    layouts = measure(images, device, torch.bfloat16 if cuda else torch.float32, heads, head_dim,
                      args.calls, args.rounds, args.batch)
    result = {"gpu": env["gpu"],
              "capability": list(torch.cuda.get_device_capability(device)) if cuda else None,
              "dtype": "bfloat16" if cuda else "float32", "environment": env, "batch": args.batch,
              "heads": heads, "head_dim": head_dim,
              "layouts": layouts, "crossovers": {lay: crossovers(t) for lay, t in layouts.items()}}
    print(json.dumps(result["crossovers"], indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"format": 1, "tables": [result]}, fh, indent=1)
    if args.png:
        chart(result, args.png)


if __name__ == "__main__":
    main()
