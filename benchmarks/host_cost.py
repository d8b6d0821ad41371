"""Does a varlen backend slow the host's *other* work? (not a test; run on a GPU)

    python benchmarks/host_cost.py                 # stages in one process
    python benchmarks/host_cost.py --device cpu    # smoke run

A profile of a 512 px training step showed the same aten ops taking more host time in the
varlen variants than in stock (``aten::mul`` 18 us per call for stock, 35 us with FA4;
``cudaLaunchKernel`` 6.0 and 10.3 us). This script separates the candidates. It times a fixed
host-bound workload (small ops with autograd, forward and backward, no sync inside the loop:
microseconds of host time per op) at stages of one process:

  0. CUDA initialised, nothing else;
  1. after varlen_attn's ``torch`` backend ran (PyTorch's own varlen kernel);
  2. after ``import flash_attn.cute`` (FA4's runtime loaded);
  3. after one FA4 call, forward and backward (its kernels compiled and loaded);
  4. the same, one second later (background threads settled);
  5. after ``gc.collect()`` and ``gc.freeze()`` (the Python heap FA4 left, out of the collector).

At each stage it also reports the process's thread count, the CPU time other threads used while
the workload ran, and the number of objects the garbage collector tracks. Medians of 9 rounds.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch

import _common as C
import varlen_attn as va


def cpu_of_threads() -> dict[str, float]:
    """CPU seconds (user + system) used so far by each thread of this process."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[tid] = (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            continue
    return out


def workload(device: torch.device, n: int = 400):
    """``n`` small ops with autograd, then their backward: host time per op in us."""
    w = torch.randn(64, 64, device=device, requires_grad=True)
    x = torch.randn(8, 64, device=device)
    C.sync(device)
    t0 = time.perf_counter()
    y = x
    for _ in range(n // 4):
        y = (y @ w).mul(0.5).add(1.0).tanh()
    y.sum().backward()
    host = time.perf_counter() - t0
    C.sync(device)
    return host / n * 1e6


def measure(label: str, device: torch.device, rounds: int = 9) -> dict:
    me = str(os.getpid())
    for _ in range(3):
        workload(device)
    before = cpu_of_threads()
    t0 = time.perf_counter()
    us = statistics.median(workload(device) for _ in range(rounds))
    wall = time.perf_counter() - t0
    after = cpu_of_threads()
    others = sum(after[t] - before.get(t, 0.0) for t in after if t != me)
    row = {"stage": label, "us_per_op": round(us, 2), "threads": len(after),
           "other_threads_cpu_s": round(others, 3), "wall_s": round(wall, 3),
           "gc_objects": len(gc.get_objects())}
    print(f"{label:55s} {us:7.2f} us/op  threads {len(after):3d}  other threads' CPU {others:6.3f} s "
          f"in {wall:5.2f} s  gc objects {row['gc_objects']}")
    return row


def one_call(backend: str, device: torch.device) -> None:
    inp = C.make_inputs("chroma512" if device.type == "cuda" else "tiny", device)
    plan = va.build_plan(inp.full_mask, convention="torch")
    q, k, v = (t.detach().requires_grad_() for t in (inp.q, inp.k, inp.v))
    va.attention(q, k, v, plan=plan, backend=backend).sum().backward()
    C.sync(device)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_device_argument(ap)
    args = ap.parse_args()
    device = C.device_of(args)
    torch.zeros(1, device=device)
    measure("0 CUDA initialised", device)
    if device.type != "cuda":
        one_call("split_sdpa", device)
        measure("1 after a split_sdpa call", device)
        return
    one_call("torch", device)
    measure("1 after the torch backend ran", device)
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError as e:
        print(f"flash_attn.cute not importable ({e}); stages 2-5 skipped")
        return
    measure("2 after import flash_attn.cute", device)
    one_call("flash_attn_4", device)
    measure("3 after one FA4 call (fwd + bwd)", device)
    time.sleep(1.0)
    measure("4 one second later", device)
    gc.collect()
    gc.freeze()
    measure("5 after gc.collect() + gc.freeze()", device)
    gc.unfreeze()


if __name__ == "__main__":
    main()
