"""One training step of a Chroma-width transformer, stock vs enable_varlen (run on a GPU).

    python benchmarks/chroma_step.py [--json out.json]

Random init, 2 double + 2.. single blocks (``--double``, ``--single``), hidden 3072, 24 heads,
bf16, 1024 px bs3: 4096 image tokens, text padded to 512 with lengths 77/300/2 (the third close
to caption dropout). Three runs on the same weights and batch: stock processors with the mask,
``enable_varlen`` (auto backend), and the same model with no mask at all (the speed target).
Median of ``--reps`` steps after warm-up; the first step's outputs are compared.
cuDNN SDPA is disabled for all runs: with torch 2.11 it failed inside this model (CONTEXT.md).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import varlen_attn as va


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--double", type=int, default=2)
    ap.add_argument("--single", type=int, default=4)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--compile", action="store_true",
                    help="compile every block (regional, fullgraph) and give each step a new mask")
    args = ap.parse_args()
    from diffusers import ChromaTransformer2DModel

    torch.backends.cuda.enable_cudnn_sdp(False)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    model = ChromaTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=args.double, num_single_layers=args.single,
        attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096, axes_dims_rope=(16, 56, 56),
        approximator_num_channels=64, approximator_hidden_dim=5120, approximator_layers=5).to(dev, dtype)
    nparams = sum(p.numel() for p in model.parameters())
    b, t, n = 3, 512, 4096
    g = torch.Generator(device=dev).manual_seed(1)
    lengths = [77, 300, 2]
    mask = torch.cat([torch.arange(t, device=dev)[None] < torch.tensor(lengths, device=dev)[:, None],
                      torch.ones(b, n, dtype=torch.bool, device=dev)], 1)
    inputs = dict(hidden_states=torch.randn(b, n, 64, device=dev, dtype=dtype, generator=g),
                  encoder_hidden_states=torch.randn(b, t, 4096, device=dev, dtype=dtype, generator=g),
                  timestep=torch.rand(b, device=dev, dtype=dtype, generator=g),
                  img_ids=torch.randn(n, 3, device=dev, dtype=dtype, generator=g),
                  txt_ids=torch.zeros(t, 3, device=dev, dtype=dtype), return_dict=False)

    current = {"mask": None}
    # --compile: three batches with different prompt lengths, one per step in turn.
    masks = [torch.cat([torch.arange(t, device=dev)[None] < torch.tensor(ls, device=dev)[:, None],
                        torch.ones(b, n, dtype=torch.bool, device=dev)], 1)
             for ls in (lengths, [512, 0, 40], [13, 200, 511])]
    if args.compile:
        from torch._dynamo.utils import counters

        for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
            block.compile(fullgraph=True)
    turn = [0]

    def step(m):
        m.zero_grad(set_to_none=True)
        mask_now = current["mask"]
        if args.compile and mask_now is not None:
            turn[0] += 1
            mask_now = masks[turn[0] % len(masks)] if turn[0] > 1 else mask
        out = m(**inputs, attention_mask=mask_now)[0]
        out.float().pow(2).mean().backward()
        return out.detach()

    results = {}
    outs = {}
    for name in ("stock, mask", "enable_varlen, mask", "stock, no mask"):
        if name.startswith("enable_varlen"):
            va.enable_varlen(model)
            va.reset_stats()
        current["mask"] = None if name.endswith("no mask") else mask
        turn[0] = 0
        outs[name] = step(model)
        for _ in range(4 if args.compile else 2):
            step(model)
        if args.compile:
            frames_before = counters["stats"]["unique_graphs"]
        times = []
        for _ in range(args.reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            s.record()
            step(model)
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        results[name] = statistics.median(times)
        if args.compile:
            results[f"{name}: new graphs during timed steps"] = counters["stats"]["unique_graphs"] - frames_before
            results[f"{name}: graph breaks so far"] = dict(counters["graph_break"])
        if name.startswith("enable_varlen"):
            results["varlen stats"] = va.stats()
            va.disable_varlen(model)
    diff = (outs["stock, mask"].float() - outs["enable_varlen, mask"].float()).abs()
    ref_scale = outs["stock, mask"].float().abs().max().item()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {nparams / 1e9:.2f} B params, "
          f"{args.double} double + {args.single} single blocks, B={b}, S={t}+{n}, lengths {lengths}, bf16")
    for k in ("stock, mask", "enable_varlen, mask", "stock, no mask"):
        print(f"  {k:<22} {results[k]:8.1f} ms/step")
    print(f"  speed-up vs stock masked step: {results['stock, mask'] / results['enable_varlen, mask']:.2f}x; "
          f"vs no-mask step: {results['stock, no mask'] / results['enable_varlen, mask']:.2f}x")
    print(f"  first-step output: max |diff| {diff.max().item():.3e}, mean |diff| {diff.mean().item():.3e}, "
          f"max |out| {ref_scale:.3e}")
    print(f"  varlen stats over the enable_varlen steps: {results['varlen stats']}")
    if args.compile:
        print("  compiled blocks (regional, fullgraph), a new mask every step:")
        for k, val in results.items():
            if ":" in k:
                print(f"    {k}: {val}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"results": results, "max_diff": diff.max().item(), "gpu": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "compiled": args.compile}, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
