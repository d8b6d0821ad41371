"""Where a step waits: one profiled step's timeline (torch.profiler, CPU and CUDA), read back from
its Chrome trace and summed up per launching thread and per slice of the step.

Used by ``train_step.py --timeline DIR``. Without flags it summarises traces already written:

    python benchmarks/timeline.py trace_stock.json trace_varlen.json

What it reports, per trace (times from the step's first host event to the GPU's last end):
  - per thread that launched GPU work: launches, the span from its first to its last launch, the
    GPU time of its work, and the median and 90th percentile of the *lag* (a kernel's GPU start
    minus its launch call's start). A lag near zero means the GPU waited for this thread (host
    bound); a lag that grows means work piled up (GPU bound);
  - the step in 10 equal slices: GPU busy share and the median lag of the work starting there;
  - host waits: CUDA runtime calls that block the host (synchronize, a synchronous copy), their
    count, total and the longest with the op that made them;
  - the tail: GPU time after the host's last event (what the final synchronize waits for).
"""

from __future__ import annotations

import bisect
import json
import statistics
import sys

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")
BLOCKING = ("Synchronize", "cudaMemcpy", "cuMemcpyDtoH", "cuMemcpyHtoD", "cudaFree", "cuMemFree")


def _blocking(name: str) -> bool:
    if "Async" in name:
        return False
    return any(b in name for b in BLOCKING)


def merged(spans) -> float:
    """Length of the union of ``(start, end)`` spans."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(path: str, slices: int = 10) -> dict:
    """The summary above, as a dict (times in ms)."""
    with open(path) as fh:
        events = json.load(fh)["traceEvents"]
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    gpu = [e for e in xs if e.get("cat") in GPU_CATS]
    host = [e for e in xs if e.get("cat") in HOST_CATS]
    runtime = [e for e in host if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    if not gpu or not host:
        return {"error": f"{len(gpu)} GPU and {len(host)} host events in {path}"}
    launch = {e["args"]["correlation"]: e for e in runtime if "correlation" in e.get("args", {})}
    t0 = min(e["ts"] for e in host)
    host_end = max(e["ts"] + e["dur"] for e in host)
    gpu_end = max(e["ts"] + e["dur"] for e in gpu)
    end = max(host_end, gpu_end)
    wall = end - t0

    # Per launching thread.
    threads: dict = {}
    lags = []  # (gpu start, lag, dur)
    for g in gpu:
        src = launch.get(g.get("args", {}).get("correlation"))
        if src is None:
            continue
        lag = g["ts"] - src["ts"]
        lags.append((g["ts"], lag, g["dur"]))
        t = threads.setdefault(src["tid"], {"launches": 0, "first": src["ts"], "last": src["ts"], "gpu": [], "lags": []})
        t["launches"] += 1
        t["first"], t["last"] = min(t["first"], src["ts"]), max(t["last"], src["ts"])
        t["gpu"].append((g["ts"], g["ts"] + g["dur"]))
        t["lags"].append(lag)
    per_thread = []
    for tid, t in sorted(threads.items(), key=lambda kv: kv[1]["first"]):
        per_thread.append({"tid": tid, "launches": t["launches"], "span_ms": (t["last"] - t["first"]) / 1e3,
                           "starts_at_ms": (t["first"] - t0) / 1e3, "gpu_ms": merged(t["gpu"]) / 1e3,
                           "lag_median_ms": statistics.median(t["lags"]) / 1e3, "lag_p90_ms": _pct(t["lags"], 0.9) / 1e3})

    # Slices of the step.
    width = wall / slices
    spans = [(g["ts"], g["ts"] + g["dur"]) for g in gpu]
    cuts = []
    for i in range(slices):
        a, b = t0 + i * width, t0 + (i + 1) * width
        busy = merged([(max(x, a), min(y, b)) for x, y in spans if y > a and x < b])
        here = [lag for s, lag, _ in lags if a <= s < b]
        cuts.append({"busy": busy / width, "lag_median_ms": statistics.median(here) / 1e3 if here else None})

    # Host waits, with the op around each.
    by_tid: dict = {}
    for e in host:
        if e.get("cat") in ("cpu_op", "python_function", "user_annotation"):
            by_tid.setdefault(e["tid"], []).append(e)
    for lst in by_tid.values():
        lst.sort(key=lambda e: e["ts"])

    def around(e):
        lst = by_tid.get(e["tid"], [])
        i = bisect.bisect_right([x["ts"] for x in lst], e["ts"])
        best = None
        for x in lst[max(0, i - 400):i]:
            if x["ts"] <= e["ts"] and x["ts"] + x["dur"] >= e["ts"] + e["dur"]:
                if best is None or x["dur"] < best["dur"]:
                    best = x
        return best["name"] if best else "?"

    waits = sorted((e for e in runtime if _blocking(e["name"])), key=lambda e: -e["dur"])
    top = [{"name": w["name"], "ms": w["dur"] / 1e3, "at_ms": (w["ts"] - t0) / 1e3, "tid": w["tid"], "in": around(w)}
           for w in waits[:6]]
    return {"wall_ms": wall / 1e3, "gpu_busy_ms": merged(spans) / 1e3, "host_end_ms": (host_end - t0) / 1e3,
            "tail_ms": max(0.0, gpu_end - host_end) / 1e3, "threads": per_thread, "slices": cuts,
            "waits": {"count": len(waits), "ms": sum(w["dur"] for w in waits) / 1e3, "longest": top}}


def describe(name: str, s: dict) -> str:
    if "error" in s:
        return f"  {name}: {s['error']}"
    out = [f"  {name}: step {s['wall_ms']:.1f} ms (profiled), GPU busy {s['gpu_busy_ms']:.1f} ms, host done at "
           f"{s['host_end_ms']:.1f} ms, GPU tail after it {s['tail_ms']:.1f} ms; host waits {s['waits']['count']} "
           f"({s['waits']['ms']:.1f} ms)"]
    for t in s["threads"]:
        out.append(f"    thread {t['tid']}: {t['launches']} launches from {t['starts_at_ms']:.1f} ms over "
                   f"{t['span_ms']:.1f} ms, their GPU time {t['gpu_ms']:.1f} ms, lag median {t['lag_median_ms']:.2f} "
                   f"p90 {t['lag_p90_ms']:.2f} ms")
    out.append("    slices (GPU busy, median lag ms): " + "  ".join(
        f"{c['busy']:.0%}/{c['lag_median_ms']:.1f}" if c["lag_median_ms"] is not None else f"{c['busy']:.0%}/-"
        for c in s["slices"]))
    for w in s["waits"]["longest"]:
        out.append(f"    wait {w['name']} {w['ms']:.2f} ms at {w['at_ms']:.1f} ms (thread {w['tid']}, in {w['in']})")
    return "\n".join(out)


def record(step, path: str) -> None:
    """Profile one call of ``step()`` (CPU and CUDA) and write its Chrome trace to ``path``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(describe(p, summarize(p)))
