"""What the benchmark scripts share: shapes, inputs, timing, the kernels alone, the environment,
and the timeline of one profiled step (``train_step.py --timeline``).

Scripts run as ``python benchmarks/<name>.py``; Python then puts this folder first on
``sys.path``, so ``import _common`` needs no path set-up. Only varlen_attn's public API is used.

Every script takes ``--device cpu``: a smoke run on the ``tiny`` shape that checks the script
still runs end to end. Its timings are CPU wall times of toy sizes and mean nothing.
"""

from __future__ import annotations

import argparse
import bisect
import importlib
import importlib.metadata
import json
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import varlen_attn as va


@dataclass(frozen=True)
class Shape:
    """A joint [text; image] batch: text padded to ``text`` tokens, ``lengths`` of them valid per
    sample; every image token valid. ``cross``: image queries attend to the padded text only."""

    batch: int
    text: int
    image: int
    lengths: tuple[int, ...]
    cross: bool = False
    heads: int = 24
    head_dim: int = 128


SHAPES = {
    # Chroma at 1024 px and 512 px, batch 3; the third prompt is near caption dropout.
    "chroma1024": Shape(3, 512, 4096, (77, 300, 2)),
    "chroma512": Shape(3, 512, 1024, (77, 300, 2)),
    # Qwen-Image at 1024 px: its text padded to the batch's longest prompt (key padding).
    "qwen1024": Shape(3, 300, 4096, (77, 300, 2)),
    "video": Shape(1, 256, 19968, (200,)),
    "cross": Shape(3, 300, 4096, (20, 120, 1), cross=True),
    "tiny": Shape(3, 16, 48, (5, 12, 0), heads=2, head_dim=32),  # --device cpu smoke runs
}


def add_device_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cuda (default), or cpu: a smoke run on the tiny shape; its timings mean nothing")


def device_of(args: argparse.Namespace) -> torch.device:
    """The device asked for; a clear exit when it is a GPU and there is none."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU; `--device cpu` runs a smoke test of the script")
    if device.type == "cpu":
        print("CPU smoke run: checks that the script runs; the timings below mean nothing.")
        # Toy sizes gain nothing from threads; on a busy 2-core machine the pool slowed SDPA 100x.
        torch.set_num_threads(1)
    return device


def shape_names(arg: str | None, device: torch.device, default: str) -> list[str]:
    """``--shapes`` as a list: the argument, else ``default`` on a GPU and ``tiny`` on the CPU."""
    names = (arg or (default if device.type == "cuda" else "tiny")).split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shape(s) {unknown}; known: {sorted(SHAPES)}")
    return names


@dataclass
class Inputs:
    """q ``[B, Sq, H, D]``, k and v ``[B, Sk, H, D]`` (leaves that require grad) and which tokens
    are valid: ``q_keep [B, Sq]``, ``k_keep [B, Sk]`` (bool)."""

    name: str
    shape: Shape
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_keep: torch.Tensor
    k_keep: torch.Tensor

    @property
    def full_mask(self) -> torch.Tensor:
        """``[B, 1, Sq, Sk]`` bool: Chroma's outer-product mask (padded queries get zero rows)."""
        return self.q_keep[:, None, :, None] & self.k_keep[:, None, None, :]

    @property
    def key_padding(self) -> torch.Tensor:
        """``[B, 1, 1, Sk]`` bool."""
        return self.k_keep[:, None, None, :]

    def describe(self) -> str:
        b, sq, h, d = self.q.shape
        return (f"{self.name}: B={b} Sq={sq} Sk={self.k.shape[1]} H={h} D={d} {self.q.dtype}, "
                f"text lengths {list(self.shape.lengths)}, valid q/k "
                f"{int(self.q_keep.sum())}/{int(self.k_keep.sum())}")


def text_keep(shape: Shape, device) -> torch.Tensor:
    """``[B, T]`` bool: the valid text tokens."""
    return torch.arange(shape.text, device=device)[None] < torch.tensor(shape.lengths, device=device)[:, None]


def joint_keep(shape: Shape, device) -> torch.Tensor:
    """``[B, T + N]`` bool: valid text tokens, then the image tokens (all valid)."""
    image = torch.ones(shape.batch, shape.image, dtype=torch.bool, device=device)
    return torch.cat([text_keep(shape, device), image], 1)


