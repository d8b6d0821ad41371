"""Multi-GPU benchmark: stock masked SDPA beside varlen_attn, one job per GPU count.

    torchrun --nproc-per-node 1 benchmarks/multi_gpu.py --out x1.json     # and 2, 4
    python benchmarks/multi_gpu.py --report x1.json x2.json x4.json --from-round 2
    torchrun --nproc-per-node 2 benchmarks/multi_gpu.py --quick --device cpu   # smoke run (gloo)

Variants (``--variants``): ``stock`` (masked SDPA with PyTorch's kernel choice; ``--cudnn-sdp off``
takes cuDNN's attention out of it, as train_step.py does), ``auto`` (varlen_attn's default
backend: FA4 where installed) and ``torch`` (PyTorch's own varlen kernel, no flash-attn). Within
a cell the variants take turns, one step each per round (``--rounds``, after two warm-up steps
each), so drift hits them alike; each row is a variant's median step (``--report --from-round``:
the median of the later rounds).

(a) ``cp``: Ulysses context parallelism on diffusers' HunyuanVideoTransformer3DModel at its real
    width (24 heads of 128) and reduced depth (``--cp-depth`` double + single blocks), random
    init, bf16, LoRA r=16 on the attention projections, gradient checkpointing per block. Inputs
    of a 720x1280 video (45x80 latent patches per frame) with 17 or 33 latent frames (61,200 or
    118,800 video tokens) and 256 text tokens of which 77 are valid. diffusers 0.42.1 has no
    context-parallel plan for HunyuanVideo, so this is varlen_attn's recipe (docs/multi_gpu.md):
    each rank holds a slice of the video tokens and a slice of the text tokens; its blocks run
    with :class:`UlyssesJointProcessor`, which calls ``va.ulysses_attention`` with the whole
    sequence's key-padding mask in the order the exchange gathers it. ``stock`` runs the same
    exchange with ``backend="sdpa"``. The loss is each rank's share; the LoRA gradients are
    summed over the ranks (one all-reduce), then AdamW. With P GPUs each rank's equality with one
    GPU is checked first, float32 on a short video: rank 0 runs the unsplit model alone.
(b) ``dp``: a Chroma LoRA step (diffusers ChromaTransformer2DModel, real width, reduced depth
    ``--dp-depth``, LoRA r=16 on the attention projections, gradient checkpointing, AdamW) at
    1024 px (4096 image tokens, text padded to 512), batch 2 per rank with new prompt lengths
    every step, under DDP (eager) and FSDP2 (``fully_shard`` per block, then the model; every block
    compiled with inductor inside it). The per-rank batch is the same for every GPU count.

Prints a table on rank 0 and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import statistics
import time

import torch
import torch.distributed as dist
import train_step
from _common import sync

import varlen_attn as va


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="multi_gpu.json")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--phases", default="cp,dp")
    p.add_argument("--variants", default="stock,auto,torch")
    p.add_argument("--frames", default="17,33", help="latent frames of the cp cells (3600 tokens each)")
    p.add_argument("--cp-depth", default="1,2", help="double,single blocks of HunyuanVideo")
    p.add_argument("--dp-depth", default="4,8", help="double,single blocks of Chroma")
    p.add_argument("--dp-modes", default="ddp,fsdp2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cudnn-sdp", choices=["default", "off"], default="default",
                   help="SDPA's cuDNN kernel: PyTorch's default choice, or off as in train_step.py")
    p.add_argument("--cell-seconds", type=float, default=120.0, help="time box of each cell's rounds")
    return p.parse_args()


# ------------------------------------------------------------------------------------------------
# set-up, timing

def setup(device: str):
    if "RANK" not in os.environ:  # plain ``python``: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if device == "cuda":
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    return dist.get_rank(), dist.get_world_size(), torch.device("cpu")


def rounds(steps: dict, device, n_rounds: int, budget: float, warmup: int = 2) -> dict:
    """``steps``: variant -> a training step. ``warmup`` steps each (the H200 run's FSDP2 cells
    recompiled their blocks in the second step), then rounds in which every
    variant runs one step in turn (every other round in reverse order), until ``n_rounds`` or
    ``budget`` seconds (at least one round). Per variant: the median ms, the per-round times,
    the peak memory of its timed steps (GiB, CUDA only), varlen_attn's counters of its last step.
    Every rank runs the same steps: the decision to stop is rank 0's, broadcast. Plans kept by
    varlen_attn are cleared before each step."""
    start = time.perf_counter()
    for _ in range(warmup):
        for fn in steps.values():
            fn()
    sync(device)
    times = {name: [] for name in steps}
    peaks = dict.fromkeys(steps, 0.0)
    counters = {}
    for r in range(n_rounds):
        order = list(steps) if r % 2 == 0 else list(reversed(steps))
        for name in order:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            # The variants draw the same masks: a plan kept from another variant's step is dropped, so
            # each step builds its own as a training loop does (there, each step's mask is new).
            va.clear_plan_cache()
            va.reset_stats()
            sync(device)
            t0 = time.perf_counter()
            steps[name]()
            sync(device)
            times[name].append((time.perf_counter() - t0) * 1e3)
            counters[name] = va.stats()
            if device.type == "cuda":
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device) / 2**30)
        go = torch.tensor([time.perf_counter() - start < budget], device=device)
        dist.broadcast(go, 0)
        if not go.item():
            break
    return {name: {"ms": statistics.median(t), "rounds_ms": [round(x, 1) for x in t],
                   "peak_gib": peaks[name] if device.type == "cuda" else None, "stats": counters[name]}
            for name, t in times.items()}


def add_lora(model) -> list[torch.nn.Parameter]:
    """train_step.py's LoRA (r=16 on every attention projection, the rest frozen); the trainable
    parameters."""
    train_step.add_lora(model, 16)
    return [p for p in model.parameters() if p.requires_grad]


# ------------------------------------------------------------------------------------------------
# (a) context parallelism: HunyuanVideo with its sequence split over the ranks

class UlyssesJointProcessor:
    """HunyuanVideo's joint attention (double and single blocks) on this rank's slice of the video
    tokens and of the text tokens, through ``va.ulysses_attention``.

    The rank's sequence is ``[video_r; text_r]``; the exchange gathers ``[video_0; text_0; video_1;
    text_1; ...]``, so ``keep`` (set per step by :func:`cp_forward`) is the whole sequence's
    key-padding mask in that order, and ``plan`` its plan (None: the mask alone). Attention does not
    depend on the order of the keys, and each query row is its own: the output equals unsplit
    attention's rows for this rank's tokens."""

    def __init__(self, backend: str, alone: bool = False):
        self.backend, self.alone = backend, alone
        self.keep = self.plan = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        text = encoder_hidden_states.shape[1]
        single = attn.add_q_proj is None  # single blocks project video and text together
        x = torch.cat([hidden_states, encoder_hidden_states], 1) if single else hidden_states
        q, k, v = (proj(x).unflatten(2, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if single:
            q = torch.cat([apply_rotary_emb(q[:, :-text], image_rotary_emb, sequence_dim=1), q[:, -text:]], 1)
            k = torch.cat([apply_rotary_emb(k[:, :-text], image_rotary_emb, sequence_dim=1), k[:, -text:]], 1)
        else:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
            tq, tk, tv = (proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
                          for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            q = torch.cat([q, attn.norm_added_q(tq)], 1)
            k = torch.cat([k, attn.norm_added_k(tk)], 1)
            v = torch.cat([v, tv], 1)
        attend = va.attention if self.alone else va.ulysses_attention
        out = attend(q, k, v, self.keep, plan=self.plan, backend=self.backend)
        out = out.flatten(2, 3).to(q.dtype)
        video, text_out = out[:, :-text], out[:, -text:]
        if getattr(attn, "to_out", None) is not None:
            video = attn.to_out[1](attn.to_out[0](video))
        if getattr(attn, "to_add_out", None) is not None:
            text_out = attn.to_add_out(text_out)
        return video, text_out


def hunyuan(args, device, dtype):
    from diffusers import HunyuanVideoTransformer3DModel

    double, single = (int(x) for x in args.cp_depth.split(","))
    if args.quick:
        cfg = dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=double,
                   num_single_layers=single, num_refiner_layers=1, text_embed_dim=32, pooled_projection_dim=16,
                   rope_axes_dim=(4, 6, 6))
    else:
        cfg = dict(num_layers=double, num_single_layers=single)
    logging.getLogger("diffusers.models.modeling_utils").setLevel(logging.ERROR)  # a cast warning
    torch.manual_seed(0)
    with torch.device(device):
        model = HunyuanVideoTransformer3DModel(**cfg)
    return model.to(device, dtype)


def cp_inputs(model, frames: int, device, dtype, quick: bool, seed: int = 0):
    c = model.config
    h, w, text, valid = (8, 8, 8, 3) if quick else (90, 160, 256, 77)
    g = torch.Generator(device="cpu").manual_seed(seed)
    tokens = frames * (h // c.patch_size) * (w // c.patch_size)
    out_features = c.out_channels * c.patch_size ** 2 * c.patch_size_t
    return {
        "x": torch.randn(1, c.in_channels, frames, h, w, generator=g).to(device, dtype),
        "text": torch.randn(1, text, c.text_embed_dim, generator=g).to(device, dtype),
        "text_keep": (torch.arange(text) < valid)[None].to(device),
        "pooled": torch.randn(1, c.pooled_projection_dim, generator=g).to(device, dtype),
        "timestep": torch.tensor([500.0], device=device, dtype=dtype),
        "guidance": torch.tensor([6000.0], device=device, dtype=dtype),
        "target": torch.randn(1, tokens, out_features, generator=g).to(device, dtype),
    }


def split(t: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    if t.shape[dim] % world:
        raise SystemExit(f"{t.shape[dim]} tokens do not split evenly over {world} ranks")
    return t.tensor_split(world, dim)[rank]


def cp_forward(model, inp, rank: int, world: int, plan_it: bool):
    """HunyuanVideoTransformer3DModel.forward (no token replace) on this rank's slice: the
    embeddings of the whole video and text, then each block on the slice, then the output
    projection of the slice's video tokens ``[1, N_r, C]`` (unpatchified only for the whole)."""
    temb, _ = model.time_text_embed(inp["timestep"], inp["pooled"], inp["guidance"])
    rope = model.rope(inp["x"])
    video = split(model.x_embedder(inp["x"]), rank, world)
    text = split(model.context_embedder(inp["text"], inp["timestep"], inp["text_keep"]), rank, world)
    rope = tuple(split(f, rank, world, dim=0) for f in rope)
    # The whole sequence's key padding, in the order the exchange gathers the slices.
    video_keep = torch.ones(1, video.shape[1], dtype=torch.bool, device=video.device)
    keep = torch.cat([torch.cat([video_keep, t], 1) for t in inp["text_keep"].tensor_split(world, 1)], 1)
    plan = va.build_plan(keep) if plan_it else None
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    for block in blocks:
        block.attn.processor.keep, block.attn.processor.plan = keep, plan
    for block in blocks:
        if torch.is_grad_enabled():
            video, text = torch.utils.checkpoint.checkpoint(block, video, text, temb, None, rope, use_reentrant=False)
        else:
            video, text = block(video, text, temb, None, rope)
    return model.proj_out(model.norm_out(video, temb))


