"""benchmarks/headline.py end to end in its tiny CPU mode: a real process of
benchmarks/train_step.py per cell on toy models, the summary, the table and the JSON files.
The timings mean nothing and are not checked; what is checked is that every cell and variant
asked for ran, was measured and reached the table and the JSON."""

import json
import os
import random
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADLINE = os.path.join(ROOT, "benchmarks", "headline.py")
TRAIN_STEP = os.path.join(ROOT, "benchmarks", "train_step.py")
VARIANTS = ["stock", "nomask", "varlen:auto", "varlen:split_sdpa"]

pytest.importorskip("diffusers")
pytest.importorskip("peft")


def run(*argv, timeout=240, script=HEADLINE):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def test_tiny_cpu_mode_measures_every_cell_and_variant(tmp_path):
    cells = ["chroma:512:none", "qwen:1024:none"]
    out = tmp_path / "out"
    proc = run("--device", "cpu", "--cells", ",".join(cells), "--rounds", "1", "--reps", "1", "--jobs", "2",
               "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    summary = json.loads((out / "headline.json").read_text())
    assert list(summary["cells"]) == cells
    assert summary["variants"] == VARIANTS
    for cell in cells:
        per_cell = json.loads((out / (cell.replace(":", "_") + ".json")).read_text())
        assert per_cell["cell"] == cell and per_cell["error"] is None and per_cell["rounds"] == 1
        # one train_step.py process per cell, which measured every variant, each in its turn
        assert per_cell["train_step"]["config"]["variants"] == ",".join(VARIANTS)
        for v in VARIANTS:
            assert len(per_cell["train_step"]["results"][v]["times_ms"]) == 1
            s = summary["cells"][cell]["summary"][v]
            assert s["error"] is None and s["median_ms"] > 0
            assert s["main_thread_cpu_ms"] > 0
            if v == "stock":
                assert s["stock_over_variant"] == pytest.approx(1.0)
            else:
                assert s["stock_over_variant"] > 0
        st = summary["cells"][cell]["summary"]
        # the varlen variants ran varlen_attn (split_sdpa on the CPU); the others did not
        for v in ("varlen:auto", "varlen:split_sdpa"):
            assert list(st[v]["backends"]) == ["split_sdpa"] and st[v]["backends"]["split_sdpa"] > 0, st[v]
        for v in ("stock", "nomask"):
            assert st[v]["plan_builds_per_step"] == 0 and st[v]["backends"] == {}
    # Chroma's mask is an outer product (a host read per call), Qwen-Image's key padding (none,
    # and a plan per call)
    assert summary["cells"]["chroma:512:none"]["summary"]["varlen:auto"]["host_syncs_per_step"] > 0
    qwen = summary["cells"]["qwen:1024:none"]["summary"]["varlen:auto"]
    assert qwen["host_syncs_per_step"] == 0 and qwen["plan_builds_per_step"] > 0

    table = (out / "headline.md").read_text()
    assert table in proc.stdout
    rows = [line for line in table.splitlines() if line.startswith("| Chroma") or line.startswith("| Qwen")]
    assert [r.split("|")[1].strip() for r in rows[:2]] == ["Chroma 512 px, eager", "Qwen-Image 1024 px, eager"]
    for row in rows[:2]:
        assert "failed" not in row and row.count("x") >= 3  # three stock / variant ratios


def test_a_process_over_its_time_box_is_killed_and_reported(tmp_path):
    out = tmp_path / "out"
    proc = run("--device", "cpu", "--cells", "qwen:512:none", "--rounds", "2", "--timeout", "0.5",
               "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    per_cell = json.loads((out / "qwen_512_none.json").read_text())
    assert per_cell["error"] == "killed after --timeout 0.5 s" and per_cell["train_step"] is None
    for v in VARIANTS:
        assert per_cell["summary"][v]["median_ms"] is None
    assert "failed: killed after --timeout 0.5 s" in (out / "headline.md").read_text()


def test_dry_run_spreads_cells_over_the_gpus(tmp_path):
    proc = run("--dry-run", "--gpus", "0,1,2,3", "--rounds", "3", "--out", str(tmp_path), timeout=60)
    assert proc.returncode == 0, proc.stderr
    heads = [line for line in proc.stdout.splitlines() if line.startswith("CUDA_VISIBLE_DEVICES=")]
    cells = {line.split(": ")[1].split(" ")[0]: line.split(":")[0].split("=")[1] for line in heads}
    assert sorted(cells) == sorted(f"{m}:{px}:{c}" for m in ("chroma", "qwen") for px in (512, 1024)
                                   for c in ("none", "blocks"))
    assert sorted(cells.values()) == ["0", "0", "1", "1", "2", "2", "3", "3"]
    commands = [line for line in proc.stdout.splitlines() if "train_step.py" in line]
    assert len(commands) == 8  # one process per cell, every variant in it
    assert all("--variants stock,nomask,varlen:auto,varlen:torch " in c and "--rounds 3 " in c for c in commands)
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


def test_bad_cell_is_refused_with_its_name():
    proc = run("--dry-run", "--gpus", "0", "--cells", "chroma:768:none", timeout=60)
    assert proc.returncode == 2
    assert "--cells: expected model:px:compile" in proc.stderr and "'chroma:768:none'" in proc.stderr


def test_train_step_refuses_compiled_variants_that_differ_in_cudnn():
    """A compiled graph keeps the SDPA kernel it was compiled with (and dynamo does not guard on
    cuDNN's flag): compiled ``stock`` and ``stock/nocudnn`` would share one kernel."""
    proc = run("--compile", "blocks", "--variants", "stock,stock/nocudnn", timeout=120, script=TRAIN_STEP)
    assert proc.returncode != 0
    assert "compiled variants cannot differ in cuDNN's attention" in proc.stderr, proc.stderr[-2000:]


def test_train_steps_interval_of_the_paired_median_holds_it_narrows_with_rounds_and_is_repeatable():
    """The bootstrap interval train_step prints beside the rounds' median ratio: it contains the
    median, is the same for the same rounds, narrows as rounds are added from one distribution,
    and is absent below 5 rounds (where the range is all there is)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from train_step import median_ci
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    rng = random.Random(1)
    few = [rng.gauss(1.0, 0.08) for _ in range(8)]
    many = few + [rng.gauss(1.0, 0.08) for _ in range(192)]
    assert median_ci(few[:4]) is None
    for values in (few, many):
        lo, hi = median_ci(values)
        assert lo <= statistics.median(values) <= hi
        assert median_ci(values) == (lo, hi)
    assert median_ci(many)[1] - median_ci(many)[0] < median_ci(few)[1] - median_ci(few)[0]


def test_train_steps_bucket_option_rounds_only_its_variants_text(tmp_path):
    """``@bucket=N`` sets the trim's rounding for that variant's steps alone. On the CPU Chroma's
    text is padded to 16 and its prompts keep 6, 13 and 3 columns: the package's bucket of 16 cuts
    nothing, 2 cuts 2 columns a sample (14 kept), and the variant after it is back to 16."""
    out = tmp_path / "steps.json"
    proc = run("--device", "cpu", "--variants", "varlen:auto@bucket=2,varlen:auto", "--rounds", "1", "--reps", "1",
               "--warmup", "1", "--json", str(out), timeout=300, script=TRAIN_STEP)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    two, default = results["varlen:auto@bucket=2"], results["varlen:auto"]
    assert two["stats"]["text_trims"] == two["timed_steps"] == 1
    assert two["stats"]["trimmed_tokens"] == 3 * 2
    assert default["stats"]["text_trims"] == 0 and default["stats"]["trimmed_tokens"] == 0
