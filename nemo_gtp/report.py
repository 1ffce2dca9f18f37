"""Plot a run's TensorBoard logs: ``python -m nemo_gtp.report <log_dir> [<log_dir2>] [-o out.png]``.

Reads every TensorBoard event file under each log directory (NeMo's ``nl.NeMoLogger`` with its
TensorBoard logger, Lightning's default logger, or ``python -m nemo_gtp.run --log-dir``) with
TensorBoard's ``EventAccumulator`` (NeMo depends on ``tensorboard``) and draws, per step, the
loss (NeMo's ``reduced_train_loss``, and ``val_loss`` where validation ran), the step time, the
exposed GTP communication and the memory that :class:`nemo_gtp.GTPMetricsCallback` logs, into one
PNG. Two directories are overlaid (e.g. a GTP run and its baseline) and summarized in one line:
the median step-time ratio and the largest relative loss difference over their common steps.

Example::

    python -m nemo_gtp.report runs/tiny_cpu/gtp runs/tiny_cpu/baseline -o gtp_vs_baseline.png
    # gtp vs baseline: median step time 41.2 / 36.0 ms = 1.14; max rel loss diff 1.5e-07 ...
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PROG = "python -m nemo_gtp.report"
EVENT_GLOB = "events.out.tfevents.*"

# What each panel draws: the first tag a run has, in this order.
LOSS = ("reduced_train_loss", "train_loss")
VAL_LOSS = ("val_loss",)
STEP_TIME = ("train/step_s", "gtp/step_s", "train_step_timing in s")
EXPOSED_COMM = ("gtp/exposed_comm_s",)
MEMORY = ("train/peak_memory_gib", "train/rss_gib")
MODEL_STATE = ("train/model_state_gib",)


@dataclass
class RunLog:
    """The scalars one log directory holds: ``tag -> [(step, value), ...]`` by step.

    Example::

        run = read_run("runs/tiny_cpu/gtp")
        run.series(*LOSS)   # [(1, 4.86), (2, 4.80), ...]
    """

    name: str
    path: Path
    scalars: dict[str, list[tuple[int, float]]]

    def series(self, *tags: str) -> list[tuple[int, float]]:
        """The first of ``tags`` this run logged (empty if none)."""
        for tag in tags:
            if self.scalars.get(tag):
                return self.scalars[tag]
        return []


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar under ``log_dir`` (all event files, recursively), by tag, sorted by step.

    A step written twice (a resumed run, or several event files) keeps its latest write.
    Raises ``FileNotFoundError`` naming the directory when it holds no event file.
    """
    from tensorboard.backend.event_processing.event_accumulator import (
        SCALARS,
        EventAccumulator,
    )

    root = Path(log_dir)
    directories = sorted({f.parent for f in root.rglob(EVENT_GLOB)})
    if not directories:
        raise FileNotFoundError(
            f"no TensorBoard event files ({EVENT_GLOB}) under {root}: log with NeMo's "
            "nl.NeMoLogger(tensorboard=...) or python -m nemo_gtp.run --log-dir"
        )
    latest: dict[str, dict[int, tuple[float, float]]] = {}  # tag -> step -> (wall time, value)
    for directory in directories:
        events = EventAccumulator(str(directory), size_guidance={SCALARS: 0})  # 0: keep all
        events.Reload()
        for tag in events.Tags()[SCALARS]:
            by_step = latest.setdefault(tag, {})
            for event in events.Scalars(tag):
                kept = by_step.get(event.step)
                if kept is None or event.wall_time >= kept[0]:
                    by_step[event.step] = (event.wall_time, float(event.value))
    return {
        tag: [(step, value) for step, (_, value) in sorted(by_step.items())]
        for tag, by_step in latest.items()
    }


def read_run(log_dir: str | Path, name: str | None = None) -> RunLog:
    """:func:`read_scalars` of ``log_dir``, named after the directory unless ``name`` is given."""
    path = Path(log_dir)
    return RunLog(name or path.resolve().name, path, read_scalars(path))


WARMUP_STEPS = 5
"""Steps at the start of a run that its median step time leaves out (first gathers, allocator
and kernel warm-up); ``python -m nemo_gtp.run``'s VERDICT and this report count the same."""


def median_after_warmup(series: list[tuple[int, float]], warmup: int = WARMUP_STEPS) -> float:
    """The median value of a ``[(step, value), ...]`` series past its first ``warmup`` steps
    (counted from its first step, so every logging interval and a resumed run skip the same
    steps); all of its values when none lies past them, NaN when it is empty.

    Example::

        median_after_warmup([(0, 9.0), (1, 1.0), (2, 2.0), (3, 3.0)], warmup=1)   # 2.0
    """
    if not series:
        return float("nan")
    first = series[0][0]
    kept = [value for step, value in series if step >= first + warmup]
    return statistics.median(kept or [value for _, value in series])


