"""Attention-only timings behind auto's priority list (not a test: run on a GPU).

    python benchmarks/backends.py [--json out.json]

Chroma shapes from CONTEXT.md: B=3, H=24, D=128, bf16, S = 512 text + 4096 image (1024 px) and
512 + 1024 (512 px), text lengths 77/300/2. For each path: forward and forward+backward, median
of CUDA-event timings after warm-up. Varlen paths include pack + kernel + unpack with a plan
built once (the plan build is timed on its own).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import varlen_attn as va
from varlen_attn import kernels
from varlen_attn.plan import _CACHE

sys.path.insert(0, str(Path(__file__).parent))
from attention import timeit  # noqa: E402


def bench(fn, backward: bool):
    """Median ms by CUDA events (the timing of benchmarks/attention.py, 5 warm-ups, 30 reps)."""
    return timeit(fn, backward, warmup=5, reps=30)


def run_shape(name, text, image, lengths, h=24, d=128, dtype=torch.bfloat16):
    dev = torch.device("cuda")
    b, s = len(lengths), text + image
    keep = torch.cat([torch.arange(text)[None] < torch.tensor(lengths)[:, None],
                      torch.ones(b, image, dtype=torch.bool)], 1).to(dev)
    outer = keep[:, None, :, None] & keep[:, None, None, :]
    kpad = keep[:, None, None, :]
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=dtype, generator=g).requires_grad_() for _ in range(3))
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))

    rows = {}

    def add(label, fn):
        try:
            rows[label] = (bench(fn, False), bench(fn, True))
        except Exception as e:  # a backend that cannot run here is reported, not hidden
            rows[label] = (float("nan"), float("nan"))
            print(f"  {label}: failed: {type(e).__name__}: {str(e)[:200]}")

    add("masked SDPA, outer-product mask [B,1,S,S]", lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=outer))
    add("masked SDPA, key-padding mask [B,1,1,S]", lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=kpad))
    add("dense SDPA, no mask (wrong answer; speed ref)", lambda: F.scaled_dot_product_attention(qt, kt, vt))

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    plan_ms = []
    for _ in range(10):
        _CACHE.clear()  # time a real build, not a cache hit
        start.record()
        plan = va.build_plan(outer, convention="torch", num_heads=h)
        end.record()
        torch.cuda.synchronize()
        plan_ms.append(start.elapsed_time(end))
    plan = va.build_plan(keep)
    for name_ in kernels.priority(dev):
        if name_ == "reference" or not kernels.BACKENDS[name_].is_installed():
            continue
        add(f"varlen_attn backend={name_} (pack+kernel+unpack)",
            lambda n=name_: va.attention(q, k, v, plan=plan, backend=n))
        # Kernel alone on pre-packed tensors: the floor for this backend.
        qp, kp, vp = (va.pack(t.detach(), plan, w).requires_grad_() for t, w in ((q, "q"), (k, "k"), (v, "k")))
        inp = kernels.VarlenInputs(qp, kp, vp, plan, d ** -0.5)
        add(f"  kernel only, backend={name_}, pre-packed", lambda n=name_: kernels.BACKENDS[n].forward(inp))
    add("varlen_attn auto", lambda: va.attention(q, k, v, plan=plan))
    return {"shape": name, "B": b, "S": s, "H": h, "D": d, "lengths": lengths, "valid_tokens": int(keep.sum()),
            "plan_build_ms": statistics.median(plan_ms), "rows": rows,
            "auto": kernels.select(kernels.VarlenInputs(q[0], k[0], v[0], plan, 1.0), "auto").NAME}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    results = [run_shape("Chroma 1024px bs3", 512, 4096, [77, 300, 2]),
               run_shape("Chroma 512px bs3", 512, 1024, [77, 300, 2])]
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import importlib.metadata as md
        meta["flash_attn_4"] = md.version("flash-attn-4")
    except Exception:
        meta["flash_attn_4"] = None
    print(json.dumps(meta))
    for r in results:
        print(f"\n{r['shape']}: B={r['B']} S={r['S']} H={r['H']} D={r['D']} valid={r['valid_tokens']}/{r['B'] * r['S']}, "
              f"plan build {r['plan_build_ms']:.3f} ms, auto -> {r['auto']}")
        print(f"{'path':<58}{'fwd ms':>9}{'fwd+bwd ms':>12}")
        for label, (f, fb) in r["rows"].items():
            print(f"{label:<58}{f:>9.3f}{fb:>12.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
