"""Train a Chroma a few steps with padded prompts and caption dropout: stock vs varlen_attn.

The same random-initialised ChromaTransformer2DModel (joint [text; image] sequence, text padded
to a fixed length, one prompt in four dropped) is trained twice from the same weights on the
same batches: once with diffusers' stock attention (masked SDPA), once after
``varlen_attn.enable_varlen(model)``. Prints both loss curves side by side and ends with one
verdict line: whether varlen_attn's first-step output and gradients equal stock's, on which
backend, and how many plan builds per step.

CPU (the default without a GPU): a tiny model in float64, where the two must agree to rounding
(worst relative difference <= 1e-10). No timings: the CPU backends exist for correctness.
GPU: bf16 at a size where attention matters (width 3072, 24 heads, batch 3, 512 text tokens +
the 1024 image tokens of a 512 px image). In bf16 "equal" means: varlen_attn's output, and its
gradients, are at most twice as far from a float32 run of the same step as stock's are. Also
prints the median step time of each and their ratio.

    python examples/train_chroma.py                  # CPU, float64, a few seconds
    python examples/train_chroma.py --steps 20       # longer
    python examples/train_chroma.py --width 1024 --heads 8 --text 128 --image 1024   # other sizes
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import time
import warnings

import torch

import varlen_attn as va

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
# model and batch sizes: width, heads, batch, padded text tokens, image tokens, text and image channels
SIZES = {"cpu": dict(width=64, heads=4, batch=4, text=24, image=64, joint_dim=32, in_channels=16),
         "cuda": dict(width=3072, heads=24, batch=3, text=512, image=1024, joint_dim=4096, in_channels=64)}
FLOAT64_TOL = 1e-10  # float64: stock and varlen_attn must agree to rounding
LOW_PRECISION_FACTOR = 2.0  # below float64: at most this many times as far from a finer run as stock


def make_model(device, dtype, width, heads, joint_dim, in_channels, seed=0):
    from diffusers import ChromaTransformer2DModel

    torch.manual_seed(seed)
    head_dim = width // heads
    model = ChromaTransformer2DModel(
        patch_size=1, in_channels=in_channels, num_layers=2, num_single_layers=2, attention_head_dim=head_dim,
        num_attention_heads=heads, joint_attention_dim=joint_dim,
        axes_dims_rope=(head_dim // 4, head_dim // 4, head_dim // 2),
        approximator_num_channels=8, approximator_hidden_dim=32, approximator_layers=1)
    return cast(model, device, dtype)


def cast(model, device, dtype):
    # diffusers warns on every dtype cast of a model built in code, though this one keeps no
    # module in float32; quiet for the call.
    modeling = logging.getLogger("diffusers.models.modeling_utils")
    level = modeling.level
    modeling.setLevel(logging.ERROR)
    try:
        return model.to(device, dtype)
    finally:
        modeling.setLevel(level)


def make_batches(steps, batch, text, image, joint_dim, in_channels, device, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(1, text + 1, (batch,), generator=g)
        lengths[torch.rand(batch, generator=g) < 0.25] = 0  # caption dropout: empty prompt
        keep_text = torch.arange(text)[None] < lengths[:, None]
        mask = torch.cat([keep_text, torch.ones(batch, image, dtype=torch.bool)], 1)
        out.append(dict(
            hidden_states=torch.randn(batch, image, in_channels, generator=g).to(device, dtype),
            encoder_hidden_states=torch.randn(batch, text, joint_dim, generator=g).to(device, dtype),
            timestep=torch.rand(batch, generator=g).to(device, dtype),
            img_ids=torch.randn(image, 3, generator=g).to(device, dtype),
            txt_ids=torch.zeros(text, 3).to(device, dtype),
            attention_mask=mask.to(device),
            target=torch.randn(batch, image, in_channels, generator=g).to(device, dtype),
            lengths=lengths.tolist(),
        ))
    return out


def first_step(model, b):
    """Output and parameter gradients of one forward + backward on batch ``b`` (no update)."""
    inputs = {k: (v.to(next(model.parameters()).dtype) if v.is_floating_point() else v)
              for k, v in b.items() if k not in ("target", "lengths")}
    out = model(**inputs, return_dict=False)[0]
    torch.nn.functional.mse_loss(out.float(), b["target"].float()).backward()
    return captured(model, out)


def captured(model, out):
    """``{"output": out, parameter name: its gradient}``, copied."""
    return {"output": out.detach().clone(),
            **{n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}}


def train(model, batches, lr=1e-3):
    """Loss and wall time of each step; output and gradients of the first."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    cuda = model.device.type == "cuda"
    losses, times, first = [], [], None
    for i, b in enumerate(batches):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(**{k: v for k, v in b.items() if k not in ("target", "lengths")}, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(out.float(), b["target"].float())
        opt.zero_grad()
        loss.backward()
        if i == 0:
            first = captured(model, out)
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, times, first


def rel_diff(a: torch.Tensor | None, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64; 0 when equal, inf when ``a`` is missing."""
    if a is None:
        return float("inf")
    d = (a.double() - b.double()).norm()
    return 0.0 if d == 0 else (d / b.double().norm()).item()


def verdict(first_s, first_v, ref, dtype, st, steps):
    """``(line, passed)``: varlen_attn's first-step output and gradients against stock's."""
    diffs = {n: rel_diff(first_v.get(n), t) for n, t in first_s.items()}
    worst = max(diffs.values())
    precision = str(dtype).replace("torch.", "")
    if ref is None:  # float64: equal to rounding, against a fixed tolerance
        ok = worst <= FLOAT64_TOL
        judged = f"worst rel. diff {worst:.0e} {'<=' if ok else '>'} {FLOAT64_TOL:.0e}, {precision}"
    else:  # lower precision: as close to the higher-precision run as stock is
        # Output, then every gradient together: per tensor, one that is zero in exact arithmetic
        # (a key bias's) would compare two kernels' rounding noise with each other.
        def err(run, names):
            if any(n not in run for n in names):
                return float("inf")
            cat = [run[n].double().flatten() - ref[n].double().flatten() for n in names]
            return torch.cat(cat).norm().item()

        groups = (["output"], [n for n in ref if n != "output"])
        ratio = max(err(first_v, g) / max(err(first_s, g), 1e-30) for g in groups)
        ok = ratio <= LOW_PRECISION_FACTOR
        up = str(ref["output"].dtype).replace("torch.", "")
        judged = (f"{precision}: output and gradients {ratio:.2f}x as far from {up} as stock's, "
                  f"{'<=' if ok else '>'} {LOW_PRECISION_FACTOR:g}x; worst rel. diff to stock {worst:.0e}")
    backends = st["backends"]
    ran = (f"backend {next(iter(backends))}" if len(backends) == 1 else
           "backends " + (", ".join(f"{n} ({c} calls)" for n, c in backends.items()) or "none"))
    builds = ("1 plan build per step" if st["plan_builds"] == steps else
              f"{st['plan_builds']} plan builds in {steps} steps")
    fell = f"; {sum(st['fallbacks'].values())} calls fell back to masked SDPA" if st["fallbacks"] else ""
    head = "varlen_attn equals stock" if ok else "varlen_attn DIFFERS from stock"
    return f"VERDICT: {head} ({judged}) on {ran}; {builds}{fell}", ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--dtype", choices=DTYPES, default=None,
                    help="default: float64 on the CPU, bfloat16 on a GPU")
    for name in ("width", "heads", "batch", "text", "image"):
        ap.add_argument(f"--{name}", type=int, default=None, help="default: by device (see SIZES)")
    args = ap.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    dtype = DTYPES[args.dtype or ("bfloat16" if gpu else "float64")]
    size = dict(SIZES["cuda" if gpu else "cpu"])
    size.update({k: v for k in ("width", "heads", "batch", "text", "image") if (v := getattr(args, k))})
    if gpu:  # cuDNN SDPA failed inside diffusers models on torch 2.11 (docs/versions.md); stock runs without it
        torch.backends.cuda.enable_cudnn_sdp(False)
    elif "OMP_NUM_THREADS" not in os.environ:
        # A model this small gains nothing from threads, and on a busy 2-core machine torch's
        # thread pool made each run 10x slower (97 s instead of 9).
        torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*FluxPosEmbed.* is deprecated", category=FutureWarning)

    model_size = {k: size[k] for k in ("width", "heads", "joint_dim", "in_channels")}
    stock = make_model(device, dtype, **model_size)
    ours = va.enable_varlen(copy.deepcopy(stock), args.backend)
    batches = make_batches(args.steps, size["batch"], size["text"], size["image"], size["joint_dim"],
                           size["in_channels"], device, dtype)

    # Below float64, the yardstick is stock's own rounding: the first step of the same weights
    # (cast up exactly) in a higher precision.
    ref = None
    if dtype != torch.float64:
        up = torch.float64 if dtype == torch.float32 else torch.float32
        ref = first_step(cast(copy.deepcopy(stock), device, up), batches[0])

    loss_s, time_s, first_s = train(stock, batches)
    va.reset_stats()
    loss_v, time_v, first_v = train(ours, batches)
    st = va.stats()

    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    print(f"Chroma, random init: width {size['width']}, {size['heads']} heads, 2 double + 2 single blocks, "
          f"batch {size['batch']}, {size['text']} text (padded) + {size['image']} image tokens, "
          f"{str(dtype).replace('torch.', '')}, {name}, torch {torch.__version__}")
    print(f"{'step':>4} {'prompt lengths':>20} {'loss stock':>12} {'loss varlen':>12}")
    for i, b in enumerate(batches):
        print(f"{i:>4} {b['lengths']!s:>20} {loss_s[i]:>12.6f} {loss_v[i]:>12.6f}")
    print(f"varlen_attn: backends {st['backends']}; plan builds {st['plan_builds']} for {args.steps} steps; "
          f"host syncs {st['host_syncs']}; fallbacks {st['fallbacks'] or 'none'}")
    if gpu:
        warm = 2 if len(time_s) > 2 else 0
        ms_s, ms_v = (1e3 * statistics.median(t[warm:]) for t in (time_s, time_v))
        print(f"GPU time per training step (synchronised), median of steps {warm}-{len(time_s) - 1}: "
              f"stock {ms_s:.1f} ms, varlen_attn {ms_v:.1f} ms; stock / varlen_attn = {ms_s / ms_v:.2f}x")
        if size["width"] < 1024:
            print("  (at this width a step is host-bound, Python and kernel launches, so the ratio says "
                  "little about attention; the default size is width 3072)")
    else:
        print("CPU: speed is not the point here (the CPU backends exist for correctness), so no timings; "
              "a GPU run also times both.")
    grads = {n: rel_diff(first_v.get(n), t) for n, t in first_s.items() if n != "output"}
    worst_grad = max(grads, key=grads.get)
    out_diff = rel_diff(first_v["output"], first_s["output"])
    print(f"step 0, varlen_attn against stock: output rel. diff {out_diff:.1e}, "
          f"worst gradient rel. diff {grads[worst_grad]:.1e} ({worst_grad})")
    line, ok = verdict(first_s, first_v, ref, dtype, st, args.steps)
    print(line)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
