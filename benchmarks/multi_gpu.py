"""Multi-GPU benchmark: Ulysses context parallelism and DDP, with varlen_attn.

    torchrun --nproc-per-node 2 benchmarks/multi_gpu.py --out benchmarks/results/multi_gpu_h200.json
    torchrun --nproc-per-node 1 benchmarks/multi_gpu.py --out benchmarks/results/multi_gpu_h200_1gpu.json
    torchrun --nproc-per-node 2 benchmarks/multi_gpu.py --quick --device cpu   # smoke run (gloo)

(a) ``cp``: a HunyuanVideo-width stack of joint [video; text] blocks (width 3072, 24 heads of 128,
    reduced depth), about 60k tokens, the text padded with a key-padding mask. One GPU runs
    ``va.attention`` on the whole sequence; P GPUs hold a slice each and run
    ``va.ulysses_attention``. Checked equal in float32 (rank 0 runs the whole model alone as the
    reference), then timed in bf16: forward + backward, peak memory per GPU. Not diffusers'
    HunyuanVideoTransformer3DModel: diffusers 0.42.1 has no context-parallel plan for it (and
    under diffusers' own CP only the forward of attention runs packed; docs/multi_gpu.md).
(b) ``ddp``: a Chroma LoRA step (diffusers ChromaTransformer2DModel at reduced depth, real width,
    LoRA r=16 on the attention projections, checkpointing, AdamW), enabled with varlen_attn, on
    one GPU vs DDP on P GPUs, the same per-rank batch.

Every phase is time-boxed (``--phase-seconds``); a timing row says how many steps it measured.
Prints a table on rank 0 and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import torch
import torch.distributed as dist

import varlen_attn as va


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/multi_gpu.json")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--phases", default="cp,ddp")
    p.add_argument("--steps", type=int, default=None, help="timed steps per row (default 10, quick 2)")
    p.add_argument("--phase-seconds", type=float, default=60.0, help="time box of each timed row")
    return p.parse_args()


# ------------------------------------------------------------------------------------------------
# set-up, timing

def setup(device: str):
    if "RANK" not in os.environ:  # plain ``python``: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, local = dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0))
    if device == "cuda":
        torch.cuda.set_device(local)
        return rank, dist.get_world_size(), torch.device("cuda", local)
    torch.set_num_threads(1)
    return rank, dist.get_world_size(), torch.device("cpu")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, steps: int, budget: float) -> dict:
    """Median ms of ``fn`` after two warm-up calls, stopping early at ``budget`` seconds; peak
    memory of the timed calls (GiB, CUDA only)."""
    start = time.perf_counter()
    for _ in range(2):
        fn()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    while len(times) < steps and (time.perf_counter() - start < budget or not times):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"ms": statistics.median(times), "steps": len(times), "peak_gib": peak}


def alone(rank: int, fn):
    """Run ``fn`` on rank 0 only (the one-GPU baseline) while the others wait."""
    result = fn() if rank == 0 else None
    dist.barrier()
    return result


# ------------------------------------------------------------------------------------------------
# (a) context parallelism: a HunyuanVideo-width stack of joint blocks

class Block(torch.nn.Module):
    """A pre-norm joint attention block (HunyuanVideo's single-stream block, simplified)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(approximate="tanh"),
                                       torch.nn.Linear(4 * dim, dim))

    def forward(self, x, mask, plan, attn):
        b, n, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, dim // self.heads).unbind(2)
        x = x + self.proj(attn(q, k, v, mask, plan=plan).reshape(b, n, dim))
        return x + self.mlp(self.norm2(x))


class Stack(torch.nn.Module):
    def __init__(self, dim, heads, depth):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(depth))

    def forward(self, x, mask, plan, attn):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, mask, plan, attn, use_reentrant=False)
        return x


