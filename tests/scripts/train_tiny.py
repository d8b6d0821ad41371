"""A tiny diffusers training script, written as trainers write theirs: it knows nothing of
varlen_attn. tests/test_launch.py runs it with ``python`` and with ``python -m varlen_attn``.

It builds a tiny Qwen-Image transformer (the "pretrained" checkpoint: validated, then saved),
loads it back with ``from_pretrained``, trains it a few steps on batches whose prompts are
padded (``encoder_hidden_states_mask``), saves it, and reloads a fresh transformer from what it
saved for the final validation, as diffusers' LoRA scripts do. Each validation line holds the
loss with the prompt mask and without it. Everything runs in float32.
"""

import argparse
import os

import torch
import torch.nn.functional as F
from diffusers import QwenImageTransformer2DModel

CONFIG = dict(patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16,
              num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
BATCH, TEXT, HEIGHT, WIDTH = 3, 7, 4, 5


def batch(generator):
    """Latents, padded prompt embeddings and their mask (caption dropout: a prompt may be empty)."""
    lengths = torch.randint(0, TEXT + 1, (BATCH,), generator=generator)
    mask = torch.arange(TEXT)[None, :] < lengths[:, None]
    return {
        "hidden_states": torch.randn(BATCH, HEIGHT * WIDTH, 4, generator=generator),
        "encoder_hidden_states": torch.randn(BATCH, TEXT, 32, generator=generator),
        "encoder_hidden_states_mask": mask,
        "timestep": torch.rand(BATCH, generator=generator),
        "img_shapes": [(1, HEIGHT, WIDTH)] * BATCH,
    }


def flow_loss(model, inputs, generator, masked=True):
    noise = torch.randn(inputs["hidden_states"].shape, generator=generator)
    t = inputs["timestep"][:, None, None]
    noisy = (1 - t) * inputs["hidden_states"] + t * noise
    kwargs = {**inputs, "hidden_states": noisy}
    if not masked:
        kwargs["encoder_hidden_states_mask"] = None
    pred = model(**kwargs, return_dict=False)[0]
    return F.mse_loss(pred, noise - inputs["hidden_states"])


@torch.no_grad()
def validate(model, name, seed):
    model.eval()
    inputs = batch(torch.Generator().manual_seed(seed))
    masked = flow_loss(model, inputs, torch.Generator().manual_seed(seed + 1)).item()
    unmasked = flow_loss(model, inputs, torch.Generator().manual_seed(seed + 1), masked=False).item()
    print(f"validation {name} masked {masked!r} unmasked {unmasked!r}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_train_steps", type=int, default=3)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    base = os.path.join(args.output_dir, "base")
    pretrained = QwenImageTransformer2DModel(**CONFIG)
    validate(pretrained, "pretrained", seed=100)
    pretrained.save_pretrained(base)

    transformer = QwenImageTransformer2DModel.from_pretrained(base)
    transformer.train()
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=args.learning_rate)
    generator = torch.Generator().manual_seed(args.seed + 1)
    for step in range(args.max_train_steps):
        loss = flow_loss(transformer, batch(generator), generator)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step} loss {loss.item()!r}")

    final = os.path.join(args.output_dir, "final")
    transformer.save_pretrained(final)
    # Final inference on a fresh transformer loaded from what was saved.
    validate(QwenImageTransformer2DModel.from_pretrained(final), "final", seed=200)


if __name__ == "__main__":
    main()
