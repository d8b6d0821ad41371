"""Attention benchmark against the alternatives (not a test; run on a GPU).

    python benchmarks/attention.py [--json out.json] [--png out.png] [--shapes chroma1024,...]
    python benchmarks/attention.py --from-json out.json [--png out.png]   # re-print a saved run
    python benchmarks/attention.py --device cpu                           # smoke run, tiny shape
    python benchmarks/attention.py --per-call [--profile] [--shapes qwen1024,chroma1024]

For each shape, side by side in one run: forward and forward+backward time (median of CUDA-event
timings after warm-up) and peak extra memory over the inputs, for
  - masked SDPA with Chroma's outer-product mask [B,1,S,S] (stock diffusers),
  - masked SDPA with a key-padding mask [B,1,1,S],
  - FlexAttention, compiled, block mask built once per batch,
  - the per-layer prepare-then-varlen pattern of diffusers' flash_varlen backend (mask -> seqlens
    with host syncs in every call, prefix-valid keys; torch's built-in varlen kernel),
  - the floor: each installed backend's kernel called directly on the valid tokens, already
    packed, no pack/unpack,
  - varlen_attn with every installed backend and with auto, plan built once (timed separately),
  - varlen_attn auto called from a torch.compile'd function (its custom op).
Ratios against the floor (the first installed kernel in auto's order) and against stock masked
SDPA are printed and saved.

``--per-call``: one call as a model makes it, GPU time only (the host queues the calls while
the GPU sleeps, so host time is excluded): ``varlen_attn.scaled_dot_product_attention`` on the
SDPA layout ``[B, H, S, D]`` (views of ``[B, S, H, D]`` tensors, as diffusers' processors hand
it), the plan built from the call's own mask every call, for each installed backend, against
its kernel alone on tokens packed beforehand; the mask as the model gives it (Qwen-Image: key
padding; Chroma: the outer product, also as an enabled Chroma forward runs it: checked against
the model's mask on the device and read when the forward ends, on the forward's plan).
``--profile`` adds each row's GPU kernels.
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
    q, k, v = inp.q, inp.k, inp.v
    b, sq, h, d = q.shape
    sk = k.shape[1]
    full, kpad = inp.full_mask, inp.key_padding
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # SDPA layout views
    C.sync(device)
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    rows = {}

    def add(label, fn):
        try:
            rows[label] = {"fwd": C.median_ms(fn, device), "fwd_bwd": C.median_ms(fn, device, backward=True),
                           "mem_mib": C.peak_extra_mib(fn, device, base)}
        except Exception as exc:  # reported, not hidden
            rows[label] = {"fwd": float("nan"), "fwd_bwd": float("nan"), "mem_mib": float("nan"),
                           "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
        q.grad = k.grad = v.grad = None

    stock = "masked SDPA, " + ("[B,1,Sq,Sk] mask" if inp.shape.cross else "outer-product mask [B,1,Sq,Sk]")
    add(stock, lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=full).transpose(1, 2))
    add("masked SDPA, key-padding mask [B,1,1,Sk]",
        lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=kpad).transpose(1, 2))

    flex = "FlexAttention, compiled, block mask once"
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        qk_, kk_ = inp.q_keep, inp.k_keep

        def mask_mod(bi, hi, qi, ki):
            return qk_[bi, qi] & kk_[bi, ki]

        bm = create_block_mask(mask_mod, b, None, sq, sk, device=device)
        compiled_flex = torch.compile(flex_attention, dynamic=False)
        # Flex gives finite garbage for padded query rows (no zero rows); close enough for timing.
        add(flex, lambda: compiled_flex(qt, kt, vt, block_mask=bm).transpose(1, 2))
    except Exception as exc:
        rows[flex] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}

    # diffusers' flash_varlen pattern, every call: seqlens from the mask with host syncs, keys taken
    # as a prefix key[b, :len] (wrong for joint rows with a gap, as in diffusers), builtin varlen.
    def per_layer_prepare():
        from torch.nn.attention.varlen import varlen_attn

        lens_k = inp.k_keep.sum(1, dtype=torch.int32)
        cu_k = F.pad(lens_k.cumsum(0, dtype=torch.int32), (1, 0))
        max_k = int(lens_k.max().item())  # sync 1
        kp = torch.cat([k[i, : int(lens_k[i])] for i in range(b)])  # B syncs
        vp = torch.cat([v[i, : int(lens_k[i])] for i in range(b)])
        qp = q.flatten(0, 1)
        cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=device)
        return varlen_attn(qp, kp, vp, cu_q, cu_k, sq, max_k).view(b, sq, h, d)

    add("per-layer prepare + builtin varlen (diffusers flash_varlen pattern)", per_layer_prepare)

    # The plan, once per batch: cross-attention from the key padding, self-attention from the mask.
    plan_args = ((inp.k_keep,), {"seqlen_q": sq}) if inp.shape.cross else ((full,), {"convention": "torch"})
    plan = va.build_plan(*plan_args[0], **plan_args[1])
    build_ms = C.plan_build_ms(*plan_args[0], device, **plan_args[1])

    floor = None
    qp, kp, vp = C.packed(inp, plan)
    for backend in C.varlen_backends(device):
        kernel = C.kernel_alone(backend, plan, d ** -0.5)
        if kernel is not None:
            label = f"floor: {backend} kernel on pre-packed tokens"
            add(label, lambda f=kernel: f(qp, kp, vp))
            qp.grad = kp.grad = vp.grad = None
            if floor is None and "error" not in rows[label]:
                floor = label
        add(f"varlen_attn backend={backend} (pack + kernel + unpack)",
            lambda n=backend: va.attention(q, k, v, plan=plan, backend=n))
    add("varlen_attn auto", lambda: va.attention(q, k, v, plan=plan))
    auto = C.backend_of(lambda: va.attention(q, k, v, plan=plan))
    compiled = torch.compile(lambda q_, k_, v_, p_: va.attention(q_, k_, v_, plan=p_), fullgraph=True)
    add("varlen_attn auto, torch.compile'd caller (custom op)", lambda: compiled(q, k, v, plan))
    return {"shape": name, "B": b, "Sq": sq, "Sk": sk, "H": h, "D": d,
            "valid_q_k": (int(inp.q_keep.sum()), int(inp.k_keep.sum())), "plan_build_ms": build_ms,
            "auto": auto, "rows": rows, "floor": floor, "stock": stock}


def per_call(name, device, profile: bool, backends=None):
    """``{label: GPU ms per forward + backward}`` of one call as a model makes it (see above)."""
    inp = C.make_inputs(name, device)
    q, k, v = inp.q, inp.k, inp.v
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    outer = name.startswith("chroma")
    mask = inp.full_mask if outer else inp.key_padding
    plan = va.build_plan(mask, convention="torch", seqlen_q=q.shape[1])
    qp, kp, vp = C.packed(inp, plan) if outer else (q.detach().flatten(0, 1).requires_grad_(),
                                                    *C.packed(inp, plan)[1:])
    rows, profiles = {}, {}
    for backend in backends or C.varlen_backends(device):
        kernel = C.kernel_alone(backend, plan, q.shape[-1] ** -0.5)
        if kernel is not None:
            rows[f"{backend} kernel alone, tokens packed beforehand"] = lambda f=kernel: f(qp, kp, vp)
        rows[f"{backend} route, plan from the call's mask"] = (
            lambda n=backend: va.scaled_dot_product_attention(qt, kt, vt, mask, backend=n))
    rows["auto"] = lambda: va.scaled_dot_product_attention(qt, kt, vt, mask)
    if outer:  # as an enabled Chroma runs it: the model mask's plan, its check read when the forward ends
        from varlen_attn import execution, hook
        from varlen_attn.policy import Policy

        hook.install()
        for backend in backends or C.varlen_backends(device):
            # One forward's checks for every call: its plan made once, as a forward's blocks share it.
            entry = execution.Entry(Policy.of(backend, model=True), checks=execution.Deferred(inp.q_keep, []))

            def model_call(e=entry):
                with execution.active(e):
                    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)

            rows[f"{backend} route in an enabled Chroma forward (no read)"] = model_call
    out = {}
    for label, fn in rows.items():
        try:
            out[label] = C.gpu_ms(fn, device)
            if profile:
                profiles[label] = C.kernel_profile(fn, device)
        except Exception as exc:  # reported, not hidden
            out[label] = float("nan")
            print(f"{name} {label}: {type(exc).__name__}: {str(exc)[:160]}")
        for t in (q, k, v, qp, kp, vp):
            t.grad = None
    print(f"\n{inp.describe()}, mask {'outer product' if outer else 'key padding'} {tuple(mask.shape)}; "
          f"GPU ms per call, forward + backward")
    for label, ms in out.items():
        print(f"  {label:<60}{ms:9.3f}")
    for label, table in profiles.items():
        print(f"\n--- {name}: {label}\n{table}")
    return {"shape": name, "mask": "outer" if outer else "key_padding", "gpu_ms": out}


def report(results, meta):
    print(json.dumps(meta))
    for r in results:
        fl = r["rows"].get(r["floor"], {}).get("fwd_bwd", float("nan")) if r["floor"] else float("nan")
        st = r["rows"][r["stock"]]["fwd_bwd"]
        auto = f", auto -> {r['auto']}" if "auto" in r else ""
        print(f"\n{r['shape']}: B={r['B']} Sq={r['Sq']} Sk={r['Sk']} H={r['H']} D={r['D']} "
              f"valid q/k {r['valid_q_k']}, plan build {r['plan_build_ms']:.2f} ms (once per batch){auto}")
        print(f"{'path':<70}{'fwd':>8}{'fwd+bwd':>9}{'/floor':>8}{'/stock':>8}{'MiB':>8}")
        for label, x in r["rows"].items():
            if "fwd_bwd" not in x:
                print(f"{label:<70} {x.get('error')}")
                continue
            print(f"{label:<70}{x['fwd']:>8.3f}{x['fwd_bwd']:>9.3f}{x['fwd_bwd'] / fl:>8.2f}"
                  f"{st / x['fwd_bwd']:>7.2f}x{x['mem_mib']:>8.0f}"
                  + (f"  ({x['error']})" if "error" in x else ""))


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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None,
                    help=f"comma-separated, of {', '.join(C.SHAPES)} (default all but tiny; tiny on the CPU)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    ap.add_argument("--from-json", default=None, help="re-print and chart a saved run (no GPU needed)")
    ap.add_argument("--per-call", action="store_true", help="one call as a model makes it, GPU time (above)")
    ap.add_argument("--profile", action="store_true", help="with --per-call: each row's GPU kernels")
    ap.add_argument("--backends", default=None, help="with --per-call: comma-separated (default: every installed)")
    C.add_device_argument(ap)
    args = ap.parse_args()
    if args.per_call:
        device = C.device_of(args)
        names = C.shape_names(args.shapes, device, default="qwen1024,chroma1024")
        results = [per_call(s, device, args.profile, args.backends and args.backends.split(",")) for s in names]
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"meta": C.environment(device), "per_call": results}, fh, indent=1)
        return
    if args.from_json:
        with open(args.from_json) as fh:
            saved = json.load(fh)
        report(saved["results"], saved["meta"])
        if args.png:
            chart(saved["results"], args.png)
        return
    device = C.device_of(args)
    names = C.shape_names(args.shapes, device, default="chroma1024,chroma512,video,cross")
    results = [run_shape(s, device) for s in names]
    meta = C.environment(device)
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