def cp_phase(args, rank, world, device) -> list[dict]:
    if args.quick:
        dim, heads, depth, video, text, lengths = 64, 4, 2, 61, 8, (5,)
    else:  # HunyuanVideo width; 129 frames at 720x1280 would be 119k tokens: about half
        dim, heads, depth, video, text, lengths = 3072, 24, 2, 59904, 256, (77,)
    seq = video + text
    keep = torch.cat([torch.ones(1, video, dtype=torch.bool),
                      torch.arange(text)[None] < torch.tensor(lengths)[:, None]], 1).to(device)
    plan = va.build_plan(keep)  # the whole sequence's plan, the same on every rank
    torch.manual_seed(0)
    model = Stack(dim, heads, depth).to(device)
    g = torch.Generator(device="cpu").manual_seed(1)
    x_full = torch.randn(1, seq, dim, generator=g).to(device)
    w_full = torch.randn(1, seq, dim, generator=g).to(device)
    rows = []

    def run(dtype, sharded: bool):
        m = model.to(dtype)
        m.zero_grad(set_to_none=True)
        attn = va.ulysses_attention if sharded else va.attention
        x = (va.shard_sequence(x_full) if sharded else x_full).to(dtype).requires_grad_()
        w = (va.shard_sequence(w_full) if sharded else w_full).to(dtype)
        out = m(x, keep, plan, attn)
        (out.float() * w.float()).sum().backward()
        return out

    # Equality in float32 (TF32 off): rank 0 alone on the whole sequence vs the P slices.
    if world > 1:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        ref = alone(rank, lambda: (run(torch.float32, False).detach(),
                                   {n: p.grad.clone() for n, p in model.named_parameters()}))
        out = run(torch.float32, True).detach()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        for t in grads.values():
            dist.all_reduce(t)  # each rank holds the gradient of its slice
        if rank == 0:
            ref_out, ref_grads = ref
            err_out = ((out - va.shard_sequence(ref_out)).abs().max() / ref_out.abs().max()).item()
            err_grad = max(((grads[n] - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-30)).item()
                           for n in grads)
            rows.append({"phase": "cp", "what": "equality float32, relative max error", "world": world,
                         "out": err_out, "grads": err_grad, "ok": err_out < 1e-4 and err_grad < 1e-4})
        del ref
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    steps = args.steps or (2 if args.quick else 10)
    single = alone(rank, lambda: timed(lambda: run(dtype, False), device, steps, args.phase_seconds))
    if rank == 0:
        rows.append({"phase": "cp", "what": f"1 GPU, va.attention, S={seq}", "world": 1, **single})
    if world > 1:
        va.reset_stats()
        cp = timed(lambda: run(dtype, True), device, steps, args.phase_seconds)
        peaks = [None] * world
        dist.all_gather_object(peaks, cp["peak_gib"])
        if rank == 0:
            rows.append({"phase": "cp", "what": f"{world} GPUs, va.ulysses_attention, S={seq}", "world": world,
                         **cp, "peak_gib_per_rank": peaks, "stats_rank0": va.stats()})
    return rows


# ------------------------------------------------------------------------------------------------
# (b) data parallel: a Chroma LoRA step

def ddp_phase(args, rank, world, device) -> list[dict]:
    import diffusers
    from peft import LoraConfig

    if args.quick:
        cfg = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 4, 8),
                   approximator_num_channels=8, approximator_hidden_dim=16, approximator_layers=1)
        text, image, length, channels, text_dim = 8, 16, 5, 4, 32
    else:  # Chroma's width at reduced depth, 1024 px (4096 image tokens), text padded to 512
        cfg = dict(num_layers=2, num_single_layers=4)
        text, image, length, channels, text_dim = 512, 4096, 77, 64, 4096
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    model = diffusers.ChromaTransformer2DModel(**cfg).to(device, dtype)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    model.enable_gradient_checkpointing()
    va.enable_varlen(model)
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own batch
    batch = {"hidden_states": torch.randn(1, image, channels, generator=g),
             "encoder_hidden_states": torch.randn(1, text, text_dim, generator=g),
             "timestep": torch.rand(1, generator=g), "img_ids": torch.randn(image, 3, generator=g),
             "txt_ids": torch.zeros(text, 3)}
    batch = {k: v.to(device, dtype) for k, v in batch.items()}
    batch["attention_mask"] = torch.cat([torch.arange(text) < length, torch.ones(image, dtype=torch.bool)])[None].to(device)
    steps = args.steps or (2 if args.quick else 10)

    def trainer(net):
        opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-5)

        def step():
            opt.zero_grad(set_to_none=True)
            out = net(**batch, return_dict=False)[0]
            out.float().pow(2).mean().backward()
            opt.step()
        return step

    rows = []
    single = alone(rank, lambda: timed(trainer(model), device, steps, args.phase_seconds))
    if rank == 0:
        rows.append({"phase": "ddp", "what": "1 GPU, Chroma LoRA step", "world": 1, **single})
    if world > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        va.reset_stats()
        result = timed(trainer(ddp), device, steps, args.phase_seconds)
        if rank == 0:
            rows.append({"phase": "ddp", "what": f"DDP {world} GPUs, Chroma LoRA step (per-rank batch as 1 GPU)",
                         "world": world, **result, "stats_rank0": va.stats()})
    return rows


def main():
    args = parse()
    rank, world, device = setup(args.device)
    t0 = time.perf_counter()
    rows = []
    for phase in args.phases.split(","):
        rows += {"cp": cp_phase, "ddp": ddp_phase}[phase](args, rank, world, device)
        dist.barrier()
    if rank == 0:
        for r in rows:
            cells = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                             if k not in ("phase", "what", "stats_rank0"))
            print(f"{r['phase']:4} | {r['what']:60} | {cells}")
        env = {"torch": torch.__version__, "world": world, "device": str(device), "quick": args.quick,
               "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "seconds": round(time.perf_counter() - t0, 1)}
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"env": env, "rows": rows}, indent=2, default=str))
        print(f"wrote {out} in {env['seconds']} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
