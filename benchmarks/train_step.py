"""The headline benchmark: one LoRA training step as trainers run it, stock diffusers vs
``varlen_attn.enable_varlen(model, backend=...)`` vs the same model with no mask (run on a GPU).

    python benchmarks/train_step.py --model chroma --px 1024 --json out.json --png out.png
    python benchmarks/train_step.py --model qwen --checkpointing off --compile blocks
    python benchmarks/train_step.py --device cpu          # smoke run: toy widths, 2 blocks of each kind

Models, random init, bf16 (float32 on the CPU): diffusers' ChromaTransformer2DModel at full depth
(19 double + 38 single blocks, 24 heads x 128, joint_attention_dim 4096, in_channels 64; 8.9 B
parameters) or QwenImageTransformer2DModel (60 layers, 24 heads x 128, joint_attention_dim 3584,
in_channels 64; 20.5 B); ``--double``, ``--single``, ``--layers`` reduce the depth.

Batch 3, text padded to 512 tokens with prompt lengths 77/300/2 (the third close to caption
dropout), (px/16)^2 image tokens: 1024 at 512 px, 4096 at 1024 px. The masks go in as each model
takes them: Chroma ``attention_mask`` [B, text + image], Qwen-Image ``encoder_hidden_states_mask``
[B, text] with ``img_shapes`` (diffusers 0.42.1's Qwen forward has no ``txt_seq_lens`` any more: it
reads the text lengths from the mask). Every step gets a NEW mask tensor (same lengths), as from a
data loader, so nothing can be cached across steps by object identity.

The step: LoRA r=16 (peft) on every attention projection, base frozen, forward + MSE loss +
backward + AdamW step + zero_grad. ``--checkpointing on|off``: diffusers' gradient checkpointing.
``--compile blocks``: every transformer block ``block.compile(fullgraph=True)`` (regional
compilation, as OneTrainer does; ``--compile-backend``, default inductor, aot_eager on the CPU).

Variants: ``stock`` (diffusers' masked SDPA), ``nomask`` (the same model called with no mask: the
speed target) and ``varlen:<backend>`` for each of ``--backends`` (default: auto and every
installed varlen_attn backend but the reference; ``<backend>@general`` keeps attention of
compiled blocks in varlen_attn's custom op, ``enable_varlen(..., in_graph=False)``). ``--variants``
picks some of them (benchmarks/headline.py runs each in a process of its own). Each variant is its own copy of the model
module tree sharing the frozen base weights (no extra weight memory), with its own LoRA adapter
(all from the same init), its own optimizer and, with ``--compile blocks``, its own compiled
blocks, compiled with ``dynamic=False``: the variants' blocks share their class's code, and with
dynamo's automatic dynamic shapes the variant warmed up after another sequence length (varlen's
trimmed text) was recompiled with symbolic lengths (seen in stock's warm-up; benchmarks/NOTES.md
entry 57). Every variant is warmed up, then ``--rounds`` rounds run each variant ``--reps`` steps in
turn (drift hits all alike; every other round in reverse order), until ``--max-seconds`` is spent
(at least one round). Reported per variant: the median ms per step (CUDA events around each
synchronised step; wall time on the CPU), stock / variant of those medians and, with two rounds
or more, stock / variant within each round (its median, a bootstrap 95% interval of that median
and the range; at 512 px, where steps are host-bound, take 50 rounds of one step), the median CPU
time of the main thread per step (``time.thread_time`` before the final sync: the forward, the loss and the
optimizer step; CUDA backward, checkpoint recomputation included, runs on autograd's device
thread and is not in it), the CPU time of every other thread over the step (the process's
minus the main thread's: autograd's device thread above all), peak memory (reset per variant
turn), varlen_attn's plan builds and host syncs per timed step, the backends that ran and any fallback, and the first step's output
against stock's (same weights, same batch).

Stock is PyTorch's default kernel choice (``--cudnn-sdp default``; on H100/H200 masked SDPA takes
cuDNN's attention); ``--cudnn-sdp off`` turns cuDNN's attention off for every variant, and a
variant name ending in ``/nocudnn`` (``stock/nocudnn``, ``varlen:auto/nocudnn``) turns it off
for that variant's steps only, compared with ``stock/nocudnn``: the memory-efficient kernel
A100 and RTX GPUs get (eager only: a compiled graph keeps the kernel it was compiled with, so
compiled cells with cuDNN off take ``--cudnn-sdp off``, with inductor's graph cache off).
cuDNN's attention failed inside diffusers' Chroma in some runs on torch 2.11 (docs/versions.md).
Note: diffusers' Chroma drops ``attention_mask`` from its checkpointed single blocks, so its
stock checkpointed step runs those blocks unmasked; enable_varlen passes the mask back
(``restore_checkpoint_mask``), so the varlen step computes what the unchecked stock step does.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import gzip
import json
import logging
import os
import sys
import pathlib
import random
import shutil
import statistics
import tempfile
import threading
import time
import warnings

import _common as C
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import varlen_attn as va

# Per model and device class: widths, and the default depth. The CPU rows are toys: the smoke run
# checks that the script runs end to end, in seconds.
MODELS = {
    "chroma": {
        "cuda": {"heads": 24, "head_dim": 128, "rope": (16, 56, 56), "joint_dim": 4096, "in_channels": 64,
                 "appr_channels": 64, "appr_hidden": 5120, "appr_layers": 5, "double": 19, "single": 38},
        "cpu": {"heads": 2, "head_dim": 32, "rope": (8, 12, 12), "joint_dim": 32, "in_channels": 16,
                "appr_channels": 8, "appr_hidden": 32, "appr_layers": 1, "double": 2, "single": 2},
    },
    "qwen": {
        "cuda": {"heads": 24, "head_dim": 128, "rope": (16, 56, 56), "joint_dim": 3584, "in_channels": 64,
                 "out_channels": 16, "layers": 60},
        "cpu": {"heads": 2, "head_dim": 32, "rope": (8, 12, 12), "joint_dim": 32, "in_channels": 16,
                "out_channels": 4, "layers": 2},
    },
}
PROMPT_LENGTHS = {"cuda": (77, 300, 2), "cpu": (5, 12, 2)}
TEXT_TOKENS = {"cuda": 512, "cpu": 16}
# Every attention projection of both models' attention modules (Chroma's single blocks have
# to_q/k/v only; their output goes through the block's proj_out, which is not attention).
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("chroma", "qwen"), default="chroma")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda (default with a GPU), or cpu: a smoke run with toy widths; its timings mean nothing")
    ap.add_argument("--px", type=int, choices=(512, 1024, 2048), default=1024,
                    help="image size: (px/16)^2 image tokens (CPU: (px/128)^2)")
    ap.add_argument("--double", type=int, default=None, help="Chroma double blocks (default: 19; CPU 2)")
    ap.add_argument("--single", type=int, default=None, help="Chroma single blocks (default: 38; CPU 2)")
    ap.add_argument("--layers", type=int, default=None, help="Qwen-Image layers (default: 60; CPU 2)")
    ap.add_argument("--checkpointing", choices=("on", "off", "caller"), default="on",
                    help="on: diffusers' own; caller: every block's forward wrapped in torch.utils.checkpoint "
                         "(non-reentrant) by the caller, as OneTrainer does")
    ap.add_argument("--cudnn-sdp", choices=("off", "default"), default="default",
                    help="SDPA's cuDNN attention for every variant: PyTorch's default choice (default; on "
                         "H100/H200 masked SDPA then takes it) or off (the memory-efficient kernel A100 and "
                         "RTX GPUs get)")
    ap.add_argument("--compile", choices=("none", "blocks", "whole"), default="none",
                    help="blocks: block.compile(fullgraph=True) of every block; whole: torch.compile(model, fullgraph=True)")
    ap.add_argument("--compile-mode", default=None, choices=(None, "default", "reduce-overhead", "max-autotune-no-cudagraphs"),
                    help="torch.compile mode of the blocks (reduce-overhead: CUDA graphs)")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend for --compile blocks (default: inductor; on the CPU aot_eager, "
                         "which traces as inductor does, fullgraph and autograd, without its minutes of codegen)")
    ap.add_argument("--backends", default=None,
                    help="comma-separated varlen_attn backends (default: auto and every installed one but "
                         f"the reference; now: {','.join(['auto', *C.varlen_backends(torch.device('cpu'))])} "
                         "on the CPU)")
    ap.add_argument("--variants", default=None,
                    help="comma-separated variants to run in this process (default: stock, nomask and "
                         "varlen:<backend> for each of --backends); benchmarks/headline.py runs one per process")
    ap.add_argument("--mask-dtype", choices=("bool", "float", "long"), default="bool",
                    help="dtype of the padding mask passed to the model (default bool). Chroma's pipeline "
                         "passes float 0/1, which stock SDPA reads as an additive bias (no masking); "
                         "Qwen-Image's passes long, which its forward turns into bool")
    ap.add_argument("--prompt-lengths", type=lambda v: tuple(int(x) for x in v.split(",")), default=None,
                    help="comma-separated prompt lengths of the batch's 3 samples (default 77,300,2; CPU 5,12,2); "
                         "Chroma's mask also keeps each prompt's first padding token, as ChromaPipeline's does")
    ap.add_argument("--caption-lengths", default=None,
                    help='JSON file {"t5_tokens": [...]}: each step draws the 3 prompt lengths from it '
                         '(benchmarks/captions/*.json, made by benchmarks/caption_lengths.py)')
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per variant (default 2; compiled 3)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3, help="steps per variant per round")
    ap.add_argument("--max-seconds", type=float, default=240.0,
                    help="start no new round after this many seconds since the start (at least one runs)")
    ap.add_argument("--json", default=None, help="write config, environment and every measurement here")
    ap.add_argument("--png", default=None, help="bar chart of ms per step per variant (needs matplotlib)")
    ap.add_argument("--gpu-busy", action="store_true",
                    help="after the rounds, one more step per variant under torch.profiler (CUDA activity only): "
                         "the time the GPU ran kernels, copies or fills, against that step's wall time; well "
                         "below 100%% means the host (Python, launches) sets the step's pace")
    ap.add_argument("--timeline-stack", action="store_true",
                    help="with --timeline: record Python functions too (self time per function; slower)")
    ap.add_argument("--trace-dir", default=None,
                    help="with --timeline: keep each variant's profiled step there (Chrome trace, gzipped)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="after the rounds, N more steps per variant under cProfile (the main thread: the forward, "
                         "the loss, the optimizer): its Python self time per source file and the top functions, "
                         "to tell where a variant's host time over stock's goes")
    ap.add_argument("--timeline", action="store_true",
                    help="after the rounds, one more step per variant under torch.profiler (CPU and CUDA): launch "
                         "lag per thread, GPU busy per slice of the step, host waits (benchmarks/_common.py, timeline_summary)")
    return ap.parse_args()


# ------------------------------------------------------------------------------------- the model

def build_model(args, dev: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, dict]:
    """The random-init transformer on ``dev`` in ``dtype``, with its config."""
    cfg = dict(MODELS[args.model][dev.type])
    modeling = logging.getLogger("diffusers.models.modeling_utils")
    level = modeling.level
    modeling.setLevel(logging.ERROR)  # diffusers warns on any dtype cast of a model built in code
    previous = torch.get_default_dtype()
    # Built on the device in the target dtype: a full-depth model initialised in float32 on the
    # host would take minutes and 36 / 82 GB.
    torch.set_default_dtype(dtype)
    torch.manual_seed(0)
    try:
        with torch.device(dev):
            if args.model == "chroma":
                from diffusers import ChromaTransformer2DModel

                cfg["double"] = args.double if args.double is not None else cfg["double"]
                cfg["single"] = args.single if args.single is not None else cfg["single"]
                model = ChromaTransformer2DModel(
                    patch_size=1, in_channels=cfg["in_channels"], num_layers=cfg["double"],
                    num_single_layers=cfg["single"], attention_head_dim=cfg["head_dim"],
                    num_attention_heads=cfg["heads"], joint_attention_dim=cfg["joint_dim"],
                    axes_dims_rope=cfg["rope"], approximator_num_channels=cfg["appr_channels"],
                    approximator_hidden_dim=cfg["appr_hidden"], approximator_layers=cfg["appr_layers"])
            else:
                from diffusers import QwenImageTransformer2DModel

                cfg["layers"] = args.layers if args.layers is not None else cfg["layers"]
                model = QwenImageTransformer2DModel(
                    patch_size=2, in_channels=cfg["in_channels"], out_channels=cfg["out_channels"],
                    num_layers=cfg["layers"], attention_head_dim=cfg["head_dim"],
                    num_attention_heads=cfg["heads"], joint_attention_dim=cfg["joint_dim"],
                    axes_dims_rope=cfg["rope"])
        model = model.to(dev, dtype)
    finally:
        torch.set_default_dtype(previous)
        modeling.setLevel(level)
    return model, cfg


def enable(model: torch.nn.Module, spec: str) -> None:
    """``enable_varlen`` for a ``--backends`` entry: a backend name, then any of ``@general``
    (compiled blocks keep attention in the custom op, ``in_graph=False``), ``@notrim``
    (``trim_text=False``: the padded text columns stay in the model), ``@stockmask``
    (``restore_checkpoint_mask=False``: checkpointed blocks called without their mask attend
    unmasked, as stock's do), ``@costs=FILE`` (auto routes this variant's steps by the cost
    table FILE) and ``@bucket=N`` (its kept text lengths round up to N, ``varlen_attn.trim.BUCKET``
    for its steps: buckets compared side by side; :class:`Variant`). Eagerly ``@general``
    changes nothing: ``varlen:auto,varlen:auto@general`` is an A/A pair, what the harness resolves
    (at 512 px on an H200 two such variants differed by 6-12% over 8-10 rounds, and by 0.2%,
    interval 0.99-1.02, over 50 rounds of one step: benchmarks/NOTES.md entries 57, 58)."""
    backend, *options = spec.split("@")
    known = ("general", "notrim", "stockmask")
    unknown = [o for o in options if o not in known and not o.startswith(("costs=", "bucket="))]
    if unknown:
        raise SystemExit(f"variant {spec!r}: unknown options {unknown} "
                         f"(expected {', '.join(known)}, costs=FILE, bucket=N)")
    va.enable_varlen(model, backend=backend, in_graph="general" not in options,
                     trim_text="notrim" not in options, restore_checkpoint_mask="stockmask" not in options)


def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [*model.transformer_blocks, *getattr(model, "single_transformer_blocks", [])]


def add_lora(model: torch.nn.Module, rank: int) -> int:
    """LoRA (peft, default init) on every attention projection; everything else frozen. Returns
    the number of adapted linear layers."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as e:
        raise SystemExit(f"this benchmark needs peft (pip install 'peft==0.21.2'): {e}") from e
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=LORA_TARGETS), model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return sum(1 for n, _ in model.named_modules() if n.endswith(".lora_A"))


