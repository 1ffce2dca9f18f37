"""Lightning callbacks for GTP runs: drain GTP communication at boundaries, log GTP metrics.

The metrics go through Lightning's ``LightningModule.log``, as NeMo's own loss does: at the same
step and ``log_every_n_steps``, to every logger of the trainer (the TensorBoard logger NeMo's
``nl.NeMoLogger(tensorboard=...)`` installs, Lightning's default logger, or any other);
``python -m nemo_gtp.report`` draws them from TensorBoard event files.

Both find the model's :class:`GTPRuntime` objects through :func:`gtp_runtimes` (the strategy's
list when it is a ``GTPMegatronStrategy``, else a walk over the module's parameters).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import TQDMProgressBar

from nemo_gtp.engine import GTPRuntime, runtimes_of
from nemo_gtp.strategy.accounting import MemoryFootprint, memory_footprint

_log = logging.getLogger(__name__)


def gtp_runtimes(trainer: pl.Trainer) -> list[GTPRuntime]:
    """Every GTP runtime of the model ``trainer`` trains (empty when GTP is off)."""
    runtimes = getattr(trainer.strategy, "gtp_runtimes", None)
    if runtimes is not None:
        return list(runtimes)
    model = trainer.strategy.model
    return runtimes_of(model) if model is not None else []


def start_wait_timing(runtimes: list[GTPRuntime]) -> list[GTPRuntime]:
    """Time the waits of ``runtimes`` from now on; returns those this call switched on (a timer
    someone else enabled is theirs to collect). Pair with :func:`stop_wait_timing`.

    Example::

        timed = start_wait_timing(gtp_runtimes(trainer))   # at a step's start
        exposed = stop_wait_timing(timed)                   # at its end: {"gather": s, ...}
    """
    timed = [runtime for runtime in runtimes if not runtime.wait_timer.enabled]
    for runtime in timed:
        runtime.wait_timer.enable()
        runtime.wait_timer.collect()  # drop what accumulated outside this step
    return timed


def stop_wait_timing(timed: list[GTPRuntime]) -> dict[str, float]:
    """Seconds of exposed wait per kind since :func:`start_wait_timing`, summed over ``timed``
    (synchronizes their CUDA events); their timers are switched off again."""
    exposed: dict[str, float] = {}
    for runtime in timed:
        for kind, seconds in runtime.wait_timer.collect().items():
            exposed[kind] = exposed.get(kind, 0.0) + seconds
        runtime.wait_timer.enable(False)
    return exposed


def process_memory_metrics(before_fit: int = 0) -> dict[str, float]:
    """This process's memory now, in GiB: ``train/memory_allocated_gib`` and
    ``train/peak_memory_gib`` (CUDA caching allocator: allocated now, and the peak since the last
    ``torch.cuda.reset_peak_memory_stats`` less ``before_fit`` bytes, what the process held
    before the fit began), else ``train/rss_gib`` (resident set, CPU runs)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {
            "train/memory_allocated_gib": torch.cuda.memory_allocated() / 2**30,
            "train/peak_memory_gib": (torch.cuda.max_memory_allocated() - before_fit) / 2**30,
        }
    try:
        import psutil
    except ImportError:  # optional: the metric is left out
        return {}
    return {"train/rss_gib": psutil.Process().memory_info().rss / 2**30}


def drain_all(trainer: pl.Trainer) -> None:
    """Complete every in-flight GTP gather / reduce-scatter (the §3.1 fence)."""
    for runtime in gtp_runtimes(trainer):
        runtime.drain()