def make_inputs(name: str, device: torch.device, dtype: torch.dtype | None = None, seed: int = 0) -> Inputs:
    """Random q, k, v for ``SHAPES[name]``: bf16 on a GPU, float32 on the CPU unless ``dtype``."""
    shape = SHAPES[name]
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    b, h, d = shape.batch, shape.heads, shape.head_dim
    if shape.cross:  # queries: image tokens (all valid); keys and values: padded text
        sq, sk = shape.image, shape.text
        q_keep = torch.ones(b, sq, dtype=torch.bool, device=device)
        k_keep = text_keep(shape, device)
    else:
        sq = sk = shape.text + shape.image
        q_keep = k_keep = joint_keep(shape, device)
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, device=device, dtype=dtype, generator=g).requires_grad_()
               for s in (sq, sk, sk))
    return Inputs(name, shape, q, k, v, q_keep, k_keep)


def packed(inp: Inputs, plan: va.VarlenPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v packed once by ``plan`` into ``[total, H, D]`` leaves: the kernels' own inputs."""
    return tuple(va.pack(x.detach(), plan, which).requires_grad_()
                 for x, which in ((inp.q, "q"), (inp.k, "k"), (inp.v, "k")))


# ------------------------------------------------------------------------------------------ timing

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """``.ms`` of the work issued inside the block: CUDA events on a GPU (waits for them at the
    end of the block), wall time on the CPU (where ops run as they are called)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.ms = float("nan")

    def __enter__(self):
        if self.cuda:
            self._start, self._end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self._end.record()
            torch.cuda.synchronize()
            self.ms = self._start.elapsed_time(self._end)
        else:
            self.ms = (time.perf_counter() - self._t0) * 1e3
        return False


def fwd_bwd(fn):
    """``fn()`` then a backward of ones through its output."""
    out = fn()
    out.backward(torch.ones_like(out))


def median_ms(fn, device: torch.device, *, backward: bool = False, warmup: int = 3, reps: int = 20) -> float:
    """Median ms of ``fn()`` (and its backward when ``backward``) over ``reps`` calls after
    ``warmup``; synchronised before and after each call."""
    times = []
    for i in range(warmup + reps):
        sync(device)
        with Stopwatch(device) as sw:
            if backward:
                fwd_bwd(fn)
            else:
                fn()
        if i >= warmup:
            times.append(sw.ms)
    return statistics.median(times)


def gpu_ms(fn, device: torch.device, *, calls: int = 10, rounds: int = 5) -> float:
    """Median over ``rounds`` of the GPU time per forward + backward of ``fn()``, host excluded:
    the GPU first sleeps long enough for the host to queue all ``calls`` (CUDA events then see
    the kernels back to back). Wall time per call on the CPU."""
    fwd_bwd(fn)
    times = []
    for _ in range(rounds):
        sync(device)
        if device.type == "cuda":
            torch.cuda._sleep(int(2e6 * 100))  # ~100 ms at ~2 GHz
        with Stopwatch(device) as sw:
            for _ in range(calls):
                fwd_bwd(fn)
        times.append(sw.ms / calls)
    return statistics.median(times)


def kernel_profile(fn, device: torch.device, calls: int = 3, top: int = 25) -> str:
    """The GPU kernels of ``calls`` forward + backward calls of ``fn()``, by total time (the
    torch profiler's table), and the number of kernels a call launches."""
    from torch.profiler import ProfilerActivity, profile

    fwd_bwd(fn)
    sync(device)
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fwd_bwd(fn)
        sync(device)
    def self_time(r):
        return r.self_device_time_total if cuda else r.self_cpu_time_total

    rows = [r for r in prof.key_averages() if self_time(r) > 0]
    per_call = sum(self_time(r) for r in rows) / calls / 1e3
    launches = sum(r.count for r in rows) / calls
    head = f"{launches:.0f} kernels a call, {per_call:.3f} ms of kernel time a call\n"
    return head + prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=top,
                                            max_name_column_width=70)


def peak_extra_mib(fn, device: torch.device, base_bytes: int) -> float:
    """Peak memory of one forward + backward above ``base_bytes`` (the inputs), MiB; NaN off a GPU."""
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd(fn)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base_bytes) / 2**20


def host_and_device_ms(fn, device: torch.device, iters: int = 30, warmup: int = 5) -> tuple[float, float]:
    """``(host, device)`` ms per forward + backward over ``iters`` back-to-back iterations with no
    sync inside the loop. Host: the time Python took to issue them. Device: CUDA events around
    the loop (NaN on the CPU). Host >= device means the GPU waits on Python and launches."""
    for _ in range(warmup):
        fwd_bwd(fn)
    sync(device)
    with Stopwatch(device) as sw:
        t0 = time.perf_counter()
        for _ in range(iters):
            fwd_bwd(fn)
        host = (time.perf_counter() - t0) / iters * 1e3
    return host, (sw.ms / iters if device.type == "cuda" else float("nan"))