class CallerCheckpoint:
    """A block's forward checkpointed by the caller with ``torch.utils.checkpoint`` itself
    (non-reentrant), not through diffusers' ``enable_gradient_checkpointing()``: OneTrainer's way."""

    def __init__(self, forward):
        self.forward = forward

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


def sharing_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the module tree that shares every frozen parameter and every buffer with
    ``model`` (no extra weight memory) and owns copies of the trainable ones (the LoRA adapter)."""
    memo = {id(p): p for p in model.parameters() if not p.requires_grad}
    memo.update({id(b): b for b in model.buffers()})
    return copy.deepcopy(model, memo)


# --------------------------------------------------------------------------------------- the batch

class Batch:
    """The fixed inputs of every step, and a NEW mask tensor per call of :meth:`mask`."""

    def __init__(self, args, cfg, dev, dtype):
        gpu = dev.type == "cuda"
        grid = args.px // (16 if gpu else 128)
        lengths = args.prompt_lengths or PROMPT_LENGTHS[dev.type]
        if args.model == "chroma":  # ChromaPipeline keeps the first padding token of each prompt
            lengths = tuple(min(n + 1, TEXT_TOKENS[dev.type]) for n in lengths)
        self.shape = C.Shape(3, TEXT_TOKENS[dev.type], grid * grid, lengths,
                             heads=cfg["heads"], head_dim=cfg["head_dim"])
        self.model_name = args.model
        self.mask_dtype = {"bool": torch.bool, "float": dtype, "long": torch.long}[args.mask_dtype]
        b, t, n = self.shape.batch, self.shape.text, self.shape.image
        g = torch.Generator(device=dev).manual_seed(1)

        def rand(*size):
            return torch.randn(*size, device=dev, dtype=dtype, generator=g)

        channels = cfg["in_channels"]
        self.target = rand(b, n, channels)
        self.inputs = {"hidden_states": rand(b, n, channels), "encoder_hidden_states": rand(b, t, cfg["joint_dim"]),
                       "timestep": torch.rand(b, device=dev, generator=g).to(dtype), "return_dict": False}
        if args.model == "chroma":
            img_ids = torch.zeros(grid, grid, 3, device=dev)  # the pipeline's latent image ids
            img_ids[..., 1] = torch.arange(grid, device=dev)[:, None]
            img_ids[..., 2] = torch.arange(grid, device=dev)[None, :]
            self.inputs.update(img_ids=img_ids.reshape(n, 3).to(dtype), txt_ids=torch.zeros(t, 3, device=dev, dtype=dtype))
            self._keep = C.joint_keep(self.shape, dev)  # [B, text + image]
        else:
            self.inputs.update(img_shapes=[[(1, grid, grid)]] * b)  # as QwenImagePipeline passes them
            self._keep = C.text_keep(self.shape, dev)  # [B, text]
        self._keep = self._keep.to(self.mask_dtype)
        # --caption-lengths: a mask per step, its 3 prompt lengths drawn from the file's (the same
        # sequence for every variant: step i of each variant gets masks[i % 64]).
        self._masks = []
        self.drawn: list[list[int]] = []  # the text columns each caption-lengths mask keeps
        if args.caption_lengths:
            pool = json.loads(pathlib.Path(args.caption_lengths).read_text())["t5_tokens"]
            draw = torch.Generator().manual_seed(0)
            extra = 1 if args.model == "chroma" else 0
            for _ in range(64):
                picks = torch.randint(0, len(pool), (b,), generator=draw).tolist()
                lens = torch.tensor([min(pool[i] + extra, t) for i in picks], device=dev)
                self.drawn.append(lens.tolist())
                text = torch.arange(t, device=dev)[None] < lens[:, None]
                keep = text if args.model != "chroma" else torch.cat(
                    [text, torch.ones(b, n, dtype=torch.bool, device=dev)], 1)
                self._masks.append(keep.to(self.mask_dtype))

    def mask(self, i: int = 0) -> torch.Tensor:
        """A new tensor (new storage, new identity) for a variant's ``i``-th step: the same prompt
        lengths every step, or with ``--caption-lengths`` the ``i``-th draw."""
        return (self._masks[i % len(self._masks)] if self._masks else self._keep).clone()

    def kwargs(self, mask: torch.Tensor | None) -> dict:
        name = "attention_mask" if self.model_name == "chroma" else "encoder_hidden_states_mask"
        return {**self.inputs, name: mask}


# ---------------------------------------------------------------------------------------- variants

NO_CUDNN = "/nocudnn"  # a variant name's suffix: its steps run with SDPA's cuDNN attention off


_SELECTED: list = [None]  # the tables auto routes by now (None: the packaged ones, as loaded)


def select_tables(v: "Variant") -> None:
    """Make ``v``'s cost tables (``@costs=FILE``, loaded once; else the packaged ones) auto's,
    where another variant's are (``va.costs.use``): no file read for a variant's own, and a no-op
    where they already are. The timed loop calls it before its stopwatch starts; the crossovers a
    swap clears are worked out again at the variant's first masked call."""
    if _SELECTED[0] is not v.tables:
        va.costs.use(v.tables)
        _SELECTED[0] = v.tables


