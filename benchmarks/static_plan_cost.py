"""What a static plan (the CUDA-graph path, docs/design.md "CUDA graphs") costs on the GPU.

Under CUDA graphs each compiled graph builds the static plan of its mask in the graph. This
times, as CUDA-graph replays (no host time in them), on one shape:

- ``plan, eager kernels``: ``varlen_attn.plan.static_plan_tensors_of``, its ops launched one by one;
- ``plan, compiled``: the same ops (``static_plan_tensors_of``) compiled by inductor, as they run
  inside a graph compiled with ``mode="reduce-overhead"``;
- ``static fwd, eager kernels`` / ``static fwd, compiled``: the whole forward CUDA graphs run
  (``varlen_attn.op.static_attention``: plan, pack, kernel, unpack), its plan eager or compiled;
- ``masked SDPA fwd``: stock's attention forward on the same mask.

    python benchmarks/static_plan_cost.py [--backend torch] [--mask outer|key] [--mask-dtype bool|float]
                                          [--device cpu]

The CPU run (``--device cpu``) only checks that the script runs: nothing is captured there.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import varlen_attn as va
from varlen_attn.execution import Options
from varlen_attn.plan import static_plan_tensors_of
from varlen_attn.scope import Policy


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
    ap.add_argument("--mask-dtype", choices=("bool", "float"), default="bool",
                    help="float: a 0/1 mask of q's dtype read as boolean (Chroma's pipeline passes one)")
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
    if args.mask_dtype == "float":
        mask4 = mask4.to(dtype)
    q, k, v = (torch.randn(b, s, heads, dim, device=device, dtype=dtype) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def plan():
        return static_plan_tensors_of(mask4, batch=b, seqlen_q=s, seqlen_k=s, float01_as_bool=True)

    def forward():
        return va.op.static_attention(q, k, v, mask4, convention="torch", opts=Options(None, False, 0.0, False),
                                      policy=Policy(args.backend, False, "bool", False))

    rows = {
        "plan, eager kernels": replay_us(plan, device),
        "plan, compiled": replay_us(torch.compile(plan, fullgraph=True), device),
        f"static fwd, eager kernels ({args.backend})": replay_us(forward, device),
        f"static fwd, compiled ({args.backend})": replay_us(torch.compile(forward, fullgraph=True), device),
        "masked SDPA fwd": replay_us(lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask4), device),
    }
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}; B={b} S={s} (text {args.text}, lengths {list(lengths)}, image "
          f"{args.image}) H={heads} D={dim} {dtype}, mask {args.mask} {mask4.dtype} {tuple(mask4.shape)}; CUDA-graph "
          f"replays, "
          f"median of 200")
    for label, us in rows.items():
        print(f"  {label:36s} {us:9.1f} us")


if __name__ == "__main__":
    main()
