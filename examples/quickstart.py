"""Masked attention of a diffusion transformer: stock SDPA and varlen_attn side by side.

A batch shaped like a joint [text; image] sequence: text padded to a fixed length, different
prompt lengths per sample, one empty prompt (caption dropout). The same attention, a few
"layers" of it, is computed by masked SDPA (what diffusers does today) and by varlen_attn, with
two masks: key padding ``[B, 1, 1, S]`` (Qwen-Image, Flux) and the outer product ``[B, 1, S, S]``
(Chroma); and once more with a plan built by ``build_plan`` and passed to every layer. For each
path it prints the difference to stock and varlen_attn's own counts (``va.stats()``): plan
builds and host reads per pass. A key-padding mask is planned on the device with no host read.
The outer product runs as the key-padding call of its keys' mask, its plan built on the device
in every call, with one read per call here: the check that it is that outer product (inside an
enabled Chroma, the checks of a forward are read once, when it ends). A plan built once by
``build_plan`` costs one read for all layers.

Runs on the CPU by default and on a GPU when one is present:

    python examples/quickstart.py            # small shapes, a second or two on a laptop CPU (no timings)
    python examples/quickstart.py --layers 8 --text 256 --image 1024
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import varlen_attn as va


def timed(fn, device, repeats):
    fn()  # warm-up: plan build, kernel selection, first-call compilation
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--text", type=int, default=64, help="padded text length T")
    ap.add_argument("--image", type=int, default=256, help="image tokens N")
    ap.add_argument("--layers", type=int, default=4, help="attention calls sharing one mask")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default=None, help="varlen backend (default: auto)")
    args = ap.parse_args()

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b, h, d, t, n = args.batch, args.heads, args.head_dim, args.text, args.image
    s = t + n
    g = torch.Generator().manual_seed(0)

    # Prompt lengths: a long one, a short one, and an empty prompt (caption dropout).
    lengths = [max(1, int(0.6 * t)), max(1, t // 8), 0][:b] + [t // 2] * max(0, b - 3)
    text_keep = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    keep = torch.cat([text_keep, torch.ones(b, n, dtype=torch.bool)], dim=1).to(device)  # [B, S]
    mask = keep[:, None, None, :]  # [B, 1, 1, S]: key padding, gap inside the joint row

    def rand():
        return torch.randn(b, h, s, d, generator=g).to(device, dtype)

    qkv = [(rand(), rand(), rand()) for _ in range(args.layers)]
    # Chroma's mask: the outer product of the keep vector, [B, 1, S, S]. Padded query rows keep
    # no key; SDPA (torch >= 2.5) and varlen_attn both give zeros there.
    outer = keep[:, None, :, None] & keep[:, None, None, :]

    def stock(m):
        return lambda: [F.scaled_dot_product_attention(q, k, v, attn_mask=m) for q, k, v in qkv]

    def dropin(m):
        return lambda: [va.scaled_dot_product_attention(q, k, v, m, backend=args.backend) for q, k, v in qkv]

    def with_plan():
        plan = va.build_plan(keep, seqlen_q=s)  # once per batch: one host read, shared by every layer
        return [va.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), plan=plan,
                             backend=args.backend).transpose(1, 2) for q, k, v in qkv]

    paths = [("masked SDPA, key padding (stock)", stock(mask), None),
             ("varlen_attn drop-in, key padding", dropin(mask), "key"),
             ("masked SDPA, outer product (stock)", stock(outer), None),
             ("varlen_attn drop-in, outer product", dropin(outer), "outer"),
             ("varlen_attn, build_plan once", with_plan, "key")]
    gpu = device.type == "cuda"  # on the CPU, speed is not the point: its backends exist for correctness
    repeats = 20 if gpu else 0
    rows, refs, worst = [], {}, 0.0
    for label, fn, ref in paths:
        va.clear_plan_cache()  # build_plan caches its plans; each pass builds its own
        va.reset_stats()
        out = fn()  # one pass, counted: plan builds and host reads for every layer
        st = va.stats()
        ms = timed(fn, device, repeats) if gpu else None
        if ref is None:
            refs["key" if "key" in label else "outer"] = out
            err = None
        else:
            err = max((a.float() - r.float()).abs().max().item() for a, r in zip(out, refs[ref]))
            worst = max(worst, err)
        rows.append((label, ms, err, st))

    print(f"device {device} ({torch.cuda.get_device_name(device) if gpu else 'cpu'}), "
          f"dtype {dtype}, torch {torch.__version__}")
    print(f"batch {b}, heads {h}, head dim {d}, sequence {t} text + {n} image, text lengths {lengths}, "
          f"{args.layers} layers (attention calls) per pass")
    timing = f"{'ms / pass':>11}" if gpu else ""
    print(f"{'path':<37}{timing}{'max |diff| vs stock':>21}{'plan builds':>13}{'host reads':>12}  backends")
    for label, ms, err, st in rows:
        line = f"{label:<37}" + (f"{ms:>11.3f}" if gpu else "")
        if err is not None:  # stock's rows are the reference: varlen_attn counts none of their calls
            line += (f"{err:>21.2e}{st['plan_builds']:>13}{st['host_syncs']:>12}  "
                     + ", ".join(f"{k} x{c}" for k, c in st["backends"].items())
                     + (f"; fallbacks {st['fallbacks']}" if st["fallbacks"] else ""))
        print(line.rstrip())
    print(f"A key-padding mask gets its plan on the device with no host read; Chroma's outer product runs as "
          f"the key-padding call of its keys' mask, a plan per call, and one read per call to check it (an "
          f"enabled Chroma reads its checks once per forward); build_plan once per batch shares one read among "
          f"all {args.layers} layers.")
    if not gpu:
        print("(no timings on the CPU: speed is not the point there, its backends exist for correctness)")
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    if worst > tol:
        raise SystemExit(f"MISMATCH: {worst:.3e} > {tol}")


if __name__ == "__main__":
    main()
