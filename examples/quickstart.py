"""Masked attention of a diffusion transformer, three ways, side by side.

A batch shaped like Chroma's joint [text; image] sequence: text padded to a fixed length,
different prompt lengths per sample, one empty prompt (caption dropout). The same attention is
computed by masked SDPA (what diffusers does today), by varlen_attn's drop-in, and by
varlen_attn's [B, S, H, D] entry with a plan built once and reused by every "layer".

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
        out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) / repeats * 1e3


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

    def stock():
        return [F.scaled_dot_product_attention(q, k, v, attn_mask=mask) for q, k, v in qkv]

    def dropin():
        return [va.scaled_dot_product_attention(q, k, v, mask, backend=args.backend) for q, k, v in qkv]

    plan = va.build_plan(keep, seqlen_q=s)  # once per batch; at most one host sync

    def with_plan():
        return [va.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), plan=plan,
                             backend=args.backend).transpose(1, 2) for q, k, v in qkv]

    va.reset_stats()
    repeats = 3 if device.type == "cpu" else 20
    ref, t_stock = timed(stock, device, repeats)
    out1, t_dropin = timed(dropin, device, repeats)
    out2, t_plan = timed(with_plan, device, repeats)
    err1 = max((a.float() - r.float()).abs().max().item() for a, r in zip(out1, ref))
    err2 = max((a.float() - r.float()).abs().max().item() for a, r in zip(out2, ref))

    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"dtype {dtype}, torch {torch.__version__}")
    print(f"batch {b}, heads {h}, head dim {d}, sequence {t} text + {n} image, text lengths {lengths}")
    print(f"plan: {plan}")
    gpu = device.type == "cuda"  # on the CPU, speed is not the point: its backends exist for correctness
    timing = f"{'ms / ' + str(args.layers) + ' layers':>18}" if gpu else ""
    print(f"{'path':<34}{timing}{'max |diff| vs SDPA':>22}")
    for label, ms, err in (("masked SDPA (stock)", t_stock, 0.0), ("varlen_attn drop-in", t_dropin, err1),
                           ("varlen_attn with a prebuilt plan", t_plan, err2)):
        print(f"{label:<34}" + (f"{ms:>18.3f}" if gpu else "") + f"{err:>22.2e}")
    if not gpu:
        print("(no timings on the CPU: speed is not the point there, its backends exist for correctness)")
    st = va.stats()
    print(f"backends that ran: {st['backends']}; plan builds: {st['plan_builds']}; "
          f"host syncs: {st['host_syncs']}; fallbacks: {st['fallbacks'] or 'none'}")
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    if max(err1, err2) > tol:
        raise SystemExit(f"MISMATCH: {max(err1, err2):.3e} > {tol}")


if __name__ == "__main__":
    main()