BACKEND = {"stock": "sdpa", "auto": "auto", "torch": "torch"}


def cp_trainer(model, inp, rank: int, world: int, variant: str, lora, alone: bool = False, optimize: bool = True):
    """A training step of ``model`` (its processors set for ``variant``) on this rank's slice;
    ``alone``: the whole sequence on this rank, without the exchange (the one-GPU reference);
    ``optimize=False``: the gradients only, no optimizer step."""
    backend = BACKEND[variant]
    attns = [block.attn for block in [*model.transformer_blocks, *model.single_transformer_blocks]]
    processors = [UlyssesJointProcessor(backend, alone) for _ in attns]
    opt = torch.optim.AdamW(lora, lr=1e-5)
    rank, world = (0, 1) if alone else (rank, world)
    target = split(inp["target"], rank, world)

    def step():
        for attn, processor in zip(attns, processors):  # the variants share the model
            attn.processor = processor
        opt.zero_grad(set_to_none=True)
        out = cp_forward(model, inp, rank, world, plan_it=backend != "sdpa")
        # this rank's share of the whole video's mean squared error
        ((out.float() - target.float()).pow(2).sum() / inp["target"].numel()).backward()
        if world > 1:  # the LoRA gradients summed over the ranks: one all-reduce
            flat = torch.cat([p.grad.flatten() for p in lora])
            dist.all_reduce(flat)
            for p, g in zip(lora, flat.split([p.numel() for p in lora])):
                p.grad.copy_(g.view_as(p))
        if optimize:
            opt.step()
        return out
    return step