class Variant:
    def __init__(self, name: str, model: torch.nn.Module, masked: bool, lr: float):
        self.name, self.model, self.masked = name, model, masked
        # None: the process's setting (--cudnn-sdp); False: off for this variant's steps (the
        # kernel A100 and RTX GPUs get for masked SDPA, and what varlen_attn's routing reads).
        self.cudnn = False if name.endswith(NO_CUDNN) else None
        # "@costs=FILE": auto's cost table for this variant's steps, the packaged one for the
        # others: tables compared side by side in one process (select_tables).
        path = next((o.removeprefix("costs=") for o in name.removesuffix(NO_CUDNN).split("@")[1:]
                     if o.startswith("costs=")), None)
        self.tables = va.costs.load(path) if path else None
        # "@bucket=N": the trim's bucket for this variant's steps, the packaged one for the others.
        self.bucket = next((int(o.removeprefix("bucket=")) for o in name.removesuffix(NO_CUDNN).split("@")[1:]
                            if o.startswith("bucket=")), va.trim.BUCKET)
        self.lora = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.lora, lr=lr)
        self.rounds: list[list[float]] = []  # ms per timed step, one list per round's turn
        self.cpu_ms: list[float] = []  # CPU time of the main thread per step (not the backward's thread)
        self.other_cpu_ms: list[float] = []  # CPU time of the other threads per step (the backward's)
        self.host: list[dict] = []  # per step: what else the host did (HostEvents.delta)
        self.peak_bytes = 0
        self.stats = {"backends": {}, "fallbacks": {}, "routes": {}, "plan_builds": 0, "host_syncs": 0,
                      "text_trims": 0, "trimmed_tokens": 0}
        self.steps = 0  # steps run (masks drawn), warm-up included
        self.timed_steps = 0
        self.new_graphs = 0
        self.first: dict = {}
        self.error: str | None = None

    @property
    def times(self) -> list[float]:
        return [ms for turn in self.rounds for ms in turn]

    def step(self, batch: Batch, probe: bool = False):
        """One training step with a new mask; with ``probe``, what the first step produced."""
        mask = batch.mask(self.steps) if self.masked else None
        self.steps += 1
        if torch.cuda.is_available():
            # A new iteration for CUDA graphs (mode="reduce-overhead"): the last step's graph
            # outputs may be overwritten. Nothing otherwise.
            torch.compiler.cudagraph_mark_step_begin()
        before = torch.backends.cuda.cudnn_sdp_enabled()
        if self.cudnn is not None:
            torch.backends.cuda.enable_cudnn_sdp(self.cudnn)
        select_tables(self)
        bucket, va.trim.BUCKET = va.trim.BUCKET, self.bucket
        try:
            out = self.model(**batch.kwargs(mask))[0]
            loss = F.mse_loss(out.float(), batch.target.float())
            loss.backward()
        finally:
            torch.backends.cuda.enable_cudnn_sdp(before)
            va.trim.BUCKET = bucket
        if probe:
            self.first = {"output": out.detach().float().clone(), "loss": loss.item(),
                          "lora_with_grad": sum(p.grad is not None for p in self.lora), "lora_tensors": len(self.lora)}
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def add_stats(self, st: dict) -> None:
        for key in ("backends", "fallbacks", "routes"):
            for k, n in st[key].items():
                self.stats[key][k] = self.stats[key].get(k, 0) + n
        for key in ("plan_builds", "host_syncs", "text_trims", "trimmed_tokens"):
            self.stats[key] += st[key]


