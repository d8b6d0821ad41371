"""benchmarks/multi_gpu.py end to end in its tiny CPU mode, two gloo processes: the Ulysses
recipe on diffusers' HunyuanVideo (each rank a slice of the video and of the text, the gathered
order's mask) equals one process running the whole sequence, and every cell of both phases ran
its variants on the kernels it names. The timings mean nothing and are not checked."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "multi_gpu.py")

pytest.importorskip("diffusers")
pytest.importorskip("peft")


def test_tiny_cpu_mode_splits_hunyuan_video_exactly_and_runs_every_cell(tmp_path):
    out = tmp_path / "x2.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29621", SCRIPT,
         "--quick", "--device", "cpu", "--rounds", "1", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]

    # Equality with one process, float32: each rank's output slice and the LoRA gradients summed
    # over the ranks. The bound is float32's: the split changes the order of the key sums only.
    (equal,) = [r for r in rows if "ms" not in r]
    assert equal["world"] == 2
    for variant, backend in (("stock", "sdpa"), ("auto", "split_sdpa")):
        got = equal[variant]
        assert got["out"] < 1e-5 and got["grads"] < 1e-4, (variant, got)
        assert set(got["backends"]) == {backend}, (variant, got)

    timed = {(r["what"], r["variant"]): r for r in rows if "ms" in r}
    cells = {what for what, _ in timed}
    assert cells == {"HunyuanVideo 24 tokens", "Chroma LoRA step, ddp", "Chroma LoRA step, fsdp2"}, cells
    for (what, variant), r in timed.items():
        assert r["world"] == 2 and r["ms"] > 0 and len(r["rounds_ms"]) == 1, r
        st = r["stats"]
        assert st["fallbacks"] == {}, r
        if variant == "stock":  # stock attention: nothing packed
            assert set(st["backends"]) <= {"sdpa"}, r
        else:
            assert set(st["backends"]) == {"split_sdpa"} and st["plan_builds"] >= 1, r