def cp_equality(args, rank, world, device) -> dict:
    """Each rank's output slice and the LoRA gradients summed over the ranks against rank 0
    running the whole sequence alone, on a short video: the largest error relative to the
    reference's largest magnitude, per variant and tensor kind, with the backends that ran.
    float32 (TF32 off), but ``torch`` (its kernel takes 16-bit only) in bfloat16."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = hunyuan(args, device, torch.float32)
    lora = add_lora(model)
    g = torch.Generator(device="cpu").manual_seed(3)
    with torch.no_grad():  # LoRA B starts at zero: give it values so that A has a gradient
        for p in lora:
            p.add_(torch.randn(p.shape, generator=g).to(device) * 1e-2)
    result = {"phase": "cp", "what": "equality with 1 GPU, relative max error", "world": world}
    for variant in args.variants.split(","):
        if variant == "torch" and device.type == "cpu":
            continue  # PyTorch's varlen kernel is CUDA only
        dtype = torch.bfloat16 if variant == "torch" else torch.float32
        model.to(dtype)
        inp = cp_inputs(model, 1 if args.quick else 2, device, dtype, args.quick, seed=4)
        ref = None
        if rank == 0:
            out = cp_trainer(model, inp, rank, world, variant, lora, alone=True, optimize=False)()
            ref = (out.detach().clone(), [p.grad.clone() for p in lora])
        dist.barrier()
        va.reset_stats()
        out = cp_trainer(model, inp, rank, world, variant, lora, optimize=False)().detach()
        outs = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(outs, out)
        if rank == 0:
            ref_out, ref_grads = ref
            err_out = ((torch.cat(outs, 1) - ref_out).abs().max() / ref_out.abs().max()).item()
            err_grad = max(((p.grad - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
                           for p, r in zip(lora, ref_grads))
            result[variant] = {"dtype": str(dtype).removeprefix("torch."), "out": err_out, "grads": err_grad,
                               "backends": va.stats()["backends"]}
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return result


def cp_phase(args, rank, world, device, save) -> list[dict]:
    rows = [cp_equality(args, rank, world, device)] if world > 1 else []
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = hunyuan(args, device, dtype)
    lora = add_lora(model)
    variants = [v for v in args.variants.split(",") if not (v == "torch" and device.type == "cpu")]
    for frames in [1] if args.quick else [int(f) for f in args.frames.split(",")]:
        inp = cp_inputs(model, frames, device, dtype, args.quick)
        steps = {v: cp_trainer(model, inp, rank, world, v, lora) for v in variants}
        timed = rounds(steps, device, args.rounds, args.cell_seconds)
        peaks = {}
        for v in variants:  # every rank's peak
            all_peaks = [None] * world
            dist.all_gather_object(all_peaks, timed[v]["peak_gib"])
            peaks[v] = all_peaks
        tokens = inp["target"].shape[1] + inp["text"].shape[1]
        for v in variants:
            rows.append({"phase": "cp", "what": f"HunyuanVideo {tokens} tokens", "tokens": tokens, "world": world,
                         "variant": v, **timed[v], "peak_gib_per_rank": peaks[v]})
        save(rows)
        del inp, steps
    return rows


# ------------------------------------------------------------------------------------------------
# (b) data parallel: a Chroma LoRA step under DDP and FSDP2

def chroma(args, device, dtype):
    """train_step.py's Chroma (real width on a GPU, its toy widths on the CPU) at ``--dp-depth``."""
    double, single = (int(x) for x in args.dp_depth.split(","))
    return train_step.build_model(argparse.Namespace(model="chroma", double=double, single=single), device, dtype)[0]


