"""``python -m nemo_gtp.report`` on TensorBoard event files written here (the real main job's
logs are read back in ``tests/test_recipes.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nemo_gtp import report


def _write(directory: Path, scalars: dict[str, list[tuple[int, float]]]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(directory))
    for tag, points in scalars.items():
        for step, value in points:
            writer.add_scalar(tag, value, step)
    writer.close()


def test_reader_merges_event_files_and_summary_compares_two_runs(tmp_path: Path) -> None:
    gtp, base = tmp_path / "a" / "gtp", tmp_path / "a" / "baseline"
    _write(
        gtp / "tb_logs",
        {
            "reduced_train_loss": [(0, 4.0), (1, 3.0), (2, 2.5)],
            "train/step_s": [(0, 0.5), (1, 0.11), (2, 0.13)],
            "gtp/exposed_comm_s": [(0, 0.01), (1, 0.02), (2, 0.01)],
            "train/rss_gib": [(0, 1.0), (1, 1.1), (2, 1.1)],
        },
    )
    # a resumed run's second event file: step 2 written again wins, step 3 is new
    _write(gtp / "tb_logs", {"reduced_train_loss": [(2, 2.0), (3, 1.5)], "val_loss": [(3, 2.2)]})
    _write(
        base / "tb_logs",
        {
            "reduced_train_loss": [(0, 4.0), (1, 3.0), (2, 2.0), (3, 1.5 * (1 + 1e-3))],
            "train/step_s": [(0, 0.4), (1, 0.10), (2, 0.10)],
        },
    )
    run = report.read_run(gtp)
    assert run.name == "gtp"
    assert run.series(*report.LOSS) == [(0, 4.0), (1, 3.0), (2, 2.0), (3, 1.5)]
    assert run.series(*report.VAL_LOSS) == [(3, pytest.approx(2.2))]
    assert run.series("not/logged", "train/step_s")[1] == (1, pytest.approx(0.11))
    png = tmp_path / "out" / "plot.png"
    runs, line = report.report([gtp, base], png)
    assert png.stat().st_size > 10_000
    assert report.max_rel_loss_diff(*runs) == (pytest.approx(1e-3 / (1 + 1e-3), rel=1e-4), 4)
    # fewer steps than the warm-up (report.WARMUP_STEPS): the medians of all of them
    assert re.fullmatch(
        r"gtp vs baseline: median step time 130\.0 / 100\.0 ms = 1\.30; max rel loss diff "
        r"1\.0e-03 over 4 common steps",
        line,
    ), line
    assert report.summary([run]).startswith("gtp: 4 steps, last loss 1.5000, median step time")


def test_run_verdict_and_report_time_the_same_steps() -> None:
    """The CLI's VERDICT (rank 0's records, steps counted from 1) and the report (TensorBoard,
    steps from 0, or every ``log_every_n_steps``) leave out the same warm-up steps."""
    from nemo_gtp.run import verdict

    gtp_s = [0.9, 0.5, 0.4, 0.3, 0.3, 0.12, 0.13, 0.11, 0.14, 0.12]
    base_s = [0.8, 0.2, 0.2, 0.2, 0.2, 0.10, 0.10, 0.10, 0.11, 0.10]
    assert report.WARMUP_STEPS == 5
    tb_gtp, tb_base = list(enumerate(gtp_s)), list(enumerate(base_s))
    assert report.median_after_warmup(tb_gtp) == pytest.approx(0.12)
    assert report.median_after_warmup(tb_base) == pytest.approx(0.10)
    # every third step logged (0, 3, 6, 9): steps 6 and 9 count
    assert report.median_after_warmup(tb_gtp[::3]) == pytest.approx(0.125)
    assert report.median_after_warmup([(40, 1.0), (41, 3.0)]) == 2.0  # a resumed run's few
    assert report.median_after_warmup([]) != report.median_after_warmup([])  # NaN

    def records(seconds: list[float]) -> list[dict]:
        return [{"step": i + 1, "loss": 1.0, "ms": 1000 * t} for i, t in enumerate(seconds)]

    ok, line = verdict(records(gtp_s), records(base_s), "32")
    assert ok and line.endswith("step time GTP/baseline 1.20"), line


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report.main([str(tmp_path)]) == 2
    assert "no TensorBoard event files" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        report.main(["a", "b", "c"])


def test_the_plot_reads_at_a_glance() -> None:
    """One legend above the panels (none over the data); steps numbered from 1 as the console
    numbers them; the step-time panel scaled to the steady state, the slow first step off
    scale and marked; a unit on every axis."""
    from nemo_gtp.report import LOSS, MODEL_STATE, STEP_TIME, RunLog, figure

    def run(name: str, first_s: float) -> RunLog:
        times = [(0, first_s)] + [(s, 0.05 + 0.001 * s) for s in range(1, 30)]
        loss = [(s, 5.0 - 0.1 * s) for s in range(30)]
        state = [(s, 0.001) for s in range(30)]
        scalars = {LOSS[0]: loss, STEP_TIME[0]: times, MODEL_STATE[0]: state}
        return RunLog(name, Path(name), scalars)

    fig = figure([run("gtp", 0.65), run("baseline", 0.1)])
    loss_ax, time_ax, comm_ax, mem_ax = fig.axes[:4]
    assert fig.legends and not any(ax.get_legend() for ax in fig.axes)
    assert list(loss_ax.lines[0].get_xdata())[:2] == [1, 2]  # the console's step 1 and 2
    bottom, top = time_ax.get_ylim()
    assert 0.079 * 1000 <= top < 650 and bottom == 0  # steady state: 50-79 ms
    assert any("650 ms" in text.get_text() for text in time_ax.texts)  # the first step, marked
    for ax in fig.axes:
        if ax.get_ylabel():
            assert any(unit in ax.get_ylabel() for unit in ("ms", "GiB", "MiB", "nats")), ax
    assert comm_ax.texts[0].get_text() == "not logged"
