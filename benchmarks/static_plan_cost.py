"""What a static plan (the CUDA-graph path, docs/design.md "CUDA graphs") costs on the GPU.

Each attention layer under CUDA graphs builds its own static plan from its mask. This times, as
CUDA-graph replays (no host time in them), on one shape:

- ``plan``: ``varlen_attn.plan.build_static_plan`` from the layer's mask (an internal, measured
  here on purpose: it is what a per-forward plan would save per layer);
- ``static op fwd``: the whole static op forward (plan, pack, kernel, unpack) for a backend;
- ``masked SDPA fwd``: stock's attention forward on the same mask.

    python benchmarks/static_plan_cost.py [--backend torch] [--mask outer|key] [--device cpu]

The CPU run (``--device cpu``) only checks that the script runs: nothing is captured there.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import varlen_attn as va
from varlen_attn.plan import build_static_plan


def replay_us(fn, device, reps: int = 200) -> float:
    """Median microseconds per replay of ``fn`` captured in a CUDA graph (CPU: per call)."""
    if device.type != "cuda":
        fn()
        return float("nan")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--mask", choices=("outer", "key"), default="outer",
                    help="Chroma's [B,1,S,S] outer product, or a [B,1,1,S] key-padding mask")
    ap.add_argument("--text", type=int, default=512)
    ap.add_argument("--image", type=int, default=1024, help="1024 at 512 px, 4096 at 1024 px")
    args = ap.parse_args()
    device = torch.device(args.device)
    lengths, heads, dim = (77, 300, 2), 24, 128
    if device.type == "cpu":
        args.text, args.image, heads, dim = 16, 32, 2, 8
        lengths = (5, 16, 0)
    b, s = len(lengths), args.text + args.image
    text = torch.arange(args.text)[None] < torch.tensor(lengths)[:, None]
    keep = torch.cat([text, torch.ones(b, args.image, dtype=torch.bool)], 1).to(device)
    mask4 = (keep[:, None, :, None] & keep[:, None, None, :]) if args.mask == "outer" else keep[:, None, None, :]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (torch.randn(b, s, heads, dim, device=device, dtype=dtype) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    rows = {
        "plan": replay_us(lambda: build_static_plan(mask4, batch=b, seqlen_q=s, seqlen_k=s), device),
        f"static op fwd ({args.backend})": replay_us(
            lambda: va.op.static_attention_op(q, k, v, mask4, None, False, args.backend, False, "torch",
                                              "bool", False), device),
        "masked SDPA fwd": replay_us(lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask4), device),
    }
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}; B={b} S={s} (text {args.text}, lengths {list(lengths)}, image "
          f"{args.image}) H={heads} D={dim} {dtype}, mask {args.mask} {tuple(mask4.shape)}; CUDA-graph replays, "
          f"median of 200")
    for label, us in rows.items():
        print(f"  {label:28s} {us:9.1f} us")


if __name__ == "__main__":
    main()