class ChromaBatch:
    """The per-rank batch: 2 samples, 1024 px (4096 image tokens), text padded to 512; every
    call a new attention mask with new prompt lengths (this rank's own)."""

    def __init__(self, model, rank: int, device, dtype, quick: bool):
        c = model.config
        self.text, image, grid = (8, 16, 4) if quick else (512, 4096, 64)
        g = torch.Generator(device="cpu").manual_seed(10 + rank)
        self.lengths = torch.Generator(device="cpu").manual_seed(100 + rank)
        img_ids = torch.zeros(grid, grid, 3)
        img_ids[..., 1] = torch.arange(grid)[:, None]
        img_ids[..., 2] = torch.arange(grid)[None, :]
        self.inputs = {k: v.to(device, dtype) for k, v in {
            "hidden_states": torch.randn(2, image, c.in_channels, generator=g),
            "encoder_hidden_states": torch.randn(2, self.text, c.joint_attention_dim, generator=g),
            "timestep": torch.rand(2, generator=g), "img_ids": img_ids.reshape(image, 3),
            "txt_ids": torch.zeros(self.text, 3)}.items()}
        self.target = torch.randn(2, image, c.in_channels, generator=g).to(device, dtype)
        self.image, self.device = image, device

    def __call__(self) -> dict:
        lengths = torch.randint(1, self.text + 1, (2,), generator=self.lengths)
        text_keep = torch.arange(self.text) < lengths[:, None]
        mask = torch.cat([text_keep, torch.ones(2, self.image, dtype=torch.bool)], 1).to(self.device)
        return {**self.inputs, "attention_mask": mask}


