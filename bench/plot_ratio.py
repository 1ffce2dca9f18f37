"""Plot step-time ratio vs tokens per GPU from ``bench_gpt.json`` (needs matplotlib).

python bench/plot_ratio.py bench/results/<run>/bench_gpt.json out.png
"""

from __future__ import annotations

import json
import sys


def plot_ratio(json_path: str, png_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        data = json.load(f)
    by = {(r["mode"], r["tokens_per_gpu"]): r for r in data["records"] if not r.get("oom")}
    tokens = sorted({t for _, t in by})
    fig, ax = plt.subplots(figsize=(6, 4))
    modes = sorted({m for m, _ in by if m != "ddp"}, key=lambda m: (m != "fsdp2", m))
    for mode in modes:
        xs = [t for t in tokens if (mode, t) in by and ("ddp", t) in by]
        ax.plot(
            xs,
            [by[(mode, t)]["step_ms"] / by[("ddp", t)]["step_ms"] for t in xs],
            marker="o",
            label=f"{mode} / ddp",
        )
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per GPU")
    ax.set_ylabel("step time ratio vs replicated DDP")
    ax.set_title(f"{data['world']}x {data['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


if __name__ == "__main__":
    plot_ratio(sys.argv[1], sys.argv[2])
