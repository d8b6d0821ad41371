"""Attention benchmark against the alternatives (not a test; run on a GPU).

    python benchmarks/attention.py [--json out.json] [--png out.png] [--shapes chroma1024,...]

For each shape, side by side in one run: forward and forward+backward time (median of CUDA-event
timings after warm-up) and peak extra memory over the inputs, for
  - masked SDPA with Chroma's outer-product mask [B,1,S,S] (stock diffusers),
  - masked SDPA with a key-padding mask [B,1,1,S],
  - FlexAttention, compiled, block mask built once per batch,
  - the per-layer prepare-then-varlen pattern of diffusers' flash_varlen backend (mask -> seqlens
    with host syncs in every call, prefix-valid keys; torch's built-in varlen kernel),
  - the floor: the best kernel on the valid tokens, already packed, no pack/unpack,
  - varlen_attn with every installed backend, plan built once (timed separately).
Ratios against the floor and against stock masked SDPA are printed and saved.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

import varlen_attn as va
from varlen_attn import kernels

SHAPES = {
    # name: (B, text, image, text lengths, cross_attention)
    "chroma1024": (3, 512, 4096, [77, 300, 2], False),
    "chroma512": (3, 512, 1024, [77, 300, 2], False),
    "video": (1, 256, 19968, [200], False),
    "cross": (3, 300, 4096, [20, 120, 1], True),
}


def timeit(fn, backward, warmup=3, reps=20):
    times = []
    for i in range(warmup + reps):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        out = fn()
        if backward:
            out.backward(torch.ones_like(out))
        e.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(s.elapsed_time(e))
    return statistics.median(times)


def peak_extra(fn, base_bytes):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    out.backward(torch.ones_like(out))
    del out
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base_bytes) / 2**20


def run_shape(name, h=24, d=128, dtype=torch.bfloat16):
    b, t, n, lengths, cross = SHAPES[name]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    text_keep = (torch.arange(t, device=dev)[None] < torch.tensor(lengths, device=dev)[:, None])
    if cross:  # q: image tokens (all valid), k/v: padded text
        sq, sk = n, t
        kkeep = text_keep
        qkeep = torch.ones(b, sq, dtype=torch.bool, device=dev)
        full = kkeep[:, None, None, :].expand(b, 1, sq, sk)
        kpad = kkeep[:, None, None, :]
    else:
        sq = sk = t + n
        keep = torch.cat([text_keep, torch.ones(b, n, dtype=torch.bool, device=dev)], 1)
        qkeep = kkeep = keep
        full = keep[:, None, :, None] & keep[:, None, None, :]
        kpad = keep[:, None, None, :]
    q = torch.randn(b, sq, h, d, device=dev, dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(b, sk, h, d, device=dev, dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(b, sk, h, d, device=dev, dtype=dtype, generator=g).requires_grad_()
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # SDPA layout views
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    rows = {}

    def add(label, fn):
        try:
            fb = timeit(fn, True)
            rows[label] = {"fwd": timeit(fn, False), "fwd_bwd": fb, "mem_mib": peak_extra(fn, base)}
        except Exception as exc:  # reported, not hidden
            rows[label] = {"fwd": float("nan"), "fwd_bwd": float("nan"), "mem_mib": float("nan"),
                           "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
        q.grad = k.grad = v.grad = None

    stock = "masked SDPA, outer-product mask [B,1,Sq,Sk]" if not cross else "masked SDPA, [B,1,Sq,Sk] mask"
    add(stock, lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=full).transpose(1, 2))
    add("masked SDPA, key-padding mask [B,1,1,Sk]",
        lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=kpad).transpose(1, 2))

    # FlexAttention, compiled once, block mask built once per batch.
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        qk_, kk_ = qkeep, kkeep

        def mask_mod(bi, hi, qi, ki):
            return qk_[bi, qi] & kk_[bi, ki]

        bm = create_block_mask(mask_mod, b, None, sq, sk, device=dev)
        flex = torch.compile(flex_attention, dynamic=False)
        # Flex gives finite garbage for padded query rows (no zero rows); close enough for timing.
        add("FlexAttention, compiled, block mask once", lambda: flex(qt, kt, vt, block_mask=bm).transpose(1, 2))
    except Exception as exc:
        rows["FlexAttention, compiled, block mask once"] = {"error": str(exc)[:160]}

    # diffusers' flash_varlen pattern, every call: seqlens from the mask with host syncs, keys taken
    # as a prefix key[b, :len] (wrong for joint rows with a gap, as in diffusers), builtin varlen.
    def per_layer_prepare():
        lens_k = kkeep.sum(1, dtype=torch.int32)
        cu_k = F.pad(lens_k.cumsum(0, dtype=torch.int32), (1, 0))
        max_k = int(lens_k.max().item())  # sync 1
        kp = torch.cat([k[i, : int(lens_k[i])] for i in range(b)])  # B syncs
        vp = torch.cat([v[i, : int(lens_k[i])] for i in range(b)])
        qp = q.flatten(0, 1)
        cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=dev)
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(qp, kp, vp, cu_q, cu_k, sq, max_k).view(b, sq, h, d)

    add("per-layer prepare + builtin varlen (diffusers flash_varlen pattern)", per_layer_prepare)

    plan = va.build_plan(kkeep, seqlen_q=sq) if cross else va.build_plan(full, convention="torch")
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    from varlen_attn.plan import _CACHE
    build_ms = []
    for _ in range(5):
        _CACHE.clear()
        s.record()
        va.build_plan(full, convention="torch")
        e.record()
        torch.cuda.synchronize()
        build_ms.append(s.elapsed_time(e))

    floor = None
    for name_ in kernels.priority(dev):
        if name_ == "reference" or not kernels.BACKENDS[name_].installed():
            continue
        qp, kp, vp = (va.pack(x.detach(), plan, w).requires_grad_() for x, w in ((q, "q"), (k, "k"), (v, "k")))
        inp = kernels.VarlenInputs(qp, kp, vp, plan, d ** -0.5)
        label = f"floor: {name_} kernel on pre-packed tokens"
        add(label, lambda n=name_, i=inp: kernels.BACKENDS[n].forward(i))
        if floor is None and "error" not in rows[label]:
            floor = label
        add(f"varlen_attn backend={name_} (pack + kernel + unpack)",
            lambda n=name_: va.attention(q, k, v, plan=plan, backend=n))
    add("varlen_attn auto", lambda: va.attention(q, k, v, plan=plan))
    if kernels.BACKENDS["flash_attn_4"].installed():
        # A/B in the same run: the composed path (pack_qkv + FA4's autograd + unpack, packed
        # copies kept for backward) against the fused one-node path that auto runs.
        def composed():
            va.functional.FUSED = False
            try:
                return va.attention(q, k, v, plan=plan, backend="flash_attn_4")
            finally:
                va.functional.FUSED = True

        add("varlen_attn flash_attn_4, composed (before fusing)", composed)
    # Under torch.compile: the custom op (varlen_attn.compiled), plan passed in as a handle.
    compiled = torch.compile(lambda q_, k_, v_, p_: va.attention(q_, k_, v_, plan=p_), fullgraph=True)
    add("varlen_attn auto, torch.compile'd caller (custom op)", lambda: compiled(q, k, v, plan))
    valid = (int(qkeep.sum()), int(kkeep.sum()))
    return {"shape": name, "B": b, "Sq": sq, "Sk": sk, "H": h, "D": d, "valid_q_k": valid,
            "plan_build_ms": statistics.median(build_ms), "rows": rows, "floor": floor, "stock": stock}


def report(results, meta):
    print(json.dumps(meta))
    for r in results:
        fl = r["rows"].get(r["floor"], {}).get("fwd_bwd", float("nan")) if r["floor"] else float("nan")
        st = r["rows"][r["stock"]]["fwd_bwd"]
        print(f"\n{r['shape']}: B={r['B']} Sq={r['Sq']} Sk={r['Sk']} H={r['H']} D={r['D']} valid q/k {r['valid_q_k']}, "
              f"plan build {r['plan_build_ms']:.2f} ms (once per batch)")
        print(f"{'path':<70}{'fwd':>8}{'fwd+bwd':>9}{'/floor':>8}{'/stock':>8}{'MiB':>8}")
        for label, x in r["rows"].items():
            if "fwd_bwd" not in x:
                print(f"{label:<70} {x.get('error')}")
                continue
            print(f"{label:<70}{x['fwd']:>8.3f}{x['fwd_bwd']:>9.3f}{x['fwd_bwd'] / fl:>8.2f}{st / x['fwd_bwd']:>7.2f}x"
                  f"{x['mem_mib']:>8.0f}" + (f"  ({x['error']})" if "error" in x else ""))


def chart(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 6))
    for ax, r in zip(axes if len(results) > 1 else [axes], results):
        labels = [lbl for lbl, x in r["rows"].items() if x.get("fwd_bwd") == x.get("fwd_bwd")]
        vals = [r["rows"][lbl]["fwd_bwd"] for lbl in labels]
        ax.barh(range(len(labels)), vals)
        ax.set_yticks(range(len(labels)), [lbl[:45] for lbl in labels], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("fwd+bwd ms (lower is better)")
        ax.set_title(f"{r['shape']} (B={r['B']}, Sq={r['Sq']}, Sk={r['Sk']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    ap.add_argument("--from-json", default=None, help="re-print and chart a saved run (no GPU needed)")
    args = ap.parse_args()
    if args.from_json:
        saved = json.load(open(args.from_json))
        report(saved["results"], saved["meta"])
        if args.png:
            chart(saved["results"], args.png)
        return
    results = [run_shape(s) for s in args.shapes.split(",")]
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import importlib.metadata as md

        meta["flash_attn_4"] = md.version("flash-attn-4")
    except Exception:
        meta["flash_attn_4"] = None
    report(results, meta)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "results": results}, fh, indent=1)
    if args.png:
        try:
            chart(results, args.png)
        except Exception as exc:
            print(f"chart skipped: {exc}")


if __name__ == "__main__":
    main()
