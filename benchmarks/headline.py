"""The headline table of docs/performance.md: one LoRA training step of full-depth Chroma and
Qwen-Image, stock diffusers against the same model with no mask and against ``enable_varlen``.

    pip install -e ".[fa4,diffusers]" "peft==0.21.2"
    python benchmarks/headline.py                       # every cell; one cell per visible GPU at once
    python benchmarks/headline.py --cells qwen:1024:none --rounds 3 --out /some/dir
    python benchmarks/headline.py --dry-run             # the plan: which GPU runs what, nothing run
    python benchmarks/headline.py --device cpu --cells chroma:512:none --rounds 2 --reps 1
                                                        # tiny CPU mode: toy models, timings mean nothing

A cell is ``model:px:compile`` (model chroma or qwen, px 512 or 1024, compile none or blocks).
Each cell runs four variants of benchmarks/train_step.py: ``stock`` (diffusers' masked SDPA),
``nomask`` (the same model called with no mask: the ceiling), ``varlen:auto``
(``enable_varlen(model)``) and ``varlen:torch`` (PyTorch's built-in varlen kernel: no flash-attn
package; ``--plain-backend``). Every variant runs in a process of its own (build, warm-up, then
``--reps`` timed steps), and the variants take turns in rounds, every other round in reverse
order, so that a drifting host or GPU hits all alike. A round's ratio is stock's median step
over the variant's in that round; the table gives the median over rounds and their range
(the 512 px cells are host-bound and noisy: read the range). Each process is killed after
``--timeout`` seconds; no round starts once a cell has run ``--seconds``.

With several GPUs visible (``CUDA_VISIBLE_DEVICES``, or all of them), cells run at once, one per
GPU, each process with ``CUDA_VISIBLE_DEVICES`` set to its GPU; otherwise one after another.
``--out DIR`` (default benchmarks/results/headline) receives ``<cell>.json`` per cell (every
process's measurements: ms per step, main-thread and other-thread CPU time, host syncs and plan
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
    ap.add_argument("--rounds", type=int, default=5, help="rounds per cell: one process per variant each")
    ap.add_argument("--reps", type=int, default=3, help="timed steps per process (after its warm-up)")
    ap.add_argument("--seconds", type=float, default=None,
                    help="start no new round of a cell after this many seconds (default 3000; CPU 600); "
                         "at least one round runs")
    ap.add_argument("--timeout", type=float, default=None,
                    help="kill a variant's process after this many seconds (default 900; CPU 300)")
    ap.add_argument("--plain-backend", default=None,
                    help="the backend of the column without flash-attn (default torch; CPU split_sdpa)")
    ap.add_argument("--gpus", default=None,
                    help="comma-separated GPU indices to spread cells over (default: CUDA_VISIBLE_DEVICES, "
                         "else every GPU)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="cells at once (default: one per GPU; CPU 1)")
    ap.add_argument("--train-args", default="",
                    help="more benchmarks/train_step.py arguments for every process, e.g. '--checkpointing off'")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "headline"), help="output folder")
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
    args.seconds = args.seconds if args.seconds is not None else (600.0 if cpu else 3000.0)
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


def command(args, cell: str, variant: str, json_path: str) -> list[str]:
    model, px, compile_ = cell.split(":")
    return [sys.executable, TRAIN_STEP, "--device", args.device, "--model", model, "--px", px,
            "--compile", compile_, "--variants", variant, "--rounds", "1", "--reps", str(args.reps),
            "--json", json_path, *(["--warmup", "1"] if args.device == "cpu" else []), *shlex.split(args.train_args)]


# ------------------------------------------------------------------------------------------ running

def run_variant(args, cell: str, variant: str, rnd: int, gpu: str | None) -> dict:
    """One process of train_step.py for ``variant`` of ``cell``: its measurements, or an error."""
    name = f"r{rnd + 1}_{variant.replace(':', '_')}"
    logs = os.path.join(args.out, "logs", cell_file(cell))
    os.makedirs(logs, exist_ok=True)
    json_path = os.path.join(logs, name + ".json")
    if os.path.exists(json_path):
        os.remove(json_path)
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    env.setdefault("PYTHONWARNINGS", "ignore")
    t0 = time.monotonic()
    with open(os.path.join(logs, name + ".txt"), "w") as log:
        # A session of its own: a timeout kills the whole group (inductor's compile workers too).
        proc = subprocess.Popen(command(args, cell, variant, json_path), stdout=log, stderr=subprocess.STDOUT,
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
    seconds = time.monotonic() - t0
    out = {"round": rnd + 1, "variant": variant, "gpu": gpu, "seconds": seconds, "log": os.path.relpath(log.name, args.out)}
    if error is None and os.path.exists(json_path):
        with open(json_path) as fh:
            run = json.load(fh)
        res = run["results"][variant]
        out.update(env=run["env"], config=run["config"], result=res, error=res.get("error"))
    else:
        out["error"] = error or "no JSON written"
    return out


def run_cell(args, cell: str, gpu: str | None, say) -> dict:
    """Every round of ``cell`` on ``gpu``, then its summary, written to ``<out>/<cell>.json``."""
    t0 = time.monotonic()
    names = variants(args)
    rounds = []
    for rnd in range(args.rounds):
        if rnd and time.monotonic() - t0 > args.seconds:
            say(f"{cell}: --seconds {args.seconds:g} spent after {rnd} round(s)")
            break
        row = {}
        for variant in (names if rnd % 2 == 0 else names[::-1]):
            if _stop.is_set():
                return {}
            r = run_variant(args, cell, variant, rnd, gpu)
            row[variant] = r
            what = r["error"] or f"{r['result']['median_ms']:.1f} ms/step"
            say(f"[{'gpu ' + gpu if gpu is not None else 'cpu'}] {cell} round {rnd + 1}/{args.rounds} "
                f"{variant}: {what} ({r['seconds']:.0f} s)")
        rounds.append(row)
    out = {"cell": cell, "title": cell_title(cell), "gpu_index": gpu, "seconds": time.monotonic() - t0,
           "variants": names, "summary": summarize(names, rounds), "rounds": rounds}
    env = next((r["env"] for row in rounds for r in row.values() if "env" in r), None)
    out["env"] = env
    with open(os.path.join(args.out, cell_file(cell) + ".json"), "w") as fh:
        json.dump(out, fh, indent=1, default=str)
    return out


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(names: list[str], rounds: list[dict]) -> dict:
    """Per variant over the rounds it ran: the median and range of its per-round median step, of
    stock / variant per round, and the medians of the host measurements per step."""
    ok = [{v: r["result"] for v, r in row.items() if not r["error"]} for row in rounds]
    out = {}
    for v in names:
        per_round = [row[v] for row in ok if v in row]
        ms = [r["median_ms"] for r in per_round]
        ratios = [row["stock"]["median_ms"] / row[v]["median_ms"] for row in ok if v in row and "stock" in row]
        backends: dict = {}
        fallbacks: dict = {}
        for r in per_round:
            for k, n in r["stats"]["backends"].items():
                backends[k] = backends.get(k, 0) + n
            for k, n in r["stats"]["fallbacks"].items():
                fallbacks[k] = fallbacks.get(k, 0) + n
        out[v] = {
            "rounds_ok": len(per_round),
            "errors": [f"round {row[v]['round']}: {row[v]['error']}" for row in rounds if v in row and row[v]["error"]],
            "median_ms": _median(ms), "min_ms": min(ms, default=None), "max_ms": max(ms, default=None),
            "round_ms": ms,
            "stock_over_variant": _median(ratios), "ratio_min": min(ratios, default=None),
            "ratio_max": max(ratios, default=None), "round_ratios": ratios,
            "host_syncs_per_step": _median(r["host_syncs_per_step"] for r in per_round),
            "plan_builds_per_step": _median(r["plan_builds_per_step"] for r in per_round),
            "main_thread_cpu_ms": _median(r["main_thread_cpu_ms"] for r in per_round),
            "other_threads_cpu_ms": _median(r["other_threads_cpu_ms"] for r in per_round),
            "peak_mib": max((r["peak_mib"] for r in per_round if r["peak_mib"]), default=None),
            "backends": backends, "fallbacks": fallbacks,
        }
    return out


# ------------------------------------------------------------------------------------------- table

def _ms(s: dict, ratio: bool) -> str:
    if s["median_ms"] is None:
        return "failed: " + (s["errors"][0] if s["errors"] else "not run")
    text = f"{s['median_ms']:.1f}"
    if ratio and s["stock_over_variant"] is not None:
        text += f" ({s['stock_over_variant']:.2f}x"
        if len(s["round_ratios"]) > 1:
            text += f", {s['ratio_min']:.2f}-{s['ratio_max']:.2f}"
        text += ")"
    elif not ratio and len(s["round_ms"]) > 1:
        text += f" ({s['min_ms']:.0f}-{s['max_ms']:.0f})"
    return text


def _per_step(s: dict, key: str) -> str:
    return "-" if s[key] is None else f"{s[key]:g}"


def table(cells: list[dict], names: list[str]) -> str:
    env = next((c["env"] for c in cells if c["env"]), None) or {}
    plain = names[3].split(":", 1)[1]
    lines = [f"{env.get('gpu', '?')}, torch {env.get('torch', '?')}, flash-attn-4 {env.get('flash_attn_4')}, "
             f"diffusers {env.get('diffusers', '?')}, peft {env.get('peft', '?')}. Median ms per training step over "
             "rounds (stock: its range over rounds); in brackets stock / variant, the median of the per-round "
             "ratios and their range.", "",
             f"| cell | rounds | stock ms | no mask ms | varlen auto ms | varlen `{plain}` ms | host reads / step (auto, `{plain}`) |",
             "|---|---|---|---|---|---|---|"]
    for c in cells:
        s = c["summary"]
        rounds = max(x["rounds_ok"] for x in s.values())
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
            if x["main_thread_cpu_ms"] is None:
                return "-"
            other = x["other_threads_cpu_ms"]
            return f"{x['main_thread_cpu_ms']:.0f}" + (f" + {other:.0f}" if other is not None else "")

        auto = s["varlen:auto"]
        ran = ", ".join(auto["backends"]) or "-"
        if auto["fallbacks"]:
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
                      f"{args.rounds} round(s), variants in turn {names}, each process at most {args.timeout:g} s:")
                for v in names:
                    print("  " + shlex.join(command(args, cell, v, os.path.join(args.out, "logs", cell_file(cell),
                                                                             f"r1_{v.replace(':', '_')}.json"))))
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
                   "cells": {c["cell"]: {"title": c["title"], "seconds": c["seconds"], "summary": c["summary"]}
                             for c in cells}, "failures": failures}, fh, indent=1, default=str)
    print()
    print(text)
    print(f"wrote {os.path.join(args.out, 'headline.md')}, headline.json and one JSON per cell")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
