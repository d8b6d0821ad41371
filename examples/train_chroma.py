"""Train a tiny Chroma a few steps with padded prompts and caption dropout: stock vs varlen_attn.

The same random-initialised ChromaTransformer2DModel (joint [text; image] sequence, text padded
to a fixed length, one prompt in four dropped) is trained twice from the same weights on the
same batches: once with diffusers' stock attention (masked SDPA), once after
``varlen_attn.enable_varlen(model)``. Prints both loss curves side by side, the largest
difference of outputs and gradients, the backend that ran, plan builds and time per step.

    python examples/train_chroma.py                 # CPU, float32, a few seconds
    python examples/train_chroma.py --steps 20      # longer; on a GPU: bf16, larger model
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import varlen_attn as va


def make_model(device, dtype, width, heads, seed=0):
    from diffusers import ChromaTransformer2DModel

    torch.manual_seed(seed)
    head_dim = width // heads
    model = ChromaTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=head_dim,
        num_attention_heads=heads, joint_attention_dim=32, axes_dims_rope=(head_dim // 4, head_dim // 4, head_dim // 2),
        approximator_num_channels=8, approximator_hidden_dim=32, approximator_layers=1)
    return model.to(device, dtype)


def make_batches(steps, batch, text, image, device, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(1, text + 1, (batch,), generator=g)
        lengths[torch.rand(batch, generator=g) < 0.25] = 0  # caption dropout: empty prompt
        keep_text = torch.arange(text)[None] < lengths[:, None]
        mask = torch.cat([keep_text, torch.ones(batch, image, dtype=torch.bool)], 1)
        out.append(dict(
            hidden_states=torch.randn(batch, image, 16, generator=g).to(device, dtype),
            encoder_hidden_states=torch.randn(batch, text, 32, generator=g).to(device, dtype),
            timestep=torch.rand(batch, generator=g).to(device, dtype),
            img_ids=torch.randn(image, 3, generator=g).to(device, dtype),
            txt_ids=torch.zeros(text, 3).to(device, dtype),
            attention_mask=mask.to(device),
            target=torch.randn(batch, image, 16, generator=g).to(device, dtype),
            lengths=lengths.tolist(),
        ))
    return out


def train(model, batches, lr=1e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, times, first = [], [], None
    for i, b in enumerate(batches):
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(**{k: v for k, v in b.items() if k not in ("target", "lengths")}, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(out.float(), b["target"].float())
        opt.zero_grad()
        loss.backward()
        if i == 0:
            first = (out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, times, first


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    width, heads, batch, text, image = (1024, 8, 3, 128, 1024) if gpu else (64, 4, 4, 24, 64)
    if gpu:  # cuDNN SDPA failed inside diffusers models on torch 2.11 (see CONTEXT.md); stock runs without it
        torch.backends.cuda.enable_cudnn_sdp(False)

    stock = make_model(device, dtype, width, heads)
    ours = va.enable_varlen(copy.deepcopy(stock), args.backend)
    batches = make_batches(args.steps, batch, text, image, device, dtype)

    loss_s, time_s, first_s = train(stock, batches)
    va.reset_stats()
    loss_v, time_v, first_v = train(ours, batches)
    st = va.stats()

    out_diff = (first_s[0].float() - first_v[0].float()).abs().max().item()
    grad_diff = max((first_s[1][n].float() - first_v[1][n].float()).abs().max().item() for n in first_s[1])
    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    print(f"tiny Chroma: width {width}, {heads} heads, 2 double + 2 single blocks, batch {batch}, "
          f"{text} text (padded) + {image} image tokens, {dtype}, {name}, torch {torch.__version__}")
    print(f"{'step':>4} {'prompt lengths':>20} {'loss stock':>12} {'loss varlen':>12}")
    for i, b in enumerate(batches):
        print(f"{i:>4} {str(b['lengths']):>20} {loss_s[i]:>12.6f} {loss_v[i]:>12.6f}")
    warm = slice(1, None) if len(time_s) > 1 else slice(None)
    ms_s = 1e3 * sum(time_s[warm]) / len(time_s[warm])
    ms_v = 1e3 * sum(time_v[warm]) / len(time_v[warm])
    print(f"step 0: max |output diff| {out_diff:.2e}, max |grad diff| {grad_diff:.2e}")
    print(f"time per step (after the first): stock {ms_s:.1f} ms, varlen {ms_v:.1f} ms")
    print(f"varlen backends: {st['backends']}; plan builds: {st['plan_builds']} for {args.steps} steps; "
          f"host syncs: {st['host_syncs']}; fallbacks: {st['fallbacks'] or 'none'}")
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    if out_diff > tol:
        raise SystemExit(f"MISMATCH: output differs by {out_diff:.3e} > {tol}")


if __name__ == "__main__":
    main()
