"""Where does one mode's host time go that another's does not? Diff two cProfile dumps.

``bench_nemo.py --profile-tokens T`` writes ``host_profile_<mode>_<T>.pstats`` (rank 0, every
function of a few profiled steps). This prints, per step, the functions whose own time
(``tottime``) grew most from the baseline dump to the other, with their call counts:

    python bench/pstats_diff.py results/.../host_profile_gtp2_te_2048.pstats \\
        results/.../host_profile_dp2_te_2048.pstats --steps 3 --top 40
"""

from __future__ import annotations

import argparse
import pstats


def _by_function(path: str) -> tuple[dict[str, tuple[int, float]], float]:
    stats = pstats.Stats(path)
    rows = {}
    for (filename, line, name), (_, calls, tottime, _, _) in stats.stats.items():
        short = filename.split("site-packages/")[-1].split("/nemo_gtp/")[-1]
        rows[f"{short}:{line}({name})"] = (calls, tottime)
    return rows, stats.total_tt


def diff(mode: str, baseline: str, steps: int, top: int) -> str:
    """The table (text): total own time per step of both dumps, then the ``top`` functions
    with the most extra own time per step in ``mode`` and the ``top // 3`` with the least."""
    a, total_a = _by_function(mode)
    b, total_b = _by_function(baseline)
    rows = []
    for key in set(a) | set(b):
        calls_a, time_a = a.get(key, (0, 0.0))
        calls_b, time_b = b.get(key, (0, 0.0))
        rows.append((time_a - time_b, key, calls_a, calls_b))
    rows.sort(reverse=True)
    per_step = 1000 / steps
    lines = [
        f"own time per step: {total_a * per_step:.1f} ms vs {total_b * per_step:.1f} ms "
        f"(+{(total_a - total_b) * per_step:.1f} ms)",
        "",
        "| extra ms/step | calls (mode / baseline, all steps) | function |",
        "|---|---|---|",
    ]
    for extra, key, calls_a, calls_b in [*rows[:top], *rows[-(top // 3) :]]:
        lines.append(f"| {extra * per_step:+.2f} | {calls_a} / {calls_b} | `{key[:110]}` |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", help="the dump to explain (e.g. GTP2's)")
    parser.add_argument("baseline", help="the dump to compare against (e.g. DP2's)")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps in each dump")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    print(diff(args.mode, args.baseline, args.steps, args.top))


if __name__ == "__main__":
    main()
