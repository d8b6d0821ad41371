"""Where does varlen_attn's time go beyond the kernel? (not a test; run on a GPU)

    python benchmarks/profile_overhead.py [--shape chroma512]

Per fwd+bwd iteration: host wall time with no sync inside the loop vs GPU time, for the kernel
alone on pre-packed tensors and for pack + kernel + unpack; then the top ops by CUDA and CPU time.
If host time per iteration exceeds GPU time, the GPU waits on Python and launches.
"""

from __future__ import annotations

import argparse
import time

import torch

import varlen_attn as va
from varlen_attn import kernels
from benchmarks_shapes import make  # noqa: E402  (same folder)


def loop(fn, iters=50):
    for _ in range(5):
        fn().backward(torch.ones_like(fn()))
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    s.record()
    for _ in range(iters):
        out = fn()
        out.backward(torch.ones_like(out))
    host = (time.perf_counter() - t0) / iters * 1e3
    e.record()
    torch.cuda.synchronize()
    return host, s.elapsed_time(e) / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="chroma512")
    ap.add_argument("--backend", default=None)
    args = ap.parse_args()
    q, k, v, plan = make(args.shape)
    name = args.backend or kernels.select(kernels.VarlenInputs(q[0], k[0], v[0], plan, 1.0), "auto").NAME
    qp, kp, vp = (va.pack(x.detach(), plan, w).requires_grad_() for x, w in ((q, "q"), (k, "k"), (v, "k")))
    inp = kernels.VarlenInputs(qp, kp, vp, plan, q.shape[-1] ** -0.5)
    paths = {
        "kernel only": lambda: kernels.BACKENDS[name].forward(inp),
        "pack q,k,v only": lambda: va.pack(q, plan, "q") + 0 * va.pack(k, plan, "k")[:0].sum() + 0 * va.pack(v, plan, "k")[:0].sum(),
        "unpack only": lambda: va.unpack(qp, plan, "q"),
        "varlen_attn.attention": lambda: va.attention(q, k, v, plan=plan, backend=name),
    }
    split = kernels.BACKENDS["split_sdpa"]
    for cut in ("slice", "split"):  # before / after: per-segment slices vs torch.split
        paths[f"split_sdpa kernel, cut={cut}"] = (lambda c=cut: (setattr(split, "CUT", c),
                                                               split.forward(inp))[1])
        paths[f"attention split_sdpa, cut={cut}"] = (lambda c=cut: (setattr(split, "CUT", c),
                                                                  va.attention(q, k, v, plan=plan, backend="split_sdpa"))[1])
    import importlib

    pack_mod = importlib.import_module("varlen_attn.pack")

    fmod = importlib.import_module("varlen_attn.functional")

    def with_settings(*settings):
        """attention with each ``module.attr = value`` set: one side of an A/B switch."""
        def run():
            for module, attr, value in settings:
                setattr(module, attr, value)
            return va.attention(q, k, v, plan=plan, backend=name)
        return run

    # Before / after: index_copy vs inverse-gather scatter; one autograd node for q, k, v (the
    # composed path's pack, so FUSED=False); pack + kernel + unpack as one autograd node.
    for label, value, extra in (("scatter", "index_copy", ()), ("scatter", "inverse_gather", ()),
                                ("pack_qkv", "separate", ((fmod, "FUSED", False),)),
                                ("pack_qkv", "fused", ((fmod, "FUSED", False),)),
                                ("fused", False, ()), ("fused", True, ())):
        module, attr = (fmod, "FUSED") if label == "fused" else (pack_mod, label.upper())
        defaults = ((fmod, "FUSED", True), (pack_mod, "SCATTER", "inverse_gather"), (pack_mod, "PACK_QKV", "fused"))
        paths[f"attention {name}, {label}={value}"] = with_settings(*defaults, *extra, (module, attr, value))
    compiled = torch.compile(lambda q_, k_, v_, p_: va.attention(q_, k_, v_, plan=p_, backend=name), fullgraph=True)
    paths[f"attention {name}, torch.compile'd caller"] = lambda: compiled(q, k, v, plan)
    print(f"{args.shape}, backend {name}, total_q {plan.total_q}, total_k {plan.total_k}")
    print(f"{'path':<44}{'host ms/iter':>14}{'GPU ms/iter':>13}  (median of 7 rounds, paths interleaved)")
    samples = {label: [] for label in paths}
    for _ in range(7):  # round-robin, so drift hits every path alike
        for label, fn in paths.items():
            samples[label].append(loop(fn, iters=30))
    for label, xs in samples.items():
        host = sorted(x[0] for x in xs)[len(xs) // 2]
        gpu = sorted(x[1] for x in xs)[len(xs) // 2]
        print(f"{label:<44}{host:>14.3f}{gpu:>13.3f}")
    split.CUT = "split"
    pack_mod.SCATTER = "inverse_gather"
    pack_mod.PACK_QKV = "fused"
    fmod.FUSED = True
    from torch.profiler import ProfilerActivity, profile

    fn = paths["varlen_attn.attention"]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            out = fn()
            out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=50))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=50))


if __name__ == "__main__":
    main()
