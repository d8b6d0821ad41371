"""Own time per step by function, one cProfile stats file against another (not a test):

    python benchmarks/compare_profiles.py stock.prof 20 varlen.prof 19 [--top 30]

Each file is ``host_profile.py --cprofile``'s output with the number of steps it profiled. The
functions are listed by how much more own time (cProfile's ``tottime``) per step the second
variant spends in them than the first, with their cumulative time and calls per step.
"""

from __future__ import annotations

import argparse
import pstats


def per_step(path: str, steps: int) -> dict[str, tuple[float, float, float]]:
    """``function -> (own ms, cumulative ms, calls)`` per step."""
    out = {}
    for (file, line, name), (_, calls, own, cum, _) in pstats.Stats(path).stats.items():
        short = file.split("site-packages/")[-1].split("/tmp/site/")[-1]
        out[f"{short}:{line}({name})"] = (own / steps * 1e3, cum / steps * 1e3, calls / steps)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("first")
    ap.add_argument("first_steps", type=int)
    ap.add_argument("second")
    ap.add_argument("second_steps", type=int)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    a, b = per_step(args.first, args.first_steps), per_step(args.second, args.second_steps)
    zero = (0.0, 0.0, 0.0)
    print(f"own time per step: first {sum(v[0] for v in a.values()):.1f} ms, second "
          f"{sum(v[0] for v in b.values()):.1f} ms, difference "
          f"{sum(v[0] for v in b.values()) - sum(v[0] for v in a.values()):+.1f} ms")
    rows = sorted(((b.get(f, zero)[0] - a.get(f, zero)[0], f) for f in a.keys() | b.keys()), reverse=True)
    for diff, f in rows[:args.top]:
        (oa, ca, na), (ob, cb, nb) = a.get(f, zero), b.get(f, zero)
        print(f"{diff:+7.2f} ms  own {oa:6.2f} -> {ob:6.2f}  cum {ca:7.2f} -> {cb:7.2f}  "
              f"calls {na:6.0f} -> {nb:6.0f}  {f[-110:]}")


if __name__ == "__main__":
    main()
