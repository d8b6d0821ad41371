"""Which plain-PyTorch SDPA sequence makes cuDNN's attention fail (no varlen_attn, no diffusers).

    python benchmarks/cudnn_crash_probe.py            # every case, each in a fresh process
    python benchmarks/cudnn_crash_probe.py --texts 320,384,512 --images 1024 --cases 'outer*2;keypad*2'

Each case runs forward + backward of ``F.scaled_dot_product_attention`` with PyTorch's default
kernel choice (cuDNN's attention on H100/H200/B200), batch 3, 24 heads of 128, bf16, a joint
sequence of T text tokens (512 by default; 77, 300 and 2 valid) and N image tokens, in the order it names:
``outer`` is Chroma's mask ``[B, 1, S, S]`` (padded queries attend nothing), ``keypad`` the key
padding ``[B, 1, 1, S]``, ``none`` no mask. A case passes when every call returns, the GPU
synchronises and no gradient holds a NaN; it fails otherwise (exit code, last error line).
"""

from __future__ import annotations

import os
import subprocess
import sys

CASES = ["outer*6", "outer*3,none*3", "keypad*3,none*3", "none*6", "outer*3,keypad*3"]
IMAGES = (1024, 4096)


def run_case(case: str, image: int, text: int) -> None:
    import torch
    import torch.nn.functional as F

    b, h, d = 3, 24, 128
    s = text + image
    lengths = torch.tensor([77, 300, 2], device="cuda")
    keep = torch.cat([torch.arange(text, device="cuda")[None] < lengths[:, None],
                      torch.ones(b, image, dtype=torch.bool, device="cuda")], 1)
    masks = {"outer": keep[:, None, :, None] & keep[:, None, None, :], "keypad": keep[:, None, None, :], "none": None}
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    for step in case.split(","):
        name, times = step.split("*")
        for _ in range(int(times)):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=masks[name])
            out.float().square().mean().backward()
            torch.cuda.synchronize()
            bad = [n for n, t in (("q", q), ("k", k), ("v", v)) if not torch.isfinite(t.grad).all()]
            if bad:
                raise SystemExit(f"non-finite grad of {bad} after {name}")
            q.grad = k.grad = v.grad = None


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--case":
        run_case(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    import argparse

    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    ap.add_argument("--texts", type=ints, default=[512], help="padded text lengths T (at least 300)")
    ap.add_argument("--images", type=ints, default=list(IMAGES), help="image token counts N")
    ap.add_argument("--cases", type=lambda v: v.split(";"), default=CASES, help="';'-separated cases")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    for text in args.texts:
        for image in args.images:
            for case in args.cases:
                p = subprocess.run([sys.executable, __file__, "--case", case, str(image), str(text)],
                                   capture_output=True, text=True, timeout=300, env=dict(os.environ))
                last = (p.stderr.strip().splitlines() or [""])[-1][:160]
                print(f"S={text + image:>5} (T={text}) {case:<18} "
                      f"{'ok' if p.returncode == 0 else 'FAILED rc=%d: %s' % (p.returncode, last)}", flush=True)


if __name__ == "__main__":
    main()