def raise_recompile_limits() -> None:
    """Room for a graph per variant per block class (dynamo's default limit is 8 per code object)."""
    cfg = torch._dynamo.config
    for names, least in ((("recompile_limit", "cache_size_limit"), 64),
                         (("accumulated_recompile_limit", "accumulated_cache_size_limit"), 1024)):
        name = next((n for n in names if hasattr(cfg, n)), None)
        if name is not None:
            setattr(cfg, name, max(getattr(cfg, name), least))


def graph_count() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


class HostEvents:
    """What the host did besides the step's own work, per step: garbage collections (count per
    generation and milliseconds, any thread) and the CUDA caching allocator's calls to the driver
    (``cudaMalloc``/``cudaFree``, retries after a failed allocation, which free the cache and
    synchronize). To tell apart the causes of a slow step (benchmarks/NOTES.md entry 35)."""

    ALLOCATOR = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")

    def __init__(self, dev: torch.device):
        self.dev = dev
        self.gc_ms = 0.0
        self.gc_counts = [0, 0, 0]
        self._t0: dict[int, float] = {}
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        tid = threading.get_ident()
        if phase == "start":
            self._t0[tid] = time.perf_counter()
        elif tid in self._t0:
            self.gc_ms += (time.perf_counter() - self._t0.pop(tid)) * 1e3
            self.gc_counts[info["generation"]] += 1

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)

    def snapshot(self) -> dict:
        snap = {"gc_ms": self.gc_ms, "gc_counts": list(self.gc_counts)}
        if self.dev.type == "cuda":
            stats = torch.cuda.memory_stats(self.dev)
            snap.update({k: stats.get(k, 0) for k in self.ALLOCATOR})
        return snap

    @staticmethod
    def delta(before: dict, after: dict) -> dict:
        d = {k: after[k] - before[k] for k in before if k != "gc_counts"}
        d["gc_counts"] = [a - b for a, b in zip(after["gc_counts"], before["gc_counts"])]
        return d


