"""The headline table of docs/performance.md: one LoRA training step of full-depth Chroma and
Qwen-Image, stock diffusers against the same model with no mask and against ``enable_varlen``.

    pip install -e ".[fa4,diffusers]" "peft==0.21.2"
    python benchmarks/headline.py                       # every cell; one cell per visible GPU at once
    python benchmarks/headline.py --cells qwen:1024:none --rounds 3 --out /some/dir
    python benchmarks/headline.py --dry-run             # the plan: which GPU runs what, nothing run
    python benchmarks/headline.py --device cpu --cells chroma:512:none --rounds 2 --reps 1
                                                        # tiny CPU mode: toy models, timings mean nothing

A cell is ``model:px:compile`` (model chroma or qwen, px 512 or 1024, compile none or blocks).
Each cell is one process of benchmarks/train_step.py running four variants of one model, which
share its weights: ``stock`` (diffusers' masked SDPA), ``nomask`` (the same model called with no
mask: the ceiling), ``varlen:auto`` (``enable_varlen(model)``) and ``varlen:torch`` (PyTorch's
built-in varlen kernel: no flash-attn package; ``--plain-backend``). The variants take turns in
rounds, every other round in reverse order, so that a drifting host or GPU hits all alike. A
round's ratio is stock's median step over the variant's in that round; the table gives the
median over rounds and their range (the 512 px cells are host-bound and noisy: read the range).
A cell's process is killed after ``--timeout`` seconds; no round starts once it has run
``--seconds``.

With several GPUs visible (``CUDA_VISIBLE_DEVICES``, or all of them), cells run at once, one per
GPU, each process with ``CUDA_VISIBLE_DEVICES`` set to its GPU; otherwise one after another.
``--out DIR`` (default ``headline_out`` in the working directory; the committed run is in
benchmarks/results/headline) receives ``<cell>.json`` per cell (what
train_step.py measured: ms per step, main-thread and other-thread CPU time, host syncs and plan
builds per step, backends that ran, peak memory), ``headline.json``, ``headline.md`` (the table
printed at the end) and ``logs/``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN_STEP = os.path.join(HERE, "train_step.py")
MODELS = {"chroma": "Chroma", "qwen": "Qwen-Image"}
COMPILES = {"none": "eager", "blocks": "blocks compiled"}
_live: set = set()  # the process groups running now, killed if the run is interrupted
_stop = threading.Event()
CELLS = ("qwen:1024:none", "chroma:1024:none", "qwen:512:none", "chroma:512:none",
         "qwen:1024:blocks", "chroma:1024:blocks", "qwen:512:blocks", "chroma:512:blocks")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default=",".join(CELLS),
                    help="comma-separated model:px:compile cells (default: all eight)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="cuda (default), or cpu: the tiny mode, toy models on the CPU, to check the script")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per cell: each variant's steps in turn")
    ap.add_argument("--reps", type=int, default=3, help="timed steps per variant per round (after its warm-up)")
    ap.add_argument("--seconds", type=float, default=None,
                    help="start no new round of a cell after this many seconds (default 300; CPU 120); "
                         "at least one round runs")
    ap.add_argument("--timeout", type=float, default=None,
                    help="kill a cell's process after this many seconds (default 900; CPU 300)")
    ap.add_argument("--plain-backend", default=None,
                    help="the backend of the column without flash-attn (default torch; CPU split_sdpa)")
    ap.add_argument("--gpus", default=None,
                    help="comma-separated GPU indices to spread cells over (default: CUDA_VISIBLE_DEVICES, "
                         "else every GPU)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="cells at once (default: one per GPU; CPU 1)")
    ap.add_argument("--train-args", default="",
                    help="more benchmarks/train_step.py arguments for every process, e.g. '--checkpointing off'")
    ap.add_argument("--out", default="headline_out",
                    help="output folder (default: headline_out; a run never overwrites the committed results)")
    ap.add_argument("--dry-run", action="store_true", help="print what would run where, run nothing")
    args = ap.parse_args(argv)
    for name in ("rounds", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: expected an integer >= 1, got {getattr(args, name)}")
    args.cells = [c.strip() for c in args.cells.split(",") if c.strip()]
    for cell in args.cells:
        parts = cell.split(":")
        if (len(parts) != 3 or parts[0] not in MODELS or parts[1] not in ("512", "1024")
                or parts[2] not in COMPILES):
            ap.error(f"--cells: expected model:px:compile with model in {sorted(MODELS)}, px 512 or 1024, "
                     f"compile in {sorted(COMPILES)}; got {cell!r}")
    if len(set(args.cells)) != len(args.cells):
        ap.error(f"--cells: a cell given twice in {args.cells}")
    cpu = args.device == "cpu"
    args.seconds = args.seconds if args.seconds is not None else (120.0 if cpu else 300.0)
    args.timeout = args.timeout if args.timeout is not None else (300.0 if cpu else 900.0)
    args.plain_backend = args.plain_backend or ("split_sdpa" if cpu else "torch")
    return args


def cell_title(cell: str) -> str:
    model, px, compile_ = cell.split(":")
    return f"{MODELS[model]} {px} px, {COMPILES[compile_]}"


def cell_file(cell: str) -> str:
    return cell.replace(":", "_")


def variants(args) -> list[str]:
    return ["stock", "nomask", "varlen:auto", f"varlen:{args.plain_backend}"]


def slots(args) -> list[str | None]:
    """Where cells run at once: a GPU index each (set as the process's CUDA_VISIBLE_DEVICES), or
    on the CPU ``--jobs`` slots of None."""
    if args.device == "cpu":
        return [None] * (args.jobs or 1)
    if args.gpus is not None:
        gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    elif os.environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        gpus = [g.strip() for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    else:
        import torch

        gpus = [str(i) for i in range(torch.cuda.device_count())]
    if not gpus:
        raise SystemExit("no CUDA GPU visible: `--device cpu` runs the tiny CPU mode, `--dry-run` shows the plan")
    return gpus[: args.jobs] if args.jobs else gpus


def command(args, cell: str, json_path: str) -> list[str]:
    model, px, compile_ = cell.split(":")
    return [sys.executable, TRAIN_STEP, "--device", args.device, "--model", model, "--px", px,
            "--compile", compile_, "--variants", ",".join(variants(args)), "--rounds", str(args.rounds),
            "--reps", str(args.reps), "--max-seconds", f"{args.seconds:g}", "--json", json_path,
            *(["--warmup", "1"] if args.device == "cpu" else []), *shlex.split(args.train_args)]


# ------------------------------------------------------------------------------------------ running

def run_cell(args, cell: str, gpu: str | None, say) -> dict:
    """One process of train_step.py for ``cell`` on ``gpu``: its measurements and their summary,
    written to ``<out>/<cell>.json``."""
    logs = os.path.join(args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    json_path = os.path.join(logs, cell_file(cell) + ".json")
    if os.path.exists(json_path):
        os.remove(json_path)
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    env.setdefault("PYTHONWARNINGS", "ignore")
    t0 = time.monotonic()
    with open(os.path.join(logs, cell_file(cell) + ".txt"), "w") as log:
        # A session of its own: a timeout kills the whole group (inductor's compile workers too).
        proc = subprocess.Popen(command(args, cell, json_path), stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        _live.add(proc.pid)
        try:
            rc = proc.wait(timeout=args.timeout)
            error = None if rc == 0 else f"exit status {rc}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            error = f"killed after --timeout {args.timeout:g} s"
        finally:
            _live.discard(proc.pid)
    names = variants(args)
    run = None
    if error is None and os.path.exists(json_path):
        with open(json_path) as fh:
            run = json.load(fh)
    elif error is None:
        error = "no JSON written"
    out = {"cell": cell, "title": cell_title(cell), "gpu_index": gpu, "seconds": time.monotonic() - t0,
           "variants": names, "error": error, "log": os.path.relpath(log.name, args.out),
           "rounds": None if run is None else run["rounds_run"], "env": None if run is None else run["env"],
           "summary": summarize(names, None if run is None else run["results"], error)}
    where = "cpu" if gpu is None else f"gpu {gpu}"
    done = error or f"{out['rounds']} round(s)"
    say(f"[{where}] {cell}: {done} ({out['seconds']:.0f} s)")
    with open(os.path.join(args.out, cell_file(cell) + ".json"), "w") as fh:
        json.dump({**out, "train_step": run}, fh, indent=1, default=str)
    return out


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(names: list[str], results: dict | None, error: str | None) -> dict:
    """Per variant: its median step, stock / variant (the median of the per-round ratios and their
    range), the host measurements per step, and the backends that ran."""
    out = {}
    for v in names:
        r = (results or {}).get(v)
        if r is None or r.get("error") or r.get("median_ms") is None:
            why = (r or {}).get("error") or error or "not run"
            out[v] = {"error": why, "median_ms": None}
            continue
        ratios = [1.0] if v == "stock" else list(r.get("paired_ratios") or [])
        out[v] = {
            "error": None, "median_ms": r["median_ms"], "times_ms": r["times_ms"],
            "stock_over_variant": _median(ratios), "ratio_min": min(ratios, default=None),
            "ratio_max": max(ratios, default=None), "round_ratios": ratios,
            "host_syncs_per_step": r.get("host_syncs_per_step", 0.0),
            "plan_builds_per_step": r.get("plan_builds_per_step", 0.0),
            "main_thread_cpu_ms": r["main_thread_cpu_ms"], "other_threads_cpu_ms": r["other_threads_cpu_ms"],
            "peak_mib": r.get("peak_mib"),
            "backends": (r.get("stats") or {}).get("backends", {}),
            "fallbacks": (r.get("stats") or {}).get("fallbacks", {}),
        }
    return out


# ------------------------------------------------------------------------------------------- table

def _ms(s: dict, ratio: bool) -> str:
    if s["median_ms"] is None:
        return "failed: " + s["error"]
    text = f"{s['median_ms']:.1f}"
    if ratio and s["stock_over_variant"] is not None:
        text += f" ({s['stock_over_variant']:.2f}x"
        if len(s["round_ratios"]) > 1:
            text += f", {s['ratio_min']:.2f}-{s['ratio_max']:.2f}"
        text += ")"
    elif not ratio and len(s["times_ms"]) > 1:
        text += f" ({min(s['times_ms']):.0f}-{max(s['times_ms']):.0f})"
    return text


def _per_step(s: dict, key: str) -> str:
    return "-" if s.get(key) is None else f"{s[key]:g}"


def table(cells: list[dict], names: list[str]) -> str:
    env = next((c["env"] for c in cells if c["env"]), None) or {}
    plain = names[3].split(":", 1)[1]
    lines = [f"{env.get('gpu', '?')}, torch {env.get('torch', '?')}, flash-attn-4 {env.get('flash_attn_4')}, "
             f"diffusers {env.get('diffusers', '?')}, peft {env.get('peft', '?')}. Median ms per training step over "
             "rounds (stock: the range of its steps); in brackets stock / variant, the median of the per-round "
             "ratios and their range.", "",
             f"| cell | rounds | stock ms | no mask ms | varlen auto ms | varlen `{plain}` ms | host reads / step (auto, `{plain}`) |",
             "|---|---|---|---|---|---|---|"]
    for c in cells:
        s = c["summary"]
        rounds = c["rounds"] or 0
        lines.append(f"| {c['title']} | {rounds} | {_ms(s['stock'], False)} | {_ms(s['nomask'], True)} | "
                     f"{_ms(s['varlen:auto'], True)} | {_ms(s[names[3]], True)} | "
                     f"{_per_step(s['varlen:auto'], 'host_syncs_per_step')}, {_per_step(s[names[3]], 'host_syncs_per_step')} |")
    lines += ["", "Host CPU time per step, ms: main thread (forward, loss, optimizer) + other threads "
              "(autograd's device thread: the backward and checkpoint recomputation); varlen_attn's plan "
              "builds per step; backends that ran.", "",
              f"| cell | stock | no mask | varlen auto | varlen `{plain}` | plans / step (auto) | ran (auto) |",
              "|---|---|---|---|---|---|---|"]
    for c in cells:
        s = c["summary"]

        def cpu(v):
            x = s[v]
            if x["median_ms"] is None:
                return "-"
            other = x["other_threads_cpu_ms"]
            return f"{x['main_thread_cpu_ms']:.0f}" + (f" + {other:.0f}" if other is not None else "")

        auto = s["varlen:auto"]
        ran = ", ".join(auto.get("backends", {})) or "-"
        if auto.get("fallbacks"):
            ran += f"; fallbacks {sum(auto['fallbacks'].values())}"
        lines.append(f"| {c['title']} | {cpu('stock')} | {cpu('nomask')} | {cpu('varlen:auto')} | {cpu(names[3])} | "
                     f"{_per_step(auto, 'plan_builds_per_step')} | {ran} |")
    if env.get("gpu") == "cpu":
        lines += ["", "Tiny CPU mode: toy models; the timings mean nothing."]
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device is None:
        if args.dry_run and args.gpus is not None:
            args.device = "cuda"
        else:
            import torch

            args.device = "cuda" if torch.cuda.is_available() else None
        if args.device is None:
            if not args.dry_run:
                raise SystemExit("no CUDA GPU: `--device cpu` runs the tiny CPU mode (toy models), "
                                 "`--dry-run --gpus 0,1` shows the plan")
            args.device = "cpu"
    where = slots(args)
    names = variants(args)
    jobs = {i: args.cells[i::len(where)] for i in range(len(where))}
    if args.dry_run:
        for i, gpu in enumerate(where):
            for cell in jobs[i]:
                print(f"{'CUDA_VISIBLE_DEVICES=' + gpu if gpu is not None else 'cpu'}: {cell} ({cell_title(cell)}), "
                      f"{args.rounds} round(s), variants in turn {names}, the process at most {args.timeout:g} s:")
                print("  " + shlex.join(command(args, cell, os.path.join(args.out, "logs", cell_file(cell) + ".json"))))
        return 0

    os.makedirs(args.out, exist_ok=True)
    lock = threading.Lock()

    def say(text):
        with lock:
            print(text, flush=True)

    say(f"{len(args.cells)} cell(s) x {len(names)} variants x {args.rounds} round(s) on "
        f"{'GPU(s) ' + ','.join(where) if args.device == 'cuda' else f'the CPU ({len(where)} at once)'}; "
        f"logs in {os.path.join(args.out, 'logs')}")
    done: dict[str, dict] = {}
    failures = []

    def worker(i):
        for cell in jobs[i]:
            try:
                done[cell] = run_cell(args, cell, where[i], say)
            except Exception as e:  # one cell's failure must not lose the others
                failures.append(f"{cell}: {type(e).__name__}: {e}")
                say(f"{cell}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(where))]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except KeyboardInterrupt:  # the processes run in sessions of their own: Ctrl-C does not reach them
        _stop.set()
        for pid in list(_live):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        raise
    cells = [done[c] for c in args.cells if c in done]
    text = table(cells, names)
    with open(os.path.join(args.out, "headline.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(args.out, "headline.json"), "w") as fh:
        json.dump({"args": {k: v for k, v in vars(args).items()}, "variants": names,
                   "env": next((c["env"] for c in cells if c["env"]), None),
                   "cells": {c["cell"]: {"title": c["title"], "seconds": c["seconds"], "rounds": c["rounds"],
                                         "error": c["error"], "summary": c["summary"]}
                             for c in cells}, "failures": failures}, fh, indent=1, default=str)
    print()
    print(text)
    print(f"wrote {os.path.join(args.out, 'headline.md')}, headline.json and one JSON per cell")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
