"""Plot step-time ratio vs tokens per GPU (needs matplotlib).

python bench/plot_ratio.py bench/results/<run>/bench_gpt.json out.png
"""

from __future__ import annotations

import json
import sys


def plot_ratio_series(
    series: dict[str, tuple[list[int], list[float]]], png_path: str, *, title: str, ylabel: str
) -> None:
    """One line per ``label -> (tokens per GPU, ratios)``, log2 x axis, a rule at 1.0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, (xs, ys) in series.items():
        if xs:
            ax.plot(xs, ys, marker="o", label=label)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per GPU")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


def plot_ratio(json_path: str, png_path: str) -> None:
    """Every mode of a ``bench_gpt.json`` against replicated DDP."""
    with open(json_path) as f:
        data = json.load(f)
    by = {(r["mode"], r["tokens_per_gpu"]): r for r in data["records"] if not r.get("oom")}
    tokens = sorted({t for _, t in by})
    series = {}
    for mode in sorted({m for m, _ in by if m != "ddp"}, key=lambda m: (m != "fsdp2", m)):
        xs = [t for t in tokens if (mode, t) in by and ("ddp", t) in by]
        series[f"{mode} / ddp"] = (
            xs,
            [by[(mode, t)]["step_ms"] / by[("ddp", t)]["step_ms"] for t in xs],
        )
    plot_ratio_series(
        series,
        png_path,
        title=f"{data['world']}x {data['device']}",
        ylabel="step time ratio vs replicated DDP",
    )


if __name__ == "__main__":
    plot_ratio(sys.argv[1], sys.argv[2])