def run_turn(v: Variant, batch: Batch, dev: torch.device, reps: int, compiled: bool, host: HostEvents) -> None:
    """``reps`` timed steps of ``v``: stats, peak memory and new graphs counted for this turn, and
    what else the host did in each step (``host``)."""
    va.reset_stats()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    graphs = graph_count() if compiled else 0
    v.rounds.append([])
    for _ in range(reps):
        # A full collection of the model's ~570k Python objects takes ~0.3 s and comes about
        # every 10 steps, stock and varlen alike (benchmarks/NOTES.md): collect outside the
        # timed step, so that no variant's median depends on where one lands.
        gc.collect()
        C.sync(dev)
        h0 = host.snapshot()
        select_tables(v)
        p0, c0 = time.process_time(), time.thread_time()
        with C.Stopwatch(dev) as sw:
            v.step(batch)
            v.cpu_ms.append((time.thread_time() - c0) * 1e3)  # before the stopwatch's final sync
        v.host.append(HostEvents.delta(h0, host.snapshot()))
        # Every other thread's CPU time over the step, the sync's included on neither side:
        # autograd's device thread (the CUDA backward and checkpoint recomputation) above all.
        v.other_cpu_ms.append(((time.process_time() - p0) - (time.thread_time() - c0)) * 1e3)
        v.rounds[-1].append(sw.ms)
    v.timed_steps += reps
    if compiled:
        v.new_graphs += graph_count() - graphs
    if dev.type == "cuda":
        v.peak_bytes = max(v.peak_bytes, torch.cuda.max_memory_allocated())
    v.add_stats(va.stats())


