"""Probe: PyTorch's cuDNN attention on packed (ragged) tokens, against its FA2 varlen kernel.

    python benchmarks/cudnn_varlen_probe.py [--json out.json]

Not a test. torch ships cuDNN's fused attention with a ragged (``cum_seq_q``/``cum_seq_k``)
entry point, ``aten::_cudnn_attention_forward`` / ``_backward`` (what nested-tensor SDPA calls).
Before a backend calls it, this answers on the GPU at hand:
  - correctness: out, dq, dk, dv against a float32 reference per segment, next to the same
    error of the built-in FA2 varlen kernel (``aten::_flash_attention_forward``) on the same
    inputs, over shapes of the models (Chroma, Qwen-Image at 512 and 1024 px), cross attention,
    a query segment of length 0, segments of length 1 and of S % 128 == 64, GQA, head dims 64
    and 256, float16;
  - speed: forward+backward median (CUDA events) of both kernels, and the cost of the first call
    with new segment lengths (cuDNN builds an execution graph per problem it has not seen).
Each case runs in its own process, so a crash (an illegal memory access ends the CUDA context)
is reported as that case's result and the others still run.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

import torch

import _common as C

CASES = {
    # name: (lengths_q, lengths_k, heads_q, heads_k, head_dim, dtype)
    "chroma512": ([1101, 1324, 1026], None, 24, 24, 128, "bfloat16"),
    "chroma1024": ([4173, 4396, 4098], None, 24, 24, 128, "bfloat16"),
    "odd_lengths": ([64, 192, 1, 320, 7], None, 4, 4, 64, "bfloat16"),
    "cross": ([4096, 4096, 4096], [77, 300, 2], 24, 24, 128, "bfloat16"),
    "empty_query_segment": ([0, 100, 33], [50, 100, 1], 4, 4, 128, "bfloat16"),
    "gqa": ([300, 517], None, 8, 2, 128, "bfloat16"),
    "head_dim_256": ([300, 17], None, 4, 4, 256, "bfloat16"),
    "float16": ([1101, 1324, 1026], None, 8, 8, 128, "float16"),
    "single_token": ([1], None, 2, 2, 64, "bfloat16"),
}
TIMED = ("chroma512", "chroma1024", "cross")


def _cu(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _reference(q, k, v, lq, lk, scale):
    """float32 attention per segment, with autograd; q [T, Hq, D]."""
    hq, hk = q.shape[1], k.shape[1]
    outs, oq, ok = [], 0, 0
    for a, b in zip(lq, lk):
        qs, ks, vs = q[oq:oq + a].float(), k[ok:ok + b].float(), v[ok:ok + b].float()
        if hq != hk:
            ks, vs = ks.repeat_interleave(hq // hk, 1), vs.repeat_interleave(hq // hk, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vs))
        oq, ok = oq + a, ok + b
    return torch.cat(outs)


def _fa2(q, k, v, cq, ck, mq, mk, scale, dout):
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(q, k, v, cq, ck, mq, mk, 0.0, False, False,
                                                                       scale=scale)
    grads = torch.ops.aten._flash_attention_backward(dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, False, rng,
                                                     unused, scale=scale)
    return out, grads


def _cudnn(q, k, v, cq, ck, mq, mk, scale, dout):
    out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cq, ck, mq, mk, True, 0.0, False, False, scale=scale)
    grads = torch.ops.aten._cudnn_attention_backward(dout, q, k, v, out, lse, seed, offset, None, cq, ck, mq, mk,
                                                     0.0, False, scale=scale)
    return out, grads


def run_case(name):
    lq, lk, hq, hk, d, dtype = CASES[name]
    lk = lk or lq
    dtype = getattr(torch, dtype)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(sum(lq), hq, d, device=dev, dtype=dtype, generator=g)
    k = torch.randn(sum(lk), hk, d, device=dev, dtype=dtype, generator=g)
    v = torch.randn(sum(lk), hk, d, device=dev, dtype=dtype, generator=g)
    dout = torch.randn(sum(lq), hq, d, device=dev, dtype=dtype, generator=g)
    cq, ck, mq, mk = _cu(lq, dev), _cu(lk, dev), max(lq), max(lk)
    scale = 1 / math.sqrt(d)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = _reference(qr, kr, vr, lq, lk, scale)
    ref.backward(dout.float())
    want = (ref.detach(), qr.grad, kr.grad, vr.grad)
    result = {"case": name, "lengths_q": lq, "lengths_k": lk, "heads": [hq, hk], "head_dim": d, "dtype": str(dtype)}
    for label, fn in (("fa2", _fa2), ("cudnn", _cudnn)):
        try:
            out, grads = fn(q, k, v, cq, ck, mq, mk, scale, dout)
            torch.cuda.synchronize()
            errs = {}
            for part, got, ref_t in zip(("out", "dq", "dk", "dv"), (out, *grads), want):
                denom = ref_t.abs().max().item() or 1.0
                errs[part] = (got.float() - ref_t).abs().max().item() / denom
                errs[part + "_finite"] = bool(torch.isfinite(got).all())
            result[label] = errs
        except Exception as exc:  # reported, not hidden
            result[label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    if name in TIMED and "error" not in result["cudnn"]:
        for label, fn in (("fa2", _fa2), ("cudnn", _cudnn)):
            result[label]["fwd_bwd_ms"] = C.median_ms(lambda fn=fn: fn(q, k, v, cq, ck, mq, mk, scale, dout), dev,
                                                      warmup=5, reps=30)
        # First call with segment lengths not seen before (a training step's new prompt lengths).
        firsts = {"fa2": [], "cudnn": []}
        for i in range(4):
            lens = [x + 3 * (i + 1) for x in lq]
            lens_k = lens if CASES[name][1] is None else [x + i + 1 for x in lk]
            q2 = torch.randn(sum(lens), hq, d, device=dev, dtype=dtype)
            k2 = torch.randn(sum(lens_k), hk, d, device=dev, dtype=dtype)
            v2 = torch.randn_like(k2)
            do2 = torch.randn_like(q2)
            args = (q2, k2, v2, _cu(lens, dev), _cu(lens_k, dev), max(lens), max(lens_k), scale, do2)
            for label, fn in (("fa2", _fa2), ("cudnn", _cudnn)):
                C.sync(dev)
                with C.Stopwatch(dev) as sw:
                    fn(*args)
                firsts[label].append(round(sw.ms, 3))
        for label in firsts:
            result[label]["first_call_new_lengths_ms"] = firsts[label]
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--case")
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case)))
        return
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
           "gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability())}
    print(json.dumps(env))
    results = []
    for name in CASES:
        try:
            proc = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True, text=True,
                                  timeout=args.timeout)
            if proc.returncode == 0:
                res = json.loads(proc.stdout.strip().splitlines()[-1])
            else:
                res = {"case": name, "crashed": proc.returncode, "stderr": proc.stderr[-800:]}
        except subprocess.TimeoutExpired:
            res = {"case": name, "crashed": "timeout"}
        print(json.dumps(res))
        results.append(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
