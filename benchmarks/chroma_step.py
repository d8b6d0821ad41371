"""One training step of a Chroma-width transformer, stock vs enable_varlen (run on a GPU).

    python benchmarks/chroma_step.py [--json out.json] [--compile]
    python benchmarks/chroma_step.py --device cpu     # smoke run: a tiny model, tiny shape

Random init, 2 double + 4 single blocks (``--double``, ``--single``), hidden 3072, 24 heads,
bf16, 1024 px bs3: 4096 image tokens, text padded to 512 with lengths 77/300/2 (the third close
to caption dropout). Three runs on the same weights and batch: stock processors with the mask,
``enable_varlen`` (auto backend), and the same model with no mask at all (the speed target).
Median of ``--reps`` steps after warm-up (CUDA events); the first step's outputs are compared.
cuDNN SDPA is disabled for all runs: with torch 2.11 it failed inside this model
(docs/versions.md).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import _common as C
import varlen_attn as va

# (shape, heads, head dim, rope axes, joint_attention_dim, in_channels, approximator channels,
#  hidden dim, layers): Chroma's widths on a GPU, a toy on the CPU.
CONFIGS = {
    "cuda": (C.SHAPES["chroma1024"], 24, 128, (16, 56, 56), 4096, 64, 64, 5120, 5),
    "cpu": (C.SHAPES["tiny"], 2, 32, (8, 12, 12), 32, 16, 8, 32, 1),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--double", type=int, default=2)
    ap.add_argument("--single", type=int, default=4)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--compile", action="store_true",
                    help="compile every block (regional, fullgraph) and give each step a new mask")
    C.add_device_argument(ap)
    args = ap.parse_args()
    dev = C.device_of(args)
    from diffusers import ChromaTransformer2DModel

    shape, heads, head_dim, rope, joint_dim, in_ch, appr_ch, appr_hidden, appr_layers = CONFIGS[dev.type]
    if dev.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = ChromaTransformer2DModel(
        patch_size=1, in_channels=in_ch, num_layers=args.double, num_single_layers=args.single,
        attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=joint_dim,
        axes_dims_rope=rope, approximator_num_channels=appr_ch, approximator_hidden_dim=appr_hidden,
        approximator_layers=appr_layers).to(dev, dtype)
    nparams = sum(p.numel() for p in model.parameters())
    b, t, n, lengths = shape.batch, shape.text, shape.image, list(shape.lengths)
    g = torch.Generator(device=dev).manual_seed(1)
    mask = C.joint_keep(shape, dev)
    inputs = dict(hidden_states=torch.randn(b, n, in_ch, device=dev, dtype=dtype, generator=g),
                  encoder_hidden_states=torch.randn(b, t, joint_dim, device=dev, dtype=dtype, generator=g),
                  timestep=torch.rand(b, device=dev, dtype=dtype, generator=g),
                  img_ids=torch.randn(n, 3, device=dev, dtype=dtype, generator=g),
                  txt_ids=torch.zeros(t, 3, device=dev, dtype=dtype), return_dict=False)

    current = {"mask": None}
    # --compile: three batches with different prompt lengths, one per step in turn.
    masks = [mask] + [C.joint_keep(C.Shape(b, t, n, tuple(min(x, t) for x in ls)), dev)
                      for ls in ([512, 0, 40], [13, 200, 511])]
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
            C.sync(dev)
            with C.Stopwatch(dev) as sw:
                step(model)
            times.append(sw.ms)
        results[name] = statistics.median(times)
        if args.compile:
            new_graphs = counters["stats"]["unique_graphs"] - frames_before
            results[f"{name}: new graphs during timed steps"] = new_graphs
            results[f"{name}: graph breaks so far"] = dict(counters["graph_break"])
        if name.startswith("enable_varlen"):
            results["varlen stats"] = va.stats()
            va.disable_varlen(model)
    diff = (outs["stock, mask"].float() - outs["enable_varlen, mask"].float()).abs()
    ref_scale = outs["stock, mask"].float().abs().max().item()
    env = C.environment(dev)
    print(f"{env['gpu']}, torch {env['torch']}, {nparams / 1e9:.2f} B params, "
          f"{args.double} double + {args.single} single blocks, B={b}, S={t}+{n}, lengths {lengths}, {dtype}")
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
            json.dump({"results": results, "max_diff": diff.max().item(), "env": env, "gpu": env["gpu"],
                       "torch": env["torch"], "compiled": args.compile}, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