def gpu_busy(v: Variant, batch: Batch, dev: torch.device) -> dict:
    """One step of ``v`` under torch.profiler, CUDA activity only: the union of the intervals in
    which the GPU ran anything (kernels, copies, fills), and the step's wall time with the
    profiler on (CUPTI adds a little host time per launch, so this step is not a timed one)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    C.sync(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with C.Stopwatch(dev) as sw:
            v.step(batch)
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]
    busy = C.union_ms(spans)  # kernels on several streams may overlap
    top = sorted(((e.key, e.self_device_time_total / 1e3, e.count) for e in prof.key_averages()
                  if e.self_device_time_total > 0), key=lambda x: -x[1])[:12]
    return {"busy_ms": busy / 1e3, "wall_ms": sw.ms, "busy_share": busy / 1e3 / sw.ms if sw.ms else None,
            "gpu_events": len(spans), "top_gpu_ms": [(k[:90], round(ms, 2), n) for k, ms, n in top]}


def cprofile_steps(v: Variant, batch: Batch, dev: torch.device, steps: int) -> dict:
    """``steps`` steps of ``v`` with the main thread under cProfile: ms a step of self time per
    source file (torch's and diffusers' grouped by package, varlen_attn's by module) and the 12
    functions with the most self time. cProfile's own cost inflates Python-heavy code; compare
    variants with each other, not with the timed steps."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    total = 0.0
    for _ in range(steps):
        C.sync(dev)
        t0 = time.thread_time()
        prof.enable()
        v.step(batch)
        prof.disable()
        total += (time.thread_time() - t0) * 1e3 / steps
    files: dict[str, float] = {}
    funcs = []
    for (path, lineno, fn), (_, _, self_s, _, _) in pstats.Stats(prof).stats.items():
        parts = path.replace("\\", "/").split("/")
        group = next((parts[i] + ("/" + parts[i + 1] if parts[i] == "varlen_attn" else "")
                      for i in range(len(parts) - 1) if parts[i] in ("torch", "diffusers", "peft", "varlen_attn")),
                     parts[-1] if path != "~" else fn.split(" ")[0][:40])
        files[group] = files.get(group, 0.0) + self_s * 1e3 / steps
        funcs.append((self_s * 1e3 / steps, f"{parts[-1]}:{lineno}({fn})"[:80]))
    return {"main_thread_ms": round(total, 1),
            "self_ms_by_file": {k: round(ms, 2) for k, ms in sorted(files.items(), key=lambda x: -x[1])[:16]},
            "top_functions_ms": [(f, round(ms, 2)) for ms, f in sorted(funcs, reverse=True)[:12]]}


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


# ------------------------------------------------------------------------------------------ report

def paired_ratios(v: Variant, stock: Variant | None) -> list[float]:
    """stock / variant within each round both ran (medians of their turns): a host or GPU that
    drifts between rounds moves both sides of a ratio alike. None without stock in the process."""
    if stock is None:
        return []
    return [statistics.median(s) / statistics.median(t) for s, t in zip(stock.rounds, v.rounds) if s and t]


def median_ci(values: list[float], level: float = 0.95, resamples: int = 2000) -> tuple[float, float] | None:
    """A percentile bootstrap interval of the median of ``values`` (seeded: the same values give
    the same interval), None below 5 values. Over paired ratios it says what the rounds resolve:
    at 512 px, 50 rounds of one step put an A/A pair's interval at 0.99-1.02 on an H200, where 8
    rounds' range was 6-12% wide (benchmarks/NOTES.md entry 58)."""
    if len(values) < 5:
        return None
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = int(resamples * (1 - level) / 2)
    return meds[tail], meds[resamples - 1 - tail]


def summary(v: Variant, stock: Variant | None) -> dict:
    ms = statistics.median(v.times) if v.times else float("nan")
    stock_ms = statistics.median(stock.times) if stock is not None and stock.times else None
    steps = max(v.timed_steps, 1)
    paired = paired_ratios(v, stock)
    return {
        "median_ms": ms, "min_ms": min(v.times, default=float("nan")),
        "stock_over_variant": (stock_ms / ms) if stock_ms and v.times else None,
        "paired_ratios": paired, "paired_ratio_median": statistics.median(paired) if paired else None,
        "paired_ratio_ci95": median_ci(paired),
        "main_thread_cpu_ms": statistics.median(v.cpu_ms) if v.cpu_ms else None, "main_thread_cpu_times_ms": v.cpu_ms,
        "other_threads_cpu_ms": statistics.median(v.other_cpu_ms) if v.other_cpu_ms else None,
        # Per step, wall time minus the CPU time of every thread: time in which no thread of the
        # process ran (waiting on the GPU, or blocked); can go negative where threads overlap.
        "wall_minus_cpu_ms": statistics.median(w - m - o for w, m, o in zip(v.times, v.cpu_ms, v.other_cpu_ms))
        if v.other_cpu_ms else None,
        "peak_mib": v.peak_bytes / 2**20 if v.peak_bytes else None,
        "timed_steps": v.timed_steps, "times_ms": v.times, "host_events": v.host,
        "slow_steps": slow_steps(v),
        "plan_builds_per_step": v.stats["plan_builds"] / steps, "host_syncs_per_step": v.stats["host_syncs"] / steps,
        "stats": v.stats, "new_graphs_during_timed_steps": v.new_graphs,
        "first_step": {k: x for k, x in v.first.items() if k != "output"}, "error": v.error,
    }


def slow_steps(v: Variant, over: float = 1.10) -> dict | None:
    """The steps slower than ``over`` times the variant's fastest against the rest: how many, and
    per step on each side the median main-thread and other-thread CPU ms, garbage-collection ms,
    collections of the oldest generation and the allocator's driver calls."""
    times = v.times
    if not times or len(v.host) != len(times):
        return None
    fast = min(times)
    sides = {"slow": [], "rest": []}
    for i, ms in enumerate(times):
        sides["slow" if ms > over * fast else "rest"].append(i)

    def med(idx, values):
        return statistics.median(values[i] for i in idx) if idx else None

    out = {"threshold_ms": over * fast}
    for side, idx in sides.items():
        out[side] = {"steps": len(idx), "ms": med(idx, times), "main_cpu_ms": med(idx, v.cpu_ms),
                     "other_cpu_ms": med(idx, v.other_cpu_ms),
                     "gc_ms": med(idx, [h["gc_ms"] for h in v.host]),
                     "gen2_collections": sum(v.host[i]["gc_counts"][2] for i in idx),
                     "device_allocs": sum(v.host[i].get("num_device_alloc", 0) for i in idx),
                     "alloc_retries": sum(v.host[i].get("num_alloc_retries", 0) for i in idx)}
    return out


def line(name: str, r: dict, varlen: bool) -> str:
    if r["error"]:
        return f"  {name:<22} {r['error']}"
    peak = f"{r['peak_mib'] / 1024:7.2f} GiB" if r["peak_mib"] else "      - GiB"
    ratio = f"{r['stock_over_variant']:5.2f}x" if r["stock_over_variant"] else "    -"
    paired = r["paired_ratios"]
    if name != "stock" and len(paired) > 1:  # per round: median, its 95% interval, the range over rounds
        ci = r.get("paired_ratio_ci95")
        ci = f", 95% CI {ci[0]:.3f}-{ci[1]:.3f}" if ci else ""
        ratio += f" (rounds {r['paired_ratio_median']:.3f}x{ci}, range {min(paired):.2f}-{max(paired):.2f})"
    extra = ""
    if varlen:
        ran = ",".join(f"{k}:{n}" for k, n in r["stats"]["backends"].items()) or "none"
        extra = (f"  syncs/step {r['host_syncs_per_step']:5.1f}  plans/step {r['plan_builds_per_step']:5.1f}"
                 f"  ran {ran}")
        if r["stats"]["fallbacks"]:
            extra += f"  FALLBACKS {sum(r['stats']['fallbacks'].values())}"
    if "max_abs_diff_vs_stock" in r:
        extra += f"  step-0 max|diff| vs stock {r['max_abs_diff_vs_stock']:.2e}"
    cpu = f"  main-thread CPU {r['main_thread_cpu_ms']:7.1f} ms" if r["main_thread_cpu_ms"] is not None else ""
    if r.get("other_threads_cpu_ms") is not None:
        cpu += f", other threads {r['other_threads_cpu_ms']:7.1f} ms"
    if r.get("wall_minus_cpu_ms") is not None:
        cpu += f", wall minus CPU {r['wall_minus_cpu_ms']:6.1f} ms"
    if r.get("gpu_busy") and r["gpu_busy"]["busy_share"] is not None:
        g = r["gpu_busy"]
        cpu += f"  GPU busy {g['busy_ms']:7.1f} of {g['wall_ms']:7.1f} ms ({g['busy_share']:4.0%}, profiled step)"
    slow = r.get("slow_steps")
    if slow:
        sl, rest = slow["slow"], slow["rest"]
        extra += (f"\n  {'':<22} slow steps (>{slow['threshold_ms']:.0f} ms) {sl['steps']}/{sl['steps'] + rest['steps']}:"
                  f" gc ms {sl['gc_ms'] or 0:.1f} vs {rest['gc_ms'] or 0:.1f}, gen-2 collections {sl['gen2_collections']}"
                  f"/{rest['gen2_collections']}, cudaMalloc {sl['device_allocs']}/{rest['device_allocs']},"
                  f" alloc retries {sl['alloc_retries']}/{rest['alloc_retries']}")
    return f"  {name:<22} {r['median_ms']:9.1f} ms/step  {ratio}{cpu}  peak {peak}{extra}"


def write_png(path: str, results: dict, title: str) -> None:
    plt = C.pyplot(path)
    if plt is None:
        return
    names = [n for n, r in results.items() if not r["error"]]
    ms = [results[n]["median_ms"] for n in names]
    colors = ["tab:gray" if n == "stock" else "tab:green" if n == "nomask" else "tab:blue" for n in names]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(names) + 1.5))
    bars = ax.barh(names, ms, color=colors)
    for bar, n in zip(bars, names):
        ratio = results[n]["stock_over_variant"]
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                f" {bar.get_width():.1f} ms" + (f" ({ratio:.2f}x)" if ratio else ""), va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per training step (median; lower is better)")
    ax.set_title(title, fontsize=9)
    ax.set_xlim(0, max(ms) * 1.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


# -------------------------------------------------------------------------------------------- main

def main():
    t_start = time.perf_counter()
    args = parse_args()
    dev = C.device_of(args)
    gpu = dev.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    if gpu and args.cudnn_sdp == "off":  # it failed inside these models on torch 2.11 (docs/versions.md)
        torch.backends.cuda.enable_cudnn_sdp(False)
    warnings.filterwarnings("ignore", message=".*FluxPosEmbed.* is deprecated", category=FutureWarning)
    compiled = args.compile != "none"
    warmup = args.warmup if args.warmup is not None else (3 if compiled else 2)
    compile_backend = args.compile_backend or ("inductor" if gpu else "aot_eager")
    backends = args.backends.split(",") if args.backends else ["auto", *C.varlen_backends(dev)]
    if compiled and any(n.endswith(NO_CUDNN) for n in (args.variants or "").split(",")):
        # Dynamo does not guard on the flag either: the variants' blocks share their graphs' kernel.
        raise SystemExit(f"--variants: a compiled step's SDPA kernel is fixed when its graph is compiled, so "
                         f"compiled variants cannot differ in cuDNN's attention ({NO_CUDNN}): run them in a "
                         f"process of their own with --cudnn-sdp off")
    if compiled:  # one graph per variant (masked, unmasked, each backend) per block class
        raise_recompile_limits()
        # SDPA's kernel is chosen when a graph is compiled, and inductor's on-disk graph cache does
        # not key on that choice (pytorch/pytorch#185449): with --cudnn-sdp off, stock's compiled
        # Chroma 1024 px step took 1,446 ms, as with cuDNN's attention in the run before it on that
        # machine, where compiled with it off it took 1,940 (H200, benchmarks/NOTES.md entry 57).
        torch._inductor.config.fx_graph_cache = False

    base, cfg = build_model(args, dev, dtype)
    nparams = sum(p.numel() for p in base.parameters())
    adapted = add_lora(base, args.lora_rank)
    nlora = sum(p.numel() for p in base.parameters() if p.requires_grad)
    if args.checkpointing == "on":
        base.enable_gradient_checkpointing()
    batch = Batch(args, cfg, dev, dtype)
    depth = (f"{cfg['double']} double + {cfg['single']} single blocks" if args.model == "chroma"
             else f"{cfg['layers']} layers")
    env = C.environment(dev)
    env["cudnn_sdp"] = torch.backends.cuda.cudnn_sdp_enabled() if gpu else None
    env.update(peft=C._version("peft"), flash_attn_3=C._version("flash_attn_3") or C._version("flash-attn-3"))
    s = batch.shape
    drawn = sorted(n for lens in batch.drawn for n in lens)
    lengths_note = (f"lengths {list(s.lengths)}" if not drawn else
                    f"lengths drawn from {os.path.basename(args.caption_lengths)}: kept {drawn[0]}..{drawn[-1]}, "
                    f"median {drawn[len(drawn) // 2]}")
    size = f"{nparams / 1e9:.2f} B" if nparams >= 1e8 else f"{nparams / 1e6:.2f} M"
    title = (f"{args.model} {depth}, {size} params + LoRA r={args.lora_rank} ({nlora / 1e6:.2f} M), "
             f"B={s.batch}, text {s.text} ({lengths_note}) + {s.image} image tokens, {args.px} px, "
             f"{str(dtype).replace('torch.', '')},\ncheckpointing {args.checkpointing}, compile {args.compile}"
             + (f" ({compile_backend}{', ' + args.compile_mode if args.compile_mode else ''})" if compiled else ""))
    print(f"{env['gpu']}, torch {env['torch']}, diffusers {env['diffusers']}, peft {env['peft']}, "
          f"flash-attn-4 {env['flash_attn_4']}, flash-attn {env['flash_attn']}, varlen_attn from {env['varlen_attn_path']}")
    print(title)
    print(f"  LoRA on {adapted} attention projections; {args.mask_dtype} mask, a new tensor every step; "
          f"varlen backends {backends}")

    # Variants: own module tree and adapter each (same LoRA init), frozen base weights shared.
    variants = []
    names = args.variants.split(",") if args.variants else ["stock", "nomask", *(f"varlen:{b}" for b in backends)]
    bad = [n for n in names if n.removesuffix(NO_CUDNN) not in ("stock", "nomask")
           and not (n.startswith("varlen:") and len(n.removesuffix(NO_CUDNN)) > 7)]
    if bad:
        raise SystemExit(f"--variants: expected stock, nomask or varlen:<backend>, each optionally ending "
                         f"in {NO_CUDNN}, got {bad}")
    backends = [n.removesuffix(NO_CUDNN).split(":", 1)[1] for n in names if n.startswith("varlen:")]
    for name in names:
        model = sharing_copy(base)
        if args.checkpointing == "caller":  # per copy: a deep copy would keep the original's bound forward
            for block in blocks_of(model):
                block.forward = CallerCheckpoint(block.forward)
        if name.startswith("varlen:"):
            enable(model, name.removesuffix(NO_CUDNN).split(":", 1)[1])
        if args.compile == "blocks":
            for block in blocks_of(model):
                block.compile(fullgraph=True, dynamic=False, backend=compile_backend, mode=args.compile_mode)
        elif args.compile == "whole":
            model = torch.compile(model, fullgraph=True, dynamic=False, backend=compile_backend,
                                  mode=args.compile_mode)
        variants.append(Variant(name, model, masked=name.removesuffix(NO_CUDNN) != "nomask", lr=args.lr))
    del base
    if gpu:
        torch.cuda.synchronize()
    weights_mib = torch.cuda.memory_allocated() / 2**20 if gpu else None

    # Warm-up: the first step of each variant is probed (output, loss, which LoRA tensors got a gradient).
    for v in variants:
        try:
            t0 = time.perf_counter()
            va.reset_stats()
            print(f"  warming up {v.name}", file=sys.stderr, flush=True)  # names the variant a crash happens in
            for i in range(warmup):
                v.step(batch, probe=(i == 0))
            C.sync(dev)
            v.warmup_stats = va.stats()
            v.warmup_s = time.perf_counter() - t0
        except Exception as e:  # a variant that cannot run (OOM at full depth, a backend refusing) is reported
            if not (is_oom(e) or isinstance(e, va.VarlenAttnError)):
                raise
            v.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            v.opt.zero_grad(set_to_none=True)
            if gpu:
                torch.cuda.empty_cache()
            print(f"  {v.name}: warm-up failed, left out: {v.error}")
    live = [v for v in variants if v.error is None]

    # Interleaved rounds, time-boxed.
    host = HostEvents(dev)
    rounds_run = 0
    for _ in range(args.rounds):
        if rounds_run and time.perf_counter() - t_start > args.max_seconds:
            break
        # Every other round in reverse order: no variant always runs right after the same one.
        for v in (live if rounds_run % 2 == 0 else live[::-1]):
            if v.error is None:
                try:
                    run_turn(v, batch, dev, args.reps, compiled, host)
                except Exception as e:
                    if not is_oom(e):
                        raise
                    v.error = f"{type(e).__name__} in round {rounds_run + 1}"
                    v.opt.zero_grad(set_to_none=True)
                    if gpu:
                        torch.cuda.empty_cache()
        rounds_run += 1
    host.close()
    elapsed = time.perf_counter() - t_start
    busy = {}
    if args.gpu_busy and gpu:
        for v in (v for v in live if v.error is None):
            try:
                busy[v.name] = gpu_busy(v, batch, dev)
            except Exception as e:  # a profiler that cannot run here costs the column, not the run
                print(f"  --gpu-busy {v.name}: {type(e).__name__}: {e}")

    profiles = {}
    if args.cprofile:
        for v in (v for v in live if v.error is None):
            profiles[v.name] = cprofile_steps(v, batch, dev, args.cprofile)

    lines = {}
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    if args.timeline and gpu:
        for v in (v for v in live if v.error is None):
            with tempfile.TemporaryDirectory() as tmp:  # a full-depth step's trace runs to 100s of MB
                path = os.path.join(tmp, "trace.json")
                try:
                    C.sync(dev)
                    C.timeline_record(functools.partial(v.step, batch), path, stack=args.timeline_stack)
                    lines[v.name] = C.timeline_summary(path)
                    if args.trace_dir:
                        stem = v.name.replace(":", "_").replace("/", "_").replace("@", "_")
                        out = os.path.join(args.trace_dir, stem + ".json.gz")
                        with open(path, "rb") as src, gzip.open(out, "wb", compresslevel=6) as dst:
                            shutil.copyfileobj(src, dst)
                except Exception as e:  # as --gpu-busy: the column is lost, not the run
                    print(f"  --timeline {v.name}: {type(e).__name__}: {e}")

    stocks = {v.name: v for v in variants if v.name.removesuffix(NO_CUDNN) == "stock"}
    stock = stocks.get("stock")
    results = {}
    for v in variants:
        # Against the stock that ran with the same cuDNN setting.
        r = summary(v, stocks.get("stock" + NO_CUDNN) if v.cudnn is False else stock)
        r["warmup_s"] = getattr(v, "warmup_s", None)
        r["warmup_stats"] = getattr(v, "warmup_stats", None)
        r["gpu_busy"] = busy.get(v.name)
        r["timeline"] = lines.get(v.name)
        r["cprofile"] = profiles.get(v.name)
        if stock is not None and v.first and stock.first and v is not stock:
            r["max_abs_diff_vs_stock"] = (v.first["output"] - stock.first["output"]).abs().max().item()
        results[v.name] = r
    if stock is not None and stock.first:
        results["stock"]["first_step"]["max_abs_output"] = stock.first["output"].abs().max().item()

    print(f"median ms per step over {rounds_run} round(s) x {args.reps} step(s) per variant "
          f"(asked {args.rounds}; {elapsed:.0f} s in all, --max-seconds {args.max_seconds:g}); ratio = stock / variant:")
    for v in variants:
        print(line(v.name, results[v.name], v.name.startswith("varlen:")))
    if lines:
        print("one more step per variant under torch.profiler (benchmarks/_common.py, timeline_summary):")
        for name, summary_ in lines.items():
            print(C.timeline_text(name, summary_))
    for name, pr in profiles.items():
        print(f"  --cprofile {name}: main thread {pr['main_thread_ms']} ms a step under cProfile; self ms by file "
              f"{pr['self_ms_by_file']}; top {pr['top_functions_ms'][:8]}")
    if compiled:
        from torch._dynamo.utils import counters

        breaks = dict(counters["graph_break"])
        print(f"  compiled blocks: new graphs during timed steps "
              f"{ {n: r['new_graphs_during_timed_steps'] for n, r in results.items()} }; graph breaks {breaks or 'none'}")
    if args.model == "chroma" and args.checkpointing == "on":
        print("  note: stock Chroma with checkpointing runs its single blocks unmasked (diffusers drops the mask "
              "there); varlen restores it, so its step-0 output differs from stock's in those blocks")
    if not gpu:
        print("CPU smoke run: the numbers above are toy-size wall times and mean nothing.")

    if args.json:
        config = {**vars(args), "warmup": warmup, "compile_backend": compile_backend if compiled else None,
                  "backends": backends, "dtype": str(dtype), "model_config": cfg,
                  "batch": s.batch, "text_tokens": s.text, "image_tokens": s.image,
                  "prompt_lengths": None if drawn else list(s.lengths), "drawn_text_lengths": batch.drawn or None,
                  "params": nparams, "lora_params": nlora, "lora_layers": adapted, "lora_targets": LORA_TARGETS}
        with open(args.json, "w") as fh:
            json.dump({"config": config, "env": env, "gpu": env["gpu"], "title": title,
                       "rounds_run": rounds_run, "elapsed_s": elapsed, "weights_mib": weights_mib,
                       "results": results}, fh, indent=1, default=str)
        print(f"wrote {args.json}")
    if args.png:
        write_png(args.png, results, title)
    if compiled:
        for v in variants:
            v.model = None
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
