"""The README's table of the headline cells from train_step.py's JSON files (not a test):

    python benchmarks/cells_table.py results/cells_h200/*.json [--png cells.png]

One row per file (a cell: model, px, compile), in the order given: stock's median ms per step,
then per variant its median and stock / variant (with two rounds or more, the median and range
of the per-round ratios), host syncs and plans per step of the varlen variants, the backends that
ran, and peak memory of stock against the highest varlen variant. The GPU and versions of the
first file head the table; a file from another GPU or other versions is flagged. ``--png``: a chart
of stock / variant per cell, by the median step and by the fastest step (matplotlib).
"""

from __future__ import annotations

import argparse
import json

import _common as C


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


VARIANTS = (("nomask", "no mask"), ("varlen:auto", "varlen auto"), ("varlen:torch", "varlen torch"))


def write_png(path: str, runs: list[dict], title: str) -> None:
    """Stock / variant per cell: the median step (bars) and the fastest step (dots)."""
    plt = C.pyplot(path)
    if plt is None:
        return
    labels = [f"{r['config']['model']} {r['config']['px']} {r['config']['compile']} ({r['rounds_run']} rd)" for r in runs]
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(runs) * len(VARIANTS) / 2 + 2))
    height = 0.8 / len(VARIANTS)
    for j, (key, name) in enumerate(VARIANTS):
        ys = [i + (j - 1) * height for i in range(len(runs))]
        med = [r["results"].get(key, {}).get("stock_over_variant") or 0 for r in runs]
        fast = [min(r["results"]["stock"]["times_ms"]) / min(r["results"][key]["times_ms"])
                if r["results"].get(key, {}).get("times_ms") else 0 for r in runs]
        ax.barh(ys, med, height=height, label=f"{name}: median step", color=f"C{j}")
        ax.scatter(fast, ys, s=12, color="black", zorder=3, label="fastest step" if j == 0 else None)
    ax.axvline(1.0, color="gray", lw=1)
    ax.set_yticks(range(len(runs)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("stock / variant (higher is faster than stock)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--png", default=None)
    args = ap.parse_args()
    runs = [json.load(open(f)) for f in args.files]
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
    if args.png:
        write_png(args.png, runs, f"{env['gpu']}, torch {env['torch']}, flash-attn-4 {env['flash_attn_4']}: "
                  "stock / variant per training step")


if __name__ == "__main__":
    main()
