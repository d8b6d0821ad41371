"""LoRA training of a Qwen-Image transformer the way trainers run it: stock vs varlen_attn.

The loop is a small version of diffusers' LoRA training scripts: accelerate (``Accelerator``,
``prepare``, ``backward``, gradient clipping), a peft LoRA on the attention projections (through
diffusers' ``add_adapter``) with the base frozen, gradient checkpointing, an EMA copy of the
model made with ``copy.deepcopy``, flow-matching loss, prompts padded to a fixed length with a
text mask, one caption in four dropped (an empty prompt), then the LoRA weights saved and loaded
into a fresh transformer, as a final inference does. It runs twice from the same weights on the
same batches: stock (diffusers' masked SDPA), and with the one line marked ``varlen_attn:``.
It prints both loss curves and ends with one verdict line.

The model is a random-initialised ``QwenImageTransformer2DModel``; nothing is downloaded.

CPU (the default without a GPU): a tiny config in float64, where stock and varlen_attn must agree
to rounding (relative difference <= 1e-10) in every loss, the first step's LoRA gradients, the
final LoRA and EMA weights and the reloaded model's output. No timings: the CPU backends exist
for correctness. GPU: ``--size gpu`` (the default there) is Qwen-Image's width (24 heads of 128,
text width 3584) with 4 blocks instead of 60, a 512 px image (1024 tokens), 512 padded text
tokens, base weights in bf16, LoRA in float32, bf16 autocast. There "equal" means: varlen_attn's
first-step loss and LoRA gradients are at most twice as far from a float32 run of the same step
as stock's are; it also prints the median step time of each and their ratio.

    python examples/train_lora.py                      # CPU, tiny, float64: 10-20 s
    python examples/train_lora.py --size gpu --layers 8 --steps 20
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import os
import statistics
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F

import varlen_attn as va

# Model and batch sizes. ``grid``: the image's latent patches per side (512 px / 8 (VAE) / 2 (patch)).
SIZES = {
    "tiny": dict(heads=2, head_dim=16, layers=2, joint_dim=32, in_channels=16, out_channels=4,
                 rope=(4, 6, 6), batch=4, text=12, grid=4),
    "gpu": dict(heads=24, head_dim=128, layers=4, joint_dim=3584, in_channels=64, out_channels=16,
                rope=(16, 56, 56), batch=3, text=512, grid=32),
}
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
EMA_DECAY = 0.9
FLOAT64_TOL = 1e-10  # float64: stock and varlen_attn agree to rounding
LOW_PRECISION_FACTOR = 2.0  # below float64: at most this many times as far from float32 as stock


def make_transformer(size, dtype, device, seed=0):
    """A random-initialised Qwen-Image transformer: stands for ``from_pretrained`` in a real script."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(
        patch_size=2, in_channels=size["in_channels"], out_channels=size["out_channels"],
        num_layers=size["layers"], attention_head_dim=size["head_dim"], num_attention_heads=size["heads"],
        joint_attention_dim=size["joint_dim"], axes_dims_rope=size["rope"])
    with quiet_casts():
        return model.to(device, dtype)


@contextlib.contextmanager
def quiet_casts():
    """diffusers warns on every dtype cast of a model built in code (and on ``save_lora_adapter``,
    which calls ``to(dtype=None)``), though this one keeps no module in float32; quiet inside."""
    modeling = logging.getLogger("diffusers.models.modeling_utils")
    level = modeling.level
    modeling.setLevel(logging.ERROR)
    try:
        yield
    finally:
        modeling.setLevel(level)


def make_batches(steps, size, seed=1):
    """Latents, noise, sigmas and prompt embeddings padded to ``text`` tokens with their mask;
    one caption in four dropped (an empty prompt: no text token kept). float64, on the CPU."""
    g = torch.Generator().manual_seed(seed)
    b, t, n = size["batch"], size["text"], size["grid"] ** 2
    out = []
    for _ in range(steps):
        lengths = torch.randint(1, t + 1, (b,), generator=g)
        lengths[torch.rand(b, generator=g) < 0.25] = 0  # caption dropout
        out.append(dict(
            latents=torch.randn(b, n, size["in_channels"], generator=g, dtype=torch.float64),
            noise=torch.randn(b, n, size["in_channels"], generator=g, dtype=torch.float64),
            sigmas=torch.rand(b, generator=g, dtype=torch.float64),
            prompt_embeds=torch.randn(b, t, size["joint_dim"], generator=g, dtype=torch.float64),
            prompt_embeds_mask=torch.arange(t)[None] < lengths[:, None],  # [B, T] bool, padded
            lengths=lengths.tolist(),
        ))
    return out


