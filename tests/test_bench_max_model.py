"""``bench.bench_max_model``: the largest-model search, its driver and its probe processes.

The search and the driver's bookkeeping run against known memory lines (every mode's peak is
linear in the layer count; the probe stand-in says ok below the budget, oom above). The probe
runner runs real processes on CPU/gloo: a real 2-layer GTP2 probe through megatron, an OOM on
one rank while its peer waits in a collective, and a hang, each of which must come back as a
result within its bound.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench.bench_max_model import (
    MODES,
    OK,
    OOM,
    Line,
    Point,
    Sweep,
    next_layers,
    parse_args,
    planner_line,
    run_probe,
)
from nemo_gtp.plan import GIB, ModelShape

GPU_SHAPE = ModelShape(layers=1, hidden=4096, ffn=16384, heads=32, vocab=32000, seq=4096)
BUDGET = 140 * GIB
GPU_ARGS = ["--hidden", "4096", "--ffn", "16384", "--heads", "32", "--vocab", "32000"]
GPU_ARGS += ["--seq", "4096", "--mbs", "1", "--memory-limit-gib", "140"]


def search(
    truth: Line, prior: Line, first_fraction: float | None, limit: int = 8
) -> tuple[int, list[Point]]:
    """Run next_layers against ``truth`` until it stops; (largest ok, probes)."""
    points: list[Point] = []
    while (layers := next_layers(points, prior, BUDGET, first_fraction=first_fraction)) is not None:
        assert layers not in [p.layers for p in points], f"probed {layers} twice: {points}"
        peak = truth.at(layers)
        points.append(Point(layers, OK if peak <= BUDGET else OOM, peak))
        assert len(points) <= limit, points
    return max((p.layers for p in points if p.outcome == OK), default=0), points


@pytest.mark.parametrize(
    ("slope_scale", "intercept_gib", "max_probes"),
    [
        (1.0, 0.0, 4),  # the planner is right: calibration, prediction (1 GiB margin), above
        (1.66, 5.0, 4),  # the local spec's unfused attention (activations ~2.4x the planner's)
        (0.8, -2.0, 4),  # the planner is pessimistic
        (2.5, 20.0, 5),  # far off
    ],
)
def test_search_brackets_the_largest_fit(
    slope_scale: float, intercept_gib: float, max_probes: int
) -> None:
    prior = planner_line(MODES["gtp2"], GPU_SHAPE, world=2, tokens_per_gpu=4096)
    truth = Line(prior.a + intercept_gib * GIB, prior.b * slope_scale)
    largest, points = search(truth, prior, first_fraction=0.5)
    assert largest == truth.max_layers(BUDGET)
    assert any(p.layers == largest + 1 and p.outcome == OOM for p in points)
    assert len(points) <= max_probes, points


def test_search_with_a_calibrated_prior_probes_twice_and_stops_when_nothing_fits() -> None:
    truth = Line(12 * GIB, 5 * GIB)  # 25 layers: 137 GiB, 26: 142
    largest, points = search(truth, truth, first_fraction=None)
    assert largest == truth.max_layers(BUDGET) and len(points) == 2
    # nothing fits: each probe a quarter smaller, down to 1 layer (the sweep caps the probes)
    nothing = Line(200 * GIB, GIB)
    largest, points = search(nothing, Line(10 * GIB, GIB), first_fraction=None, limit=20)
    assert largest == 0 and points[-1].layers == 1
    # data contradicting the line (fails far below its guess): bisect inside the bracket
    contradicted = [Point(10, OK, 50 * GIB), Point(20, OOM)]
    assert next_layers(contradicted, Line(0.0, 0.1 * GIB), BUDGET) == 15


def fake_runner(truths: dict[str, Line], broken: set[str]):  # noqa: ANN201
    """A probe stand-in: ok / oom from the mode's true line; ``broken`` modes cannot run."""

    def run(args, mode: str, layers: int, timeout_s: float) -> dict:  # noqa: ANN001
        if mode in broken:
            return dict(mode=mode, layers=layers, outcome="error", error="no such API", wall_s=1)
        peak = truths[mode].at(layers)
        if peak > BUDGET:
            return dict(mode=mode, layers=layers, outcome=OOM, error="CUDA out of memory", wall_s=1)
        step_ms = 100.0 * layers * (1.3 if MODES[mode].recompute else 1.0)
        return dict(
            mode=mode,
            layers=layers,
            outcome=OK,
            wall_s=2.0,
            params=layers * 201_000_000,
            step_ms=step_ms,
            tokens_per_s=8192 / step_ms * 1000,
            peak_allocated_gib=peak / GIB - 2,
            peak_reserved_gib=peak / GIB - 1,
            peak_effective_gib=peak / GIB,
            gather_backend=None,
        )

    return run


