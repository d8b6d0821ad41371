"""Host time of one masked attention call, forward and backward, on the CPU (not a test).

    python benchmarks/call_host_time.py                           # this checkout
    python benchmarks/call_host_time.py --checkout ../old-main    # the same, another checkout beside

A module whose forward projects q, k, v and calls ``F.scaled_dot_product_attention`` with the
mask it is given, at a size where the arithmetic costs little (B=3, 4 heads of 32, 64 tokens): the
time is the Python and dispatch work of the call. Variants: the module stock with its mask,
stock with no mask, ``enable_varlen``'d (``backend="split_sdpa"``, the CPU's auto pick), and
``enable_varlen``'d with ``auto`` and a cost table that leaves every call to stock (what a call
routed to stock costs over stock's own: no plan, no read), for
two masks: key padding ``[B, 1, 1, S]`` (Qwen-Image's form, planned with no host read) and the
padding outer product ``[B, 1, S, S]`` (Chroma's form, one host read a call). A new mask tensor
every call, as every layer of a diffusers model makes its own. One thread; the median of
``--rounds`` rounds of ``--calls`` calls each, microseconds per call. ``--checkout`` runs the same
measurement in a subprocess with another checkout's ``varlen_attn`` first on the path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

B, H, S, D = 3, 4, 64, 32
LENGTHS = (40, 64, 3)


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(H * D, 3 * H * D)

    def forward(self, x, mask=None):
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(B, S, 3, H, D).unbind(2))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, S, H * D)


def masks(kind: str):
    valid = torch.arange(S)[None] < torch.tensor(LENGTHS)[:, None]
    if kind == "key_padding":
        return lambda: valid.clone()[:, None, None, :]
    return lambda: valid.clone()[:, None, None, :] & valid.clone()[:, None, :, None]


def measure(args) -> dict:
    import varlen_attn as va

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(B, S, H * D, requires_grad=True)
    results = {"varlen_attn": os.path.dirname(va.__file__)}
    if hasattr(va, "costs"):  # a table for this CPU where stock is cheaper at every length
        import _common as C

        C.stock_cheaper_on_cpu("cpu", ("key_padding", "outer"))
    for kind in ("key_padding", "outer_product"):
        make = masks(kind)
        stock, enabled, to_stock = Attention(), Attention(), Attention()
        enabled.load_state_dict(stock.state_dict())
        to_stock.load_state_dict(stock.state_dict())
        va.enable_varlen(enabled, backend="split_sdpa")
        va.enable_varlen(to_stock)
        variants = {"stock": (stock, make), "stock, no mask": (stock, lambda: None), "enabled": (enabled, make),
                    "left to stock": (to_stock, make)}
        times = {name: [] for name in variants}
        for _ in range(3):  # warm-up
            for model, mask in variants.values():
                model(x, mask()).sum().backward()
        for _ in range(args.rounds):
            for name, (model, mask) in variants.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    model(x, mask()).sum().backward()
                times[name].append((time.perf_counter() - start) / args.calls * 1e6)
        results[kind] = {name: statistics.median(t) for name, t in times.items()}
    if hasattr(va, "costs"):
        results["left_to_stock_forward"] = left_to_stock_forward(va, args)
    return results


def left_to_stock_forward(va, args) -> dict:
    """One forward SDPA call on tiny tensors, made directly and through enable_varlen's hook with
    the call left to stock (the table above): microseconds per call, no module around it."""
    from varlen_attn import execution, hook

    stack = execution if hasattr(execution, "active") else hook  # where a checkout keeps the thread's stack
    q, mask = torch.randn(1, 1, 4, 8), torch.ones(1, 1, 1, 4, dtype=torch.bool)
    sdpa, direct = F.scaled_dot_product_attention, hook._replaced[0]
    entry = stack.Entry(va.policy.Policy.of("auto"))
    n = args.calls * 100
    times = {"direct": [], "left to stock": []}
    for _ in range(args.rounds):
        start = time.perf_counter()
        for _ in range(n):
            direct(q, q, q, attn_mask=mask)
        times["direct"].append((time.perf_counter() - start) / n * 1e6)
        with stack.active(entry):
            start = time.perf_counter()
            for _ in range(n):
                sdpa(q, q, q, attn_mask=mask)
        times["left to stock"].append((time.perf_counter() - start) / n * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--checkout", help="another checkout whose varlen_attn to measure too")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    runs = {"this checkout": measure(args)}
    if args.raw:
        print(json.dumps(runs["this checkout"]))
        return
    if args.checkout:
        env = {**os.environ, "PYTHONPATH": os.path.abspath(args.checkout)}
        out = subprocess.run([sys.executable, __file__, "--raw", "--rounds", str(args.rounds), "--calls",
                              str(args.calls)], env=env, capture_output=True, text=True, check=True)
        runs[args.checkout] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"torch {torch.__version__}, 1 thread, B={B} H={H} S={S} D={D}, lengths {LENGTHS}; "
          f"median us per call (forward + backward) over {args.rounds} rounds x {args.calls} calls")
    for label, res in runs.items():
        print(f"{label} ({res['varlen_attn']}):")
        for kind in ("key_padding", "outer_product"):
            r = res[kind]
            print(f"  {kind:14s} stock {r['stock']:7.1f}   stock, no mask {r['stock, no mask']:7.1f}   "
                  f"enabled {r['enabled']:7.1f}  ({r['enabled'] / r['stock']:.2f}x stock's time)   "
                  f"left to stock {r['left to stock']:7.1f}  ({r['left to stock'] - r['stock']:+.1f} us)")
        if "left_to_stock_forward" in res:
            r = res["left_to_stock_forward"]
            print(f"  one forward call, tiny tensors: SDPA directly {r['direct']:.2f} us, through enable_varlen "
                  f"and left to stock {r['left to stock']:.2f} us ({r['left to stock'] - r['direct']:+.2f} us)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
