"""Where does varlen_attn's time go beyond the kernel? (not a test; run on a GPU)

    python benchmarks/profile_overhead.py [--shape chroma512] [--backend flash_attn_4] [--cprofile]
    python benchmarks/profile_overhead.py --device cpu      # smoke run, tiny shape
    python benchmarks/profile_overhead.py --backend torch --also split_sdpa,flex  # several, interleaved

Per forward + backward, host time (Python issuing the work, no sync inside the loop) against GPU
time, for: the kernel alone on pre-packed tokens (called directly, no varlen_attn code), pack of
q, k, v alone, unpack alone, stock masked SDPA on the padded tensors, the full path (pack +
kernel + unpack) eagerly, and the full path called from a torch.compile'd function (varlen_attn's
custom op). Medians of 7 rounds of 30-iteration loops, the paths taken in turn each round. Host
>= GPU time means the GPU waits on Python and launches. Then the aten ops per forward and per
backward of stock and of the eager path, the top ops of the full path by GPU and by CPU time
(torch.profiler) and, with ``--cprofile``, its top Python functions by own time.

The A/B comparisons of earlier versions (split_sdpa's cut, the scatter, one node for q, k, v,
the fused node, packs with C++ autograd only) and their numbers are in NOTES.md; the losing
branches are gone from the code.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import _common as C
import varlen_attn as va


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default=None,
                    help="a shape of _common.SHAPES (default chroma512; tiny on the CPU)")
    ap.add_argument("--backend", default=None, help="varlen_attn backend (default: the one auto picks)")
    ap.add_argument("--also", default="", help="comma-separated backends whose eager path is timed too, interleaved")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--cprofile", action="store_true", help="also profile the full path's Python (cProfile)")
    C.add_device_argument(ap)
    args = ap.parse_args()
    device = C.device_of(args)
    (name,) = C.shape_names(args.shape, device, default="chroma512")
    inp = C.make_inputs(name, device)
    q, k, v = inp.q, inp.k, inp.v
    plan = va.build_plan(inp.full_mask, convention="torch")
    backend = args.backend or C.backend_of(lambda: va.attention(q, k, v, plan=plan))
    qp, kp, vp = C.packed(inp, plan)

    def full():
        return va.attention(q, k, v, plan=plan, backend=backend)

    compiled = torch.compile(lambda q_, k_, v_, p_: va.attention(q_, k_, v_, plan=p_, backend=backend),
                             fullgraph=True)
    paths = {}
    kernel = C.kernel_alone(backend, plan, q.shape[-1] ** -0.5)
    if kernel is not None:
        paths["kernel alone, pre-packed"] = lambda: kernel(qp, kp, vp)
    # One output to run backward through, tied to the packs of k and v.
    paths["pack q, k, v only"] = lambda: (va.pack(q, plan, "q") + 0 * va.pack(k, plan, "k")[:0].sum()
                                          + 0 * va.pack(v, plan, "k")[:0].sum())
    paths["unpack only"] = lambda: va.unpack(qp, plan, "q")
    mask = inp.full_mask
    # Stock: what the hook replaces (the host time a varlen path must not exceed where a step is
    # host-bound).
    paths["stock masked SDPA"] = lambda: F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask).transpose(1, 2)
    paths["varlen_attn.attention, eager"] = full
    for other in filter(None, args.also.split(",")):
        paths[f"eager, backend {other}"] = functools.partial(va.attention, q, k, v, plan=plan, backend=other)
    paths["varlen_attn.attention, torch.compile'd caller"] = lambda: compiled(q, k, v, plan)

    print(f"{inp.describe()}; backend {backend}, total_q {plan.total_q}, total_k {plan.total_k}")
    print(f"{'path':<48}{'host ms/iter':>14}{'GPU ms/iter':>13}  "
          f"(median of {args.rounds} rounds, paths interleaved)")
    for label, (host, gpu) in C.interleaved(paths, device, args.rounds, args.iters).items():
        print(f"{label:<48}{host:>14.3f}{gpu:>13.3f}")
    # Where a path is host-bound, what the host issues counts: aten ops per forward + backward
    # (views included: each is a dispatcher call), and those that write memory (a kernel each).
    print(f"{'path':<48}{'aten ops fwd / bwd':>20}{'writing fwd / bwd':>19}")
    for label in ("stock masked SDPA", "varlen_attn.attention, eager"):
        (fwd, fwd_w), (bwd, bwd_w) = count_ops(paths[label])
        print(f"{label:<48}{f'{fwd} / {bwd}':>20}{f'{fwd_w} / {bwd_w}':>19}")

    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(10):
            C.fwd_bwd(full)
        C.sync(device)
    table = prof.key_averages()
    if cuda:
        print(table.table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=50))
    print(table.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=50))

    if args.cprofile:
        C.sync(device)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            C.fwd_bwd(full)
        C.sync(device)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.writing = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        # Every other op writes memory (a kernel each): views, detach and allocations launch nothing.
        self.writing += not (func.is_view or func in _NO_KERNEL)
        return out


_NO_KERNEL = {torch.ops.aten.detach.default, torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
              torch.ops.aten.empty.memory_format, torch.ops.aten._unsafe_view.default}


def count_ops(fn):
    """``((ops, writing) forward, (ops, writing) backward)`` of one call of ``fn`` and its backward."""
    C.fwd_bwd(fn)  # warm: plans, selection
    with _OpCounter() as f:
        out = fn()
    grad = torch.ones_like(out)
    with _OpCounter() as b:
        out.backward(grad)
    return (f.ops, f.writing), (b.ops, b.writing)


if __name__ == "__main__":
    main()