def dp_trainer(args, rank, world, device, dtype, mode: str, variant: str, batch: ChromaBatch | None):
    model = chroma(args, device, dtype)
    lora = add_lora(model)
    model.enable_gradient_checkpointing()
    if variant != "stock":
        va.enable_varlen(model, backend=BACKEND[variant])
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    if mode == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in blocks:
            fully_shard(block)
        net = fully_shard(model)
        for block in blocks:  # regional compilation inside the wrapper
            block.compile(backend="aot_eager" if device.type == "cpu" else "inductor")
    opt = torch.optim.AdamW(lora, lr=1e-5)
    batch = batch or ChromaBatch(model, rank, device, dtype, args.quick)

    def step():
        opt.zero_grad(set_to_none=True)
        out = net(**batch(), return_dict=False)[0]
        torch.nn.functional.mse_loss(out.float(), batch.target.float()).backward()
        opt.step()
    return step


def dp_phase(args, rank, world, device, save) -> list[dict]:
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    # The variants' compiled blocks share two code objects in this one process, and diffusers calls
    # the checkpointed single blocks of stock without a mask (varlen_attn's with it): past dynamo's
    # default limit of 8 cache entries a block ran compiled in its forward and eager in its
    # recomputation, and checkpointing refused (CheckpointError, 4 + 8 blocks, 3 variants, H200).
    torch._dynamo.config.recompile_limit = torch._dynamo.config.accumulated_recompile_limit = 512
    variants = [v for v in args.variants.split(",") if not (v == "torch" and device.type == "cpu")]
    rows = []
    for mode in args.dp_modes.split(","):
        steps = {v: dp_trainer(args, rank, world, device, dtype, mode, v, None) for v in variants}
        timed = rounds(steps, device, args.rounds, args.cell_seconds)
        for v in variants:
            rows.append({"phase": "dp", "what": f"Chroma LoRA step, {mode}", "mode": mode, "world": world,
                         "variant": v, **timed[v]})
        save(rows)
        del steps
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------