def interleaved(paths: dict, device: torch.device, rounds: int = 7, iters: int = 30) -> dict:
    """``{label: (host ms, device ms)}``: medians over ``rounds`` of :func:`host_and_device_ms`,
    the paths taken in turn each round so that drift (clocks, heat) hits every path alike."""
    samples = {label: [] for label in paths}
    for _ in range(rounds):
        for label, fn in paths.items():
            samples[label].append(host_and_device_ms(fn, device, iters))
    return {label: (statistics.median(x[0] for x in xs), statistics.median(x[1] for x in xs))
            for label, xs in samples.items()}


def plan_build_ms(mask: torch.Tensor, device: torch.device, reps: int = 5, **kwargs) -> float:
    """Median ms of a real :func:`varlen_attn.build_plan` of ``mask`` (``cache=False``: never a
    cache hit, and the cache is left as it was)."""
    return median_ms(lambda: va.build_plan(mask, cache=False, **kwargs), device, warmup=1, reps=reps)


def backend_of(fn) -> str:
    """The backend(s) that ran in one call of ``fn`` (from ``varlen_attn.stats()``, which this
    resets), with any fallback to masked SDPA named."""
    va.reset_stats()
    fn()
    st = va.stats()
    va.reset_stats()
    names = ", ".join(st["backends"]) or "none"
    return names + (f" (fallbacks: {st['fallbacks']})" if st["fallbacks"] else "")


# ------------------------------------------------------------------------------ the kernels alone

# varlen_attn backend name -> the module whose flash_attn_varlen_func it calls.
_FLASH_MODULES = {"flash_attn_4": "flash_attn.cute", "flash_attn_3": "flash_attn_interface",
                  "flash_attn": "flash_attn.flash_attn_interface"}


def stock_cheaper_on_cpu(kernel: str, layouts: tuple[str, ...] = ("key_padding",)) -> None:
    """Make auto leave every masked float32 call on the CPU to stock's SDPA on ``kernel`` (a cost
    table where stock costs half of packing at every length): for measuring what a call routed to
    stock costs on the host (call_host_time.py, forward_host_time.py)."""
    row = {"tokens": [1, 1 << 20], "routes": {f"sdpa:{kernel}": {"cost": [1, 1]}, "split_sdpa": {"cost": [2, 2]}}}
    va.costs.use([{"gpu": "cpu", "capability": None, "dtype": "float32", "layouts": {name: row for name in layouts}}])


def varlen_backends(device: torch.device) -> list[str]:
    """Installed varlen_attn backends for ``device`` in auto's order, without the slow reference."""
    return [n for n in va.available_backends(device) if n != "reference"]


def kernel_alone(name: str, plan: va.VarlenPlan, scale: float):
    """``fn(q, k, v) -> out`` on pre-packed ``[total, H, D]`` tensors: the kernel behind
    varlen_attn's backend ``name``, called directly as its vendor ships it (no varlen_attn code),
    with the plan's cu_seqlens. The floor that pack + kernel + unpack is measured against.
    None for a backend without such a kernel (the reference)."""
    if name in _FLASH_MODULES:
        func = importlib.import_module(_FLASH_MODULES[name]).flash_attn_varlen_func
        kw = dict(cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_k=plan.cu_seqlens_k,
                  max_seqlen_q=plan.max_seqlen_q, max_seqlen_k=plan.max_seqlen_k, softmax_scale=scale)

        def flash(q, k, v):
            out = func(q, k, v, **kw)
            return out[0] if isinstance(out, tuple) else out  # FA3 betas and FA4 return (out, lse)

        return flash
    if name == "torch":  # the aten kernel under torch.nn.attention.varlen (what the backend calls)
        fwd = torch.ops.aten._flash_attention_forward.default
        return lambda q, k, v: fwd(q, k, v, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q,
                                   plan.max_seqlen_k, 0.0, False, False, scale=scale)[0]
    if name == "split_sdpa":  # one dense SDPA call per segment, cut by torch.split
        lq, lk = list(plan.seqlens_q), list(plan.seqlens_k)

        def per_segment(q, k, v):
            outs = [F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in seg), scale=scale)[0]
                    .transpose(0, 1) for seg in zip(q.split(lq), k.split(lk), v.split(lk))]
            return torch.cat(outs)

        return per_segment
    return None


# -------------------------------------------------------------------------------- the environment

