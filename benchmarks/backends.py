"""Attention-only timings behind auto's priority list (not a test: run on a GPU).

    python benchmarks/backends.py [--json out.json] [--shapes chroma1024,chroma512]
    python benchmarks/backends.py --device cpu      # smoke run, tiny shape

Chroma shapes: B=3, H=24, D=128, bf16, S = 512 text + 4096 image (1024 px) and 512 + 1024
(512 px), text lengths 77/300/2. For each path: forward and forward+backward, median of
CUDA-event timings after warm-up (5 warm-ups, 30 reps). Varlen paths include pack + kernel +
unpack with a plan built once from the key-padding mask (the plan build, from the
outer-product mask, is timed on its own); beside each, its kernel called directly on
pre-packed tokens.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import _common as C
import varlen_attn as va


def run_shape(name, device):
    inp = C.make_inputs(name, device)
    keep = inp.k_keep
    b, s, h, d = inp.q.shape
    q, k, v = inp.q, inp.k, inp.v
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    rows = {}

    def add(label, fn):
        try:
            rows[label] = (C.median_ms(fn, device, warmup=5, reps=30),
                           C.median_ms(fn, device, backward=True, warmup=5, reps=30))
        except Exception as e:  # a backend that cannot run here is reported, not hidden
            rows[label] = (float("nan"), float("nan"))
            print(f"  {label}: failed: {type(e).__name__}: {str(e)[:200]}")

    add("masked SDPA, outer-product mask [B,1,S,S]",
        lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=inp.full_mask))
    add("masked SDPA, key-padding mask [B,1,1,S]",
        lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=inp.key_padding))
    add("dense SDPA, no mask (wrong answer; speed ref)", lambda: F.scaled_dot_product_attention(qt, kt, vt))

    plan_ms = C.plan_build_ms(inp.full_mask, device, reps=10, convention="torch", num_heads=h)
    plan = va.build_plan(keep)
    qp, kp, vp = C.packed(inp, plan)
    for backend in C.varlen_backends(device):
        add(f"varlen_attn backend={backend} (pack+kernel+unpack)",
            lambda n=backend: va.attention(q, k, v, plan=plan, backend=n))
        kernel = C.kernel_alone(backend, plan, d ** -0.5)
        if kernel is not None:  # the floor for this backend
            add(f"  kernel only, backend={backend}, pre-packed", lambda f=kernel: f(qp, kp, vp))
    add("varlen_attn auto", lambda: va.attention(q, k, v, plan=plan))
    return {"shape": name, "B": b, "S": s, "H": h, "D": d, "lengths": list(inp.shape.lengths),
            "valid_tokens": int(keep.sum()), "plan_build_ms": plan_ms, "rows": rows,
            "auto": C.backend_of(lambda: va.attention(q, k, v, plan=plan))}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None,
                    help="comma-separated (default chroma1024,chroma512; tiny on the CPU)")
    ap.add_argument("--json", default=None)
    C.add_device_argument(ap)
    args = ap.parse_args()
    device = C.device_of(args)
    torch.backends.cuda.matmul.allow_tf32 = True
    names = C.shape_names(args.shapes, device, default="chroma1024,chroma512")
    results = [run_shape(n, device) for n in names]
    meta = C.environment(device)
    print(json.dumps(meta))
    for r in results:
        print(f"\n{r['shape']}: B={r['B']} S={r['S']} H={r['H']} D={r['D']} "
              f"valid={r['valid_tokens']}/{r['B'] * r['S']}, plan build {r['plan_build_ms']:.3f} ms, "
              f"auto -> {r['auto']}")
        print(f"{'path':<58}{'fwd ms':>9}{'fwd+bwd ms':>12}")
        for label, (f, fb) in r["rows"].items():
            print(f"{label:<58}{f:>9.3f}{fb:>12.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
