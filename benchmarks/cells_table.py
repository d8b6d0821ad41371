"""The README's table of the headline cells from train_step.py's JSON files (not a test):

    python benchmarks/cells_table.py results/cells_h200/*.json

One row per file (a cell: model, px, compile), in the order given: stock's median ms per step,
then per variant its median and stock / variant (with two rounds or more, the median and range
of the per-round ratios), host syncs and plans per step of the varlen variants, the backends that
ran, and peak memory of stock against the highest varlen variant. The GPU and versions of the
first file head the table; a file from another GPU or other versions is flagged.
"""

from __future__ import annotations

import json
import sys


def ratio(r: dict) -> str:
    text = f"{r['stock_over_variant']:.2f}x"
    paired = r.get("paired_ratios") or []
    if len(paired) >= 2:
        text += f"; rounds {r['paired_ratio_median']:.2f}x, {min(paired):.2f}-{max(paired):.2f}"
    return text


def cell(name: str, r: dict | None) -> str:
    if r is None:
        return "not run"
    if r.get("error"):
        return f"failed: {r['error'][:60]}"
    text = f"{r['median_ms']:.1f} ({ratio(r)})"
    return f"**{text}**" if name != "stock" and r["stock_over_variant"] >= 1.0 else text


def main():
    files = sys.argv[1:]
    if not files:
        raise SystemExit(__doc__)
    runs = [json.load(open(f)) for f in files]
    env = runs[0]["env"]
    print(f"{env['gpu']}, torch {env['torch']}, flash-attn-4 {env['flash_attn_4']}, diffusers "
          f"{env['diffusers']}, peft {env['peft']}; median ms per step (stock / variant)\n")
    print("| model | px | compile | rounds | stock | no mask | varlen auto | varlen `torch` | syncs / plans per step | ran | peak MiB stock / varlen |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        c, res = run["config"], run["results"]
        flag = "" if (run["env"]["gpu"], run["env"]["torch"]) == (env["gpu"], env["torch"]) else f" ({run['env']['gpu']})"
        varlen = [res[k] for k in ("varlen:auto", "varlen:torch") if k in res and not res[k].get("error")]
        syncs = "/".join(sorted({f"{v['host_syncs_per_step']:.0f}" for v in varlen})) or "-"
        plans = "/".join(sorted({f"{v['plan_builds_per_step']:.0f}" for v in varlen})) or "-"
        ran = "; ".join(f"{k.split(':')[1]}: " + ", ".join(res[k]["stats"]["backends"]) for k in ("varlen:auto", "varlen:torch")
                        if k in res and res[k].get("stats"))
        peak = f"{res['stock']['peak_mib']:.0f} / {max(v['peak_mib'] for v in varlen):.0f}" if varlen else "-"
        print(f"| {c['model']}{flag} | {c['px']} | {c['compile']} | {run['rounds_run']} | {res['stock']['median_ms']:.1f} | "
              f"{cell('nomask', res.get('nomask'))} | {cell('auto', res.get('varlen:auto'))} | "
              f"{cell('torch', res.get('varlen:torch'))} | {syncs} / {plans} | {ran} | {peak} |")


if __name__ == "__main__":
    main()