def pyplot(path: str):
    """matplotlib's pyplot on the Agg backend, or None (saying the chart ``path`` is skipped)
    where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--png {path}: skipped, matplotlib is not installed")
        return None
    return plt


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict:
    """What a result depends on: the device, torch, CUDA, the attention packages' versions and the
    varlen_attn backends installed for the device."""
    return {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "varlen_attn": va.__version__,
        "varlen_attn_path": os.path.dirname(va.__file__),  # which checkout (before/after runs)
        "flash_attn_4": _version("flash-attn-4"),
        "flash_attn": _version("flash-attn"),
        "diffusers": _version("diffusers"),
        "backends": va.available_backends(device),
    }


# ------------------------------------------------------------- the timeline of one profiled step

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")
BLOCKING = ("Synchronize", "cudaMemcpy", "cuMemcpyDtoH", "cuMemcpyHtoD", "cudaFree", "cuMemFree")


def _blocking_call(name: str) -> bool:
    if "Async" in name:
        return False
    return any(b in name for b in BLOCKING)


def union_ms(spans) -> float:
    """Length of the union of ``(start, end)`` spans (in their unit)."""
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


def timeline_summary(path: str, slices: int = 10) -> dict:
    """A profiled step's Chrome trace at ``path`` summed up (times in ms, from the step's first
    host event to the GPU's last end): per thread that launched GPU work its launches, their GPU
    time and the *lag* (a kernel's GPU start minus its launch call's start: near zero, the GPU
    waited for this thread; growing, work piled up); the step in ``slices`` equal slices (GPU busy
    share, median lag); the host's blocking CUDA calls, with the op around the longest; the GPU's
    tail after the host's last event (what the final synchronize waits for)."""
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
                           "starts_at_ms": (t["first"] - t0) / 1e3, "gpu_ms": union_ms(t["gpu"]) / 1e3,
                           "lag_median_ms": statistics.median(t["lags"]) / 1e3, "lag_p90_ms": _pct(t["lags"], 0.9) / 1e3})

    # Slices of the step.
    width = wall / slices
    spans = [(g["ts"], g["ts"] + g["dur"]) for g in gpu]
    cuts = []
    for i in range(slices):
        a, b = t0 + i * width, t0 + (i + 1) * width
        busy = union_ms([(max(x, a), min(y, b)) for x, y in spans if y > a and x < b])
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

    # Host time per op (self time: an op's duration less its children's on the same thread), per
    # thread that ran ops, the largest first: where the host's time goes.
    self_ms: dict = {}
    for tid, lst in by_tid.items():
        ops = ([e for e in lst if e.get("cat") in ("cpu_op", "python_function")]
               + [e for e in runtime if e["tid"] == tid])
        ops.sort(key=lambda e: (e["ts"], -e["dur"]))
        acc: dict = {}
        stack: list = []  # [end, name, child time, duration]
        top_level = 0.0
        for e in ops + [None]:
            while stack and (e is None or e["ts"] >= stack[-1][0]):
                end, name, child, dur = stack.pop()
                acc[name] = acc.get(name, 0.0) + max(0.0, dur - child)  # skewed clocks: never below 0
                if stack:
                    stack[-1][2] += dur
                else:
                    top_level += dur
            if e is not None:
                stack.append([e["ts"] + e["dur"], e["name"], 0.0, e["dur"]])
        if acc:
            total = sum(acc.values())
            span = max(e["ts"] + e["dur"] for e in ops) - ops[0]["ts"]
            largest = sorted(acc.items(), key=lambda kv: -kv[1])[:12]
            self_ms[tid] = {"total_ms": total / 1e3, "outside_ms": (span - top_level) / 1e3,
                            "top": [(n, v / 1e3) for n, v in largest]}

    waits = sorted((e for e in runtime if _blocking_call(e["name"])), key=lambda e: -e["dur"])
    top = [{"name": w["name"], "ms": w["dur"] / 1e3, "at_ms": (w["ts"] - t0) / 1e3, "tid": w["tid"], "in": around(w)}
           for w in waits[:6]]
    return {"wall_ms": wall / 1e3, "gpu_busy_ms": union_ms(spans) / 1e3, "host_end_ms": (host_end - t0) / 1e3,
            "tail_ms": max(0.0, gpu_end - host_end) / 1e3, "threads": per_thread, "slices": cuts,
            "waits": {"count": len(waits), "ms": sum(w["dur"] for w in waits) / 1e3, "longest": top},
            "self_ms": self_ms}


def timeline_text(name: str, s: dict) -> str:
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
    for tid, t in s.get("self_ms", {}).items():
        out.append(f"    thread {tid}: ops' self time {t['total_ms']:.1f} ms, between ops (Python) "
                   f"{t['outside_ms']:.1f} ms; largest: "
                   + ", ".join(f"{n} {v:.1f}" for n, v in t["top"]))
    return "\n".join(out)


def timeline_record(step, path: str, stack: bool = False) -> None:
    """Profile one call of ``step()`` (CPU and CUDA) and write its Chrome trace to ``path``;
    ``stack``: Python functions too (their self time in :func:`timeline_summary`; slower)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stack) as prof:
        step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