def median_step_ms(run: RunLog, warmup: int = WARMUP_STEPS) -> float:
    """Median step time in ms past the first ``warmup`` steps (:func:`median_after_warmup`)."""
    return 1000 * median_after_warmup(run.series(*STEP_TIME), warmup)


def max_rel_loss_diff(a: RunLog, b: RunLog) -> tuple[float, int]:
    """The largest ``|loss_a - loss_b| / |loss_b|`` over the steps both logged, and their count."""
    base = dict(b.series(*LOSS))
    diffs = [abs(x - base[s]) / abs(base[s]) for s, x in a.series(*LOSS) if s in base and base[s]]
    return (max(diffs) if diffs else float("nan")), len(diffs)


def summary(runs: list[RunLog]) -> str:
    """One line: per run its steps, last loss and median step time; for two runs the median
    step-time ratio (first / second) and the largest relative loss difference."""
    if len(runs) == 2:
        a, b = runs
        ta, tb = median_step_ms(a), median_step_ms(b)
        diff, common = max_rel_loss_diff(a, b)
        return (
            f"{a.name} vs {b.name}: median step time {ta:.1f} / {tb:.1f} ms = {ta / tb:.2f}; "
            f"max rel loss diff {diff:.1e} over {common} common steps"
        )
    parts = []
    for run in runs:
        loss = run.series(*LOSS)
        last = f"{loss[-1][1]:.4f}" if loss else "n/a"
        parts.append(
            f"{run.name}: {len(loss)} steps, last loss {last}, median step time "
            f"{median_step_ms(run):.1f} ms"
        )
    return "; ".join(parts)


def _plot(
    ax: object, run: RunLog, tags: tuple[str, ...], scale: float = 1.0, **style: object
) -> None:
    """One series of ``run`` on ``ax`` (nothing when the run did not log it), its steps
    numbered as the console numbers them (TensorBoard's step 0 is the console's step 1)."""
    points = run.series(*tags)
    if points:
        steps, values = zip(*points, strict=True)
        ax.plot([s + 1 for s in steps], [v * scale for v in values], **style)  # type: ignore[attr-defined]


def _steady_scale(ax: object, runs: list[RunLog], tags: tuple[str, ...], colors: list) -> None:
    """Scale ``ax`` to the steady state (the steps past :data:`WARMUP_STEPS`), shade the warm-up
    steps and mark each value above the scale at the top edge with its number, in ms."""
    series = [run.series(*tags) for run in runs]
    steady = [
        1000 * v
        for points in series
        if points
        for s, v in points
        if s >= points[0][0] + WARMUP_STEPS
    ]
    if not steady:
        return
    top = 1.3 * max(steady)
    ax.set_ylim(0, top)  # type: ignore[attr-defined]
    first = min(points[0][0] for points in series if points) + 1
    ax.axvspan(first - 0.5, first + WARMUP_STEPS - 0.5, color="0.92", zorder=0)  # type: ignore[attr-defined]
    for i, points in enumerate(series):
        if points:
            median = 1000 * median_after_warmup(points)
            ax.axhline(median, color=colors[i % len(colors)], ls="--", lw=0.8)  # type: ignore[attr-defined]
        for step, value in points:
            if 1000 * value > top:
                ax.plot(step + 1, top, marker="^", color=colors[i % len(colors)], clip_on=False)  # type: ignore[attr-defined]
                ax.annotate(  # type: ignore[attr-defined]
                    f"{1000 * value:.0f} ms",
                    (step + 1, top),
                    xytext=(6, -4 - 10 * i),
                    textcoords="offset points",
                    fontsize=7,
                    va="top",
                    color=colors[i % len(colors)],
                    bbox={"fc": "white", "ec": "none", "pad": 0.5},
                )