def forward(model, b, size, dtype, device):
    """Flow matching: the model predicts ``noise - latents`` from the noisy latents."""
    sigmas = b["sigmas"].to(device, dtype)
    latents, noise = b["latents"].to(device, dtype), b["noise"].to(device, dtype)
    noisy = (1 - sigmas[:, None, None]) * latents + sigmas[:, None, None] * noise
    pred = model(hidden_states=noisy, encoder_hidden_states=b["prompt_embeds"].to(device, dtype),
                 encoder_hidden_states_mask=b["prompt_embeds_mask"].to(device), timestep=sigmas,
                 img_shapes=[(1, size["grid"], size["grid"])] * len(b["lengths"]), return_dict=False)[0]
    return pred, noise - latents


def train(enable, batches, size, args, weight_dtype, mixed_precision, eval_batch, keep_init=False, init=None,
          reset_accelerate=False):
    """One training run; returns its losses, step times, first-step LoRA gradients, final LoRA and
    EMA weights, the trained and the reloaded model's output on ``eval_batch``, and stats().
    ``keep_init``: also return the initial weights (``init``); ``init``: start from those instead."""
    from accelerate import Accelerator
    from peft import LoraConfig

    device = torch.device(args.device)
    if reset_accelerate:  # accelerate keeps one precision per process; the reference run needs another
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=device.type == "cpu", mixed_precision=mixed_precision)
    transformer = make_transformer(size, weight_dtype, device)
    if enable:
        va.enable_varlen(transformer, args.backend)  # varlen_attn: right after the transformer is built
    transformer.requires_grad_(False)
    transformer.enable_gradient_checkpointing()
    torch.manual_seed(1)  # the LoRA A matrices' init
    transformer.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.rank, init_lora_weights="gaussian",
                                       target_modules=LORA_TARGETS))
    lora = {n: p for n, p in transformer.named_parameters() if p.requires_grad}
    for p in lora.values():  # the trained weights in float32 at least (diffusers' cast_training_params)
        p.data = p.data.to(torch.promote_types(p.dtype, torch.float32))
    if init is not None:  # the same initial weights, converted to this run's dtypes
        transformer.load_state_dict(init)
    init = {k: v.clone() for k, v in transformer.state_dict().items()} if keep_init else None
    ema = copy.deepcopy(transformer)  # an EMA copy; a copy of an enabled model is enabled too
    ema_lora = {n: p for n, p in ema.named_parameters() if n in lora}
    optimizer = torch.optim.AdamW(lora.values(), lr=args.lr)
    transformer, optimizer = accelerator.prepare(transformer, optimizer)
    va.reset_stats()

    losses, times, first_grads = [], [], None
    for step, b in enumerate(batches):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        pred, target = forward(transformer, b, size, weight_dtype, device)
        loss = F.mse_loss(pred.float(), target.float())
        accelerator.backward(loss)
        if step == 0:
            # (the last block's text output is unused, so its to_add_out LoRA gets no gradient)
            first_grads = {"loss": loss.detach().double().reshape(1),
                           **{n: p.grad.detach().double().clone() for n, p in lora.items() if p.grad is not None}}
        accelerator.clip_grad_norm_(list(lora.values()), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for n, p in lora.items():
                ema_lora[n].lerp_(p, 1 - EMA_DECAY)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    train_stats = va.stats()

    # Save the LoRA weights; load them into a fresh transformer, as a script's final inference does.
    # The fresh transformer is stock until it is enabled too.
    model = accelerator.unwrap_model(transformer)
    model.eval()
    with torch.no_grad():
        trained_out = forward(model, eval_batch, size, weight_dtype, device)[0]
    with tempfile.TemporaryDirectory() as d:
        with quiet_casts():
            model.save_lora_adapter(d)
        fresh = make_transformer(size, weight_dtype, device, seed=0)
        if enable:
            va.enable_varlen(fresh, args.backend)  # varlen_attn: the reloaded transformer too
        fresh.load_lora_adapter(d, prefix=None, weight_name="pytorch_lora_weights.safetensors")
    va.reset_stats()
    with torch.no_grad():
        reloaded_out = forward(fresh, eval_batch, size, weight_dtype, device)[0]
    reload_calls = sum(va.stats()["backends"].values())
    return dict(losses=losses, times=times, first=first_grads, stats=train_stats, init=init,
                lora={n: p.detach().double() for n, p in lora.items()},
                ema={n: p.detach().double() for n, p in ema_lora.items()},
                trained_out=trained_out.double(), reloaded_out=reloaded_out.double(), reload_calls=reload_calls)


def rel_diff(a: dict, b: dict, keys=None) -> float:
    """``||a - b|| / ||b||`` over the tensors of ``keys`` (default: all of ``b``) as one vector."""
    keys = list(b) if keys is None else keys
    a = torch.cat([a[n].flatten() for n in keys])
    b = torch.cat([b[n].flatten() for n in keys])
    d = (a - b).norm()
    return 0.0 if d == 0 else (d / b.norm()).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", choices=SIZES, default=None, help="default: tiny on the CPU, gpu on a GPU")
    ap.add_argument("--layers", type=int, default=None, help="transformer blocks (default: by --size)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--precision", choices=["float64", "float32", "bf16"], default=None,
                    help="default: float64 on the CPU, bf16 (autocast, LoRA in float32) on a GPU")
    args = ap.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    size = dict(SIZES[args.size or ("gpu" if gpu else "tiny")])
    if args.layers:
        size["layers"] = args.layers
    precision = args.precision or ("bf16" if gpu else "float64")
    weight_dtype = {"float64": torch.float64, "float32": torch.float32, "bf16": torch.bfloat16}[precision]
    mixed = "bf16" if precision == "bf16" else "no"
    if not gpu and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # a tiny model gains nothing from threads; a busy machine loses much
    warnings.filterwarnings("ignore", message=".*txt_seq_lens.*", category=FutureWarning)

    batches = make_batches(args.steps + 1, size)
    batches, eval_batch = batches[:-1], batches[-1]
    stock = train(False, batches, size, args, weight_dtype, mixed, eval_batch, keep_init=precision != "float64")
    ours = train(True, batches, size, args, weight_dtype, mixed, eval_batch)

    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    print(f"Qwen-Image, random init: {size['layers']} blocks, {size['heads']} heads of {size['head_dim']}, "
          f"batch {size['batch']}, {size['text']} text (padded) + {size['grid'] ** 2} image tokens, "
          f"LoRA r={args.rank}, gradient checkpointing, EMA; {precision}, {name}, torch {torch.__version__}")
    print(f"{'step':>4} {'prompt lengths':>20} {'loss stock':>12} {'loss varlen':>12}")
    for i, b in enumerate(batches):
        print(f"{i:>4} {b['lengths']!s:>20} {stock['losses'][i]:>12.6f} {ours['losses'][i]:>12.6f}")
    st = ours["stats"]
    print(f"varlen_attn in {args.steps} steps: backends {st['backends']}; plan builds {st['plan_builds']}; "
          f"host reads {st['host_syncs']}; fallbacks {st['fallbacks'] or 'none'}")

    # The verdict: float64 to rounding; below it, as close to a step one precision up as stock is.
    reload_ok = ours["reload_calls"] > 0 and stock["reload_calls"] == 0
    reload_same = max(rel_diff({"o": r["reloaded_out"]}, {"o": r["trained_out"]}) for r in (stock, ours))
    if precision == "float64":
        diffs = {"losses": rel_diff({"l": torch.tensor(ours["losses"])}, {"l": torch.tensor(stock["losses"])}),
                 "first-step gradients": rel_diff(ours["first"], stock["first"]),
                 "LoRA weights": rel_diff(ours["lora"], stock["lora"]),
                 "EMA weights": rel_diff(ours["ema"], stock["ema"]),
                 "reloaded output": rel_diff({"o": ours["reloaded_out"]}, {"o": stock["reloaded_out"]})}
        worst = max(diffs, key=diffs.get)
        equal = diffs[worst] <= FLOAT64_TOL and reload_same <= FLOAT64_TOL
        judged = f"worst rel. diff {diffs[worst]:.0e} ({worst}) {'<=' if equal else '>'} {FLOAT64_TOL:.0e}"
    else:  # below float64: the yardstick is stock's own rounding, against a step one precision up
        up = torch.float64 if precision == "float32" else torch.float32
        ref = train(False, batches[:1], size, args, up, "no", eval_batch, init=stock["init"],
                    reset_accelerate=True)["first"]
        grads = [n for n in ref if n != "loss"]
        ratio = max(rel_diff(ours["first"], ref, keys) / max(rel_diff(stock["first"], ref, keys), 1e-30)
                    for keys in (["loss"], grads))
        equal = ratio <= LOW_PRECISION_FACTOR
        judged = (f"first-step loss and LoRA gradients {ratio:.2f}x as far from {str(up)[6:]} as stock's, "
                  f"{'<=' if equal else '>'} {LOW_PRECISION_FACTOR:g}x")
    speed = ""
    if gpu:
        warm = 2 if args.steps > 3 else 0
        ms_s, ms_v = (1e3 * statistics.median(r["times"][warm:]) for r in (stock, ours))
        print(f"median step time (steps {warm}-{args.steps - 1}): stock {ms_s:.1f} ms, varlen_attn {ms_v:.1f} ms")
        speed = f"; stock / varlen_attn step time {ms_s / ms_v:.2f}x"
    else:
        print("CPU: no timings (the CPU backends exist for correctness); a GPU run times both.")
    print(f"saved LoRA reloaded into a fresh transformer: output rel. diff to the trained model {reload_same:.0e}; "
          f"varlen_attn ran {ours['reload_calls']} attention calls there (enabled again after loading)")
    ok = equal and reload_ok
    head = "varlen_attn equals stock" if ok else "varlen_attn DIFFERS from stock"
    if not reload_ok:
        judged += "; the reloaded transformer did not run varlen_attn"
    print(f"VERDICT: {head} ({judged}, {precision}) over {args.steps} LoRA steps{speed}")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