def report(paths: list[str], from_round: int = 1) -> str:
    """A markdown table from the JSON of one job per GPU count: per cell and GPU count, each
    variant's ms, its speed-up over stock, and its scaling against one GPU (context parallel:
    t1 / (P * tP), the same sequence split P ways; data parallel: t1 / tP, the same batch per
    rank). ``from_round``: the median of rounds ``from_round`` on (the first timed round of a
    cell with compiled blocks under FSDP2 recompiled, stock's too, in the H200 run)."""
    rows = [r for p in paths for r in json.loads(pathlib.Path(p).read_text())["rows"] if "ms" in r]
    for r in rows:
        r["ms"] = statistics.median(r["rounds_ms"][from_round - 1:])
    one = {(r["what"], r["variant"]): r["ms"] for r in rows if r["world"] == 1}
    stock = {(r["what"], r["world"]): r["ms"] for r in rows if r["variant"] == "stock"}
    lines = ["| workload | GPUs | variant | ms per step | vs stock | scaling vs 1 GPU | peak GiB per GPU |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["phase"], r["what"], r["world"], r["variant"] != "stock", r["variant"])):
        t1 = one.get((r["what"], r["variant"]))
        scale = "" if t1 is None else f"{t1 / (r['world'] * r['ms']) if r['phase'] == 'cp' else t1 / r['ms']:.0%}"
        base = stock.get((r["what"], r["world"]))
        vs = "" if base is None else f"{base / r['ms']:.2f}x"
        peak = r.get("peak_gib_per_rank") or [r.get("peak_gib")]
        peak = "" if peak[0] is None else f"{max(peak):.1f}"
        lines.append(f"| {r['what']} | {r['world']} | {r['variant']} | {r['ms']:.0f} | {vs} | {scale} | {peak} |")
    return "\n".join(lines)


def main():
    args = parse()
    rank, world, device = setup(args.device)
    if args.cudnn_sdp == "off":
        torch.backends.cuda.enable_cudnn_sdp(False)
    t0 = time.perf_counter()
    out = pathlib.Path(args.out)
    done: list[dict] = []

    def save(rows: list[dict]) -> None:
        """Write what has been measured so far (rank 0): a job that runs out of time keeps it."""
        if rank != 0:
            return
        env = {"torch": torch.__version__, "world": world, "device": str(device), "quick": args.quick,
               "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "backends": va.available_backends(device),
               "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled(), "seconds": round(time.perf_counter() - t0, 1),
               "argv": vars(args)}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"env": env, "rows": done + rows}, indent=2, default=str))

    for phase in args.phases.split(","):
        done += {"cp": cp_phase, "dp": dp_phase}[phase](args, rank, world, device, save)
        dist.barrier()
    save([])
    if rank == 0:
        print(report([str(out)]))
        for r in done:
            if "ms" not in r:
                print(r)
        print(f"wrote {out} in {time.perf_counter() - t0:.1f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--report"]:  # --report FILE... [--from-round N]: one table from the jobs' JSON
        ap = argparse.ArgumentParser()
        ap.add_argument("--report", nargs="+", required=True)
        ap.add_argument("--from-round", type=int, default=1)
        a = ap.parse_args()
        print(report(a.report, a.from_round))
    else:
        main()