def draw(runs: list[RunLog], png: str | Path) -> Path:
    """Loss, step time, exposed GTP communication and memory per step of ``runs``, overlaid,
    into ``png`` (its directory is created; the :func:`figure`). Returns the path written."""
    import matplotlib.pyplot as plt

    fig = figure(runs)
    path = Path(png)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def figure(runs: list[RunLog]) -> object:
    """The report's matplotlib figure: four panels (loss, step time, exposed GTP
    communication, memory) of ``runs`` overlaid.

    Steps are numbered as the console numbers them (from 1); the legend sits above the panels;
    the step-time and communication panels are scaled to the steady state, their warm-up steps
    (:data:`WARMUP_STEPS`, left out of the medians) shaded, off-scale values marked at the top
    with their number, each run's median a dashed line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    loss_ax, time_ax, comm_ax, mem_ax = axes.flat
    state_ax = mem_ax.twinx()  # a model's state can be far below the process's memory
    state_gib = max((v for r in runs for _, v in r.series(*MODEL_STATE)), default=0.0)
    state_unit, state_scale = ("GiB", 1.0) if state_gib >= 1 else ("MiB", 1024.0)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        _plot(loss_ax, run, LOSS, color=color)
        _plot(loss_ax, run, VAL_LOSS, color=color, marker="o", linestyle="--")
        _plot(time_ax, run, STEP_TIME, scale=1000, color=color)
        _plot(comm_ax, run, EXPOSED_COMM, scale=1000, color=color)
        _plot(mem_ax, run, MEMORY, color=color)
        _plot(state_ax, run, MODEL_STATE, state_scale, color=color, ls=":")
    last = max((s + 1 for r in runs for s, _ in r.series(*LOSS, *STEP_TIME)), default=0)
    _steady_scale(time_ax, runs, STEP_TIME, colors)
    _steady_scale(comm_ax, runs, EXPOSED_COMM, colors)
    loss_ax.set(ylabel="loss (cross-entropy, nats per token)", title="training loss")
    time_ax.set(ylabel="step time, ms", title="step time (rank 0)")
    comm_ax.set(
        ylabel="exposed communication, ms per step", title="exposed GTP communication (rank 0)"
    )
    memory_kind = "peak allocated" if any(r.series(MEMORY[0]) for r in runs) else "resident"
    mem_ax.set(ylabel=f"{memory_kind} memory, GiB", title="memory (rank 0)")
    state_ax.set(ylabel=f"weights + grads + optimizer, {state_unit}")
    for ax in axes.flat:
        ax.set_xlabel("training step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
        if last:
            ax.set_xlim(0.5, last + 0.5)
        if not ax.lines and ax is not mem_ax:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    if state_ax.lines:
        state_ax.set_ylim(bottom=0)
    # One legend for the figure, above the panels: no panel's data hides behind it.
    handles = [
        Line2D([], [], color=colors[i % len(colors)], label=r.name) for i, r in enumerate(runs)
    ]
    if any(r.series(*VAL_LOSS) for r in runs):
        handles.append(Line2D([], [], color="0.3", marker="o", ls="--", label="validation loss"))
    if time_ax.lines or comm_ax.lines:
        handles.append(
            Line2D([], [], color="0.3", ls="--", lw=0.8, label=f"median past step {WARMUP_STEPS}")
        )
        handles.append(
            Patch(color="0.92", label=f"first {WARMUP_STEPS} steps: warm-up (▲ off scale)")
        )
    if state_ax.lines:
        handles.append(
            Line2D([], [], color="0.3", ls=":", label=f"model state ({state_unit}, right axis)")
        )
    fig.suptitle(" vs ".join(run.name for run in runs), fontsize=11)
    fig.legend(
        handles=handles,
        loc="upper center",
        ncol=min(len(handles), 6),
        fontsize=8,
        bbox_to_anchor=(0.5, 0.955),
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.935))
    return fig


def report(log_dirs: list[str | Path], png: str | Path) -> tuple[list[RunLog], str]:
    """Read ``log_dirs``, draw them into ``png``; the runs and the :func:`summary` line.

    Two directories with the same name are labelled by their full paths.

    Example::

        runs, line = report(["runs/x/gtp", "runs/x/baseline"], "x.png")
    """
    paths = [Path(d) for d in log_dirs]
    names = [p.resolve().name for p in paths]
    if len(set(names)) < len(names):
        names = [str(p) for p in paths]
    runs = [read_run(p, name) for p, name in zip(paths, names, strict=True)]
    draw(runs, png)
    return runs, summary(runs)


# Relative loss difference under which GTP "matches" its baseline: fp32 runs agree to rounding
# (≤ 2.2e-7 measured on the tiny recipe); bf16 runs differ by bf16 rounding of reduction orders.
TOLERANCE = {"32": 1e-5, "bf16-mixed": 2e-2}


def verdict(gtp: list[dict], baseline: list[dict], precision: str = "32") -> tuple[bool, str]:
    """Whether GTP's loss curve matches the baseline's, and the one-line ``VERDICT:`` text.

    The step-time ratio is of the median step times past the warm-up steps, counted as the
    report (``python -m nemo_gtp.report``) counts them
    (:func:`median_after_warmup`).
    Example::

        ok, line = verdict(logs["GTP"], logs["baseline"], precision="32")
    """
    tol = TOLERANCE.get(str(precision), TOLERANCE["32"])
    base = {r["step"]: r["loss"] for r in baseline}
    diffs = [
        abs(r["loss"] - base[r["step"]]) / abs(base[r["step"]]) for r in gtp if r["step"] in base
    ]
    if not diffs or len(diffs) != len(baseline) or len(gtp) != len(baseline):
        return False, (
            f"VERDICT: GTP did not match the baseline (steps logged: GTP {len(gtp)}, "
            f"baseline {len(baseline)})"
        )
    worst = max(diffs)
    ok = worst <= tol
    ratio = _median_ms(gtp) / _median_ms(baseline)
    what = "matches" if ok else "did not match"
    return ok, (
        f"VERDICT: GTP {what} the baseline (max rel loss diff {worst:.1e} over {len(diffs)} "
        f"steps, tolerance {tol:.0e}); step time GTP/baseline {ratio:.2f}"
    )


def _median_ms(log: list[dict]) -> float:
    """Median ``ms`` of per-step records past the warm-up (:func:`median_after_warmup`)."""
    return median_after_warmup([(r["step"], r["ms"]) for r in log])


def report_comparison(
    logs: dict[str, list[dict]],
    precision: str,
    plot: str | None,
    stem: str,
    start: float | None = None,
    log_dirs: dict[str, Path] | None = None,
) -> int:
    """Print both loss curves side by side and the ``VERDICT:`` line; 0 when they match.

    ``logs`` maps the GTP run's name, then the baseline's, to rank 0's per-step records. With
    ``log_dirs`` (the same names to each run's TensorBoard directory) the report of both runs is
    drawn to ``plot`` (default ``<GTP run's log dir>/../gtp_vs_baseline.png``). Example::

        report_comparison({"GTP": gtp_log, "baseline": base_log}, "32", None, "tiny_cpu")
    """
    names = list(logs)
    print(f"\n{'step':>5} | {names[0]:>22} | {names[1]:>22} | rel diff")
    by_step = [{r["step"]: r["loss"] for r in logs[n]} for n in names]
    for step in sorted(by_step[0]):
        a, b = by_step[0][step], by_step[1].get(step, float("nan"))
        print(f"{step:>5} | {a:>22.5f} | {b:>22.5f} | {abs(a - b) / abs(b):.1e}")
    for name in names:
        peak = max((r.get("peak_gib", 0.0) for r in logs[name]), default=0.0)
        print(
            f"{name}: median step {_median_ms(logs[name]):.1f} ms"
            + (f", peak memory {peak:.2f} GiB" if peak else "")
        )
    if logs[names[0]]:
        first, last = logs[names[0]][0]["loss"], logs[names[0]][-1]["loss"]
        took = f"; both runs took {time.perf_counter() - start:.0f} s" if start else ""
        print(f"\nGTP loss {first:.3f} -> {last:.3f} over {len(logs[names[0]])} steps{took}")
    ok, line = verdict(logs[names[0]], logs[names[1]], precision)
    if not log_dirs:
        print(line + "; plot skipped (no TensorBoard logs given)", flush=True)
        return 0 if ok else 1
    gtp_dir, base_dir = log_dirs.values()
    png = Path(plot or Path(gtp_dir).parent / "gtp_vs_baseline.png").absolute()
    print(f"\nTensorBoard logs: {gtp_dir} and {base_dir}", flush=True)
    print(f"report: python -m nemo_gtp.report {gtp_dir} {base_dir} -o {png}", flush=True)
    try:
        _, summary = report([gtp_dir, base_dir], png)
        print(summary, flush=True)
        line += f"; plot: {png}"
    except ImportError:  # matplotlib is optional (the test extra)
        line += "; plot skipped (no matplotlib)"
    except FileNotFoundError as err:  # no TensorBoard events: the verdict still stands
        print(err, flush=True)
        line += "; plot skipped (no TensorBoard logs)"
    print(line, flush=True)
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Draw loss, step time, exposed GTP communication and memory per step from "
        "TensorBoard logs; two directories are overlaid and compared in one line.",
    )
    parser.add_argument("log_dirs", nargs="+", metavar="log_dir", help="a run's log directory")
    parser.add_argument(
        "-o", "--output", default="gtp_report.png", help="PNG to write (default: %(default)s)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m nemo_gtp.report``; 2 on bad input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if len(args.log_dirs) > 2:
        parser.error("give one log directory, or two to compare")
    try:
        _, line = report(args.log_dirs, args.output)
    except FileNotFoundError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    print(line)
    print(f"plot: {Path(args.output).absolute()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