def test_sweep_finds_every_mode_and_writes_reports(tmp_path) -> None:  # noqa: ANN001
    args = parse_args(
        ["--device", "cpu", "--out", str(tmp_path), *GPU_ARGS]
        + ["--modes", "gtp2,dp2,fsdp2,gtp2_recompute,mfsdp"]
    )
    sweep = Sweep(args)
    # true lines: the planner's slope 1.66x (activations), 5 GiB more intercept
    truths = {}
    for name in ("gtp2", "dp2", "fsdp2", "gtp2_recompute"):
        planner = sweep.prior(name)[0]
        truths[name] = Line(planner.a + 5 * GIB, planner.b * 1.66)
    sweep.runner = fake_runner(truths, broken={"mfsdp"})
    sweep.run()
    report = json.loads((tmp_path / "max_model.json").read_text())
    assert report["complete"]
    for name, truth in truths.items():
        entry = report["modes"][name]
        assert entry["largest_layers"] == truth.max_layers(BUDGET), name
        assert entry["status"] == "largest found"
    probes = [p["mode"] for p in report["probes"]]
    # dp2 and fsdp2 start from gtp2's calibration instead of a calibration probe of their own
    assert probes.count("dp2") <= 3 and probes.count("fsdp2") <= 3, probes
    cmp = report["recompute_vs_gtp2"]
    assert cmp["layers"] == report["modes"]["gtp2"]["largest_layers"]
    assert cmp["ratio"] == pytest.approx(1.3)
    assert report["modes"]["mfsdp"]["status"].startswith("cannot run: no such API")
    md = (tmp_path / "max_model.md").read_text()
    assert "| gtp2 |" in md and "Megatron-FSDP: cannot run" in md and "1.300x" in md


def test_sweep_stops_at_its_time_budget(tmp_path) -> None:  # noqa: ANN001
    args = parse_args(
        ["--device", "cpu", "--out", str(tmp_path), "--budget-s", "3", *GPU_ARGS]
        + ["--modes", "gtp2,dp2"]
    )
    sweep = Sweep(args, runner=fake_runner({"gtp2": Line(0, GIB), "dp2": Line(0, GIB)}, set()))
    sweep.run()
    assert sweep.modes["dp2"]["status"] == "stopped: the sweep's time budget is spent"


def test_probe_processes_ok_oom_on_one_rank_and_hang(tmp_path) -> None:  # noqa: ANN001
    """Real probe processes (gloo): results come back, and a rank blocked in a collective by
    its peer's OOM or a hang is killed instead of stalling the sweep."""
    base = ["--device", "cpu", "--out", str(tmp_path), "--steps", "2", "--timed-steps", "1"]
    jobs = {
        "ok": (parse_args(base), "gtp2", 2, 120.0),
        "oom": (parse_args([*base, "--fault", "oom"]), "dp2", 1, 120.0),
        "hang": (parse_args([*base, "--fault", "hang"]), "dp2", 2, 6.0),
    }
    start = time.monotonic()
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {k: pool.submit(run_probe, *job) for k, job in jobs.items()}
        results = {k: f.result() for k, f in futures.items()}
    ok, oom, hang = results["ok"], results["oom"], results["hang"]
    assert ok["outcome"] == OK, ok.get("error")
    assert ok["params"] > 0 and ok["step_ms"] > 0 and ok["peak_effective_gib"] > 0
    assert ok["gather_backend"] == "process_group" and len(ok["losses"]) == 2
    assert oom["outcome"] == OOM and "injected" in oom["error"]
    assert hang["outcome"] == "timeout" and 6 <= hang["wall_s"] < 30
    assert all(rc is not None for r in results.values() for rc in r["returncodes"])
    assert time.monotonic() - start < 120