class GTPDrainCallback(pl.Callback):
    """Drain every GTP runtime before checkpoint save, evaluation, fit end and on exception.

    After a drain no GTP collective is in flight and every GTP ``main_grad`` is final, so a
    checkpoint never captures a half-reduced gradient, an evaluation loop never consumes a
    prefetch issued for training, and a failing rank does not leave collectives behind.
    ``GTPMegatronStrategy`` adds it automatically.

    Example::

        trainer = nl.Trainer(..., strategy=GTPMegatronStrategy(...), callbacks=[GTPDrainCallback()])
    """

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        drain_all(trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        drain_all(trainer)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        drain_all(trainer)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        drain_all(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        drain_all(trainer)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        try:  # best effort: never mask the exception that is already propagating
            drain_all(trainer)
        except Exception as err:
            _log.warning("GTP drain after %r failed: %r", exception, err)


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class GTPMetricsCallback(pl.Callback):
    """Log GTP communication and memory to the trainer's loggers at every training step that
    Lightning logs (each ``trainer.log_every_n_steps``; the other steps are not measured).

    Every run, GTP or not (the baseline a GTP run is compared with logs them too):
    ``train/step_s`` (wall time of the step), ``train/model_state_gib`` (weights + gradient
    buffers + optimizer state of this rank) and :func:`process_memory_metrics`, whose peak is
    this fit's own (since its training started, net of what the process held before the fit
    began: a fit run earlier in the process, as ``--compare-baseline``'s GTP fit before its
    baseline, is not counted).
    GTP runs, per step (counters reset at each step start): ``gtp/gather_bytes`` (FP8 gathers
    count their FP8 bytes, half of bf16's: design §1.3 "FP8 gather"),
    ``gtp/reduce_scatter_bytes``, ``gtp/gathers``, ``gtp/prefetches``, ``gtp/prefetch_skipped``,
    ``gtp/fp8_gathers``,
    ``gtp/exposed_gather_s`` / ``gtp/exposed_reduce_scatter_s`` / ``gtp/exposed_comm_s`` (how
    long the compute stream stalled on GTP collectives: CUDA events on GPU, host time on CPU),
    ``gtp/step_s`` and ``gtp/exposed_comm_fraction``. Constant per run: ``gtp/weight_bytes``,
    ``gtp/grad_bytes``, ``gtp/optimizer_bytes`` and their ``unsharded_*`` twins (see
    :mod:`nemo_gtp.strategy.accounting`). The last values stay in :attr:`last_metrics`.

    Example::

        trainer = nl.Trainer(..., callbacks=[GTPMetricsCallback()])
    """

    def __init__(self) -> None:
        self.last_metrics: dict[str, float] = {}
        self.last_step = -1
        """``trainer.global_step`` after the step :attr:`last_metrics` measured."""
        self._footprint: MemoryFootprint | None = None
        self._step_start = 0.0
        self._timed: list = []  # the runtimes whose waits this step times
        self._logs = False  # whether Lightning writes this step to its loggers
        self._before_fit = 0  # bytes allocated when the fit began (its model not yet built)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning calls it before the model is built: what is allocated now is not this fit's
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._before_fit = torch.cuda.memory_allocated()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()  # this fit's peak, not an earlier fit's

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # Only the steps Lightning writes to its loggers (trainer.log_every_n_steps) are
        # measured: the other steps' values would be dropped. Their waits are not timed (two
        # CUDA events each, ~3 per weight; untimed steps take the runtime's one-frame consume,
        # design §3.1 "Host cost per weight") and the host is not synchronized with the GPU.
        logs = getattr(getattr(trainer, "_logger_connector", None), "should_update_logs", True)
        runtimes = gtp_runtimes(trainer)
        for runtime in runtimes:
            runtime.stats.reset()
        self._logs, self._timed = logs, start_wait_timing(runtimes) if logs else []
        if logs:
            _synchronize()  # the step's time is its own, not the previous step's GPU tail
        self._step_start = time.perf_counter()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self._logs:
            return
        runtimes = gtp_runtimes(trainer)
        if self._footprint is None:  # after the first optimizer step: optimizer state exists
            self._footprint = memory_footprint(trainer.strategy.model, trainer.strategy.optimizers)
        footprint = self._footprint
        state_bytes = footprint.weight_bytes + footprint.grad_bytes + footprint.optimizer_bytes
        metrics: dict[str, float] = {"train/model_state_gib": state_bytes / 2**30}
        metrics.update(process_memory_metrics(self._before_fit))
        if not runtimes:
            metrics["train/step_s"] = self._step_seconds()
            self._log(trainer, metrics)
            return
        for name in (
            "gather_bytes",
            "reduce_scatter_bytes",
            "gathers",
            "prefetches",
            "prefetch_skipped",
            "fp8_gathers",
        ):
            metrics[f"gtp/{name}"] = float(sum(getattr(r.stats, name) for r in runtimes))
        exposed = stop_wait_timing(self._timed)
        step_s = metrics["train/step_s"] = self._step_seconds()
        metrics["gtp/step_s"] = step_s
        if self._timed:  # a step Lightning logs: its exposed communication
            metrics["gtp/exposed_gather_s"] = exposed.get("gather", 0.0)
            metrics["gtp/exposed_reduce_scatter_s"] = exposed.get("reduce_scatter", 0.0)
            metrics["gtp/exposed_comm_s"] = sum(exposed.values())
            metrics["gtp/exposed_comm_fraction"] = min(1.0, metrics["gtp/exposed_comm_s"] / step_s)
        self._timed = []
        metrics.update(footprint.as_metrics())
        self._log(trainer, metrics)

    def _step_seconds(self) -> float:
        # The step's GPU work included, the same way with and without GTP.
        _synchronize()
        return time.perf_counter() - self._step_start

    def _log(self, trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        self.last_metrics, self.last_step = metrics, trainer.global_step
        # Each rank its own values (the loggers write rank 0's), not reduced across ranks:
        # straight to the loggers, at the step Lightning gives this batch's on-step metrics
        # (its per-key result collection of LightningModule.log_dict cost 25-43 ms per step for
        # these ~20 floats on a 2-core machine, measured; nothing reads them back from it).
        trainer._logger_connector.log_metrics(metrics)


class GTPProgressBar(TQDMProgressBar):
    """Lightning's progress bar plus the exposed-communication fraction of the last step.

    Reads :class:`GTPMetricsCallback` (add both); the loss comes from NeMo's logged
    ``reduced_train_loss`` as usual.

    Example::

        trainer = nl.Trainer(..., callbacks=[GTPMetricsCallback(), GTPProgressBar()])
    """

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        for callback in trainer.callbacks:
            if isinstance(callback, GTPMetricsCallback) and callback.last_metrics:
                fraction = callback.last_metrics.get("gtp/exposed_comm_fraction", 0.0)
                metrics["exposed_comm"] = f"{100 * fraction:.1f}%"
        return metrics
