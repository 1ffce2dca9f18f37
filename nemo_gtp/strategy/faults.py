"""What a rank does about a fault: a hung collective, a preemption, a non-finite gradient.

Three Lightning callbacks, each for one fault, that the YAML recipes add (``faults`` section,
:func:`nemo_gtp.recipes.loader.build_fit`) and NeMo users may add to their own trainer:

- :class:`CollectiveTimeout`: every process group of the job (torch's default group, megatron's,
  GTP's) gets the same timeout, so a rank that stops entering collectives ends the job after
  it instead of after gloo's 30 or NCCL's 10 minutes; GTP's own waits (its gathers and
  reduce-scatters) wait on the same groups, so they time out too.
- :class:`GTPPreemption`: a ``SIGTERM`` (Slurm's preemption) makes every rank save a
  checkpoint at the next step boundary (GTP's communication drained first, as for every save)
  and stop, so the job exits 0 and ``+resume=latest`` continues from that step.
- :class:`NonFiniteGradCheck`: megatron's ``ddp.check_for_nan_in_grad`` under GTP: the gradient
  of every parameter is checked once reduced (GTP's reduce-scatter, then data parallel), the
  step it appears, and the run stops naming the step and the first parameter with a NaN/Inf.

:func:`current_step` is the step in progress, for the rank's error record
(:func:`nemo_gtp.recipes.supervise.write_rank_error`).

Example::

    trainer = nl.Trainer(..., callbacks=[CollectiveTimeout(300), GTPPreemption(),
                                         NonFiniteGradCheck()])
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from nemo_gtp.strategy.callbacks import drain_all

_state: dict[str, Any] = {"step": None, "preempted": False, "reported": None}
_error_sinks: list[Callable[[BaseException], None]] = []


def current_step() -> int | None:
    """The training step this rank is in (None before the first), as the fault callbacks saw
    it start."""
    return _state["step"]


def add_error_sink(sink: Callable[[BaseException], None]) -> None:
    """Call ``sink(exception)`` as soon as the fit fails on this rank (the callbacks'
    ``on_exception``, before Lightning's teardown, which may wait on dead peers), once per
    exception. The recipe launcher records it for its summary this way."""
    _error_sinks.append(sink)


def report_error(exception: BaseException) -> None:
    """Hand ``exception`` to every sink once (see :func:`add_error_sink`)."""
    if _state["reported"] is exception:
        return
    _state["reported"] = exception
    for sink in _error_sinks:
        sink(exception)


def _flag_device() -> torch.device:
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    return (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )


class _StepTracker(pl.Callback):
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        _state["step"] = trainer.global_step

    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException) -> None:
        report_error(exception)


class CollectiveTimeout(_StepTracker):
    """Set ``seconds`` as the timeout of every process group this rank belongs to.

    Applied in ``setup`` (after the strategy made the default, megatron's and GTP's groups,
    before the model is set up) and again at the start of training (groups made in between).
    A collective that waits longer raises on each waiting rank (gloo: "Timed out waiting
    ...ms"; NCCL: the watchdog aborts the communicator), and the launcher stops the rest.

    Example: ``nl.Trainer(..., callbacks=[CollectiveTimeout(120)])``.
    """

    def __init__(self, seconds: float) -> None:
        if not seconds > 0:
            raise ValueError(f"CollectiveTimeout: seconds must be > 0, got {seconds}")
        self.timeout = timedelta(seconds=seconds)

    def apply(self) -> int:
        """Set the timeout on every process group of this rank; returns how many."""
        if not dist.is_initialized():
            return 0
        from torch.distributed import distributed_c10d as c10d

        count = 0
        for group in list(c10d._world.pg_map):
            if dist.get_rank(group) < 0:  # not a member
                continue
            # torch's _set_pg_timeout, without its check of the backend's class, which refuses
            # the CPU runs' shared-device gloo class (nemo_gtp.cpu.gloo_device) with a warning
            for device in group._device_types:
                setter = getattr(group._get_backend(device), "_set_default_timeout", None)
                if setter is not None:
                    setter(self.timeout)
                    count += 1
        return count

    def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        self.apply()

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.apply()


def _on_signal(signum: int, frame: Any) -> None:
    _state["preempted"] = True


def install_preemption_handler(sig: int = signal.SIGTERM) -> bool:
    """Make ``sig`` mark this process preempted instead of ending it (main thread only;
    returns whether it was installed). The rank's launcher calls it before NeMo is set up, so
    a ``SIGTERM`` during the set-up is kept for the first step boundary too."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(sig, _on_signal)
    return True


class GTPPreemption(_StepTracker):
    """Save and stop at the step boundary after a ``SIGTERM`` (NeMo's ``PreemptionCallback``,
    for GTP and CPU ranks too).

    At the end of each step the ranks agree (a one-element all-reduce) whether any of them was
    signalled; if so, the trainer's checkpoint callback saves this step now, as its periodic
    save would (``<dir>/step=N``, GTP drained before it), and the trainer stops: the fit ends
    normally and the process exits 0. NeMo's own callback reads CUDA's current device (CPU
    ranks fail) and saves a ``-last`` checkpoint only when ``save_last`` is on.

    Example: ``nl.Trainer(..., callbacks=[GTPPreemption(), nl.ModelCheckpoint(...)])``.
    """

    def __init__(self, sig: int = signal.SIGTERM) -> None:
        self.sig = sig
        self.saved: str | None = None

    def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        install_preemption_handler(self.sig)

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        # Lightning's own SIGTERM handler, set up since, would raise SIGTERMException at the end
        # of the step (exit 1, after or without the save): this one alone decides.
        install_preemption_handler(self.sig)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        flag = torch.tensor([1.0 if _state["preempted"] else 0.0], device=_flag_device())
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return
        drain_all(trainer)
        checkpoint = trainer.checkpoint_callback
        if checkpoint is not None and getattr(checkpoint, "dirpath", None):
            candidates = checkpoint._monitor_candidates(trainer)
            checkpoint._save_topk_checkpoint(trainer, candidates)
            self.saved = checkpoint.format_checkpoint_name(candidates)
        if trainer.global_rank == 0:
            where = f"saved {self.saved}" if self.saved else "no checkpoint callback: nothing saved"
            print(f"preempted: stopping after step {trainer.global_step} ({where})", flush=True)
        trainer.should_stop = True
        _state["preempted"] = False  # handled: a later fit in this process starts afresh


class NonFiniteGradCheck(_StepTracker):
    """Stop at the step a NaN or Inf appears in a reduced gradient, naming the parameter.

    In ``on_before_optimizer_step`` (after megatron's and GTP's gradient reduction, before the
    optimizer uses the gradients) every parameter's gradient is checked; the ranks agree on
    who found one (an all-reduce of a pair of flags per rank), and every rank raises
    ``FloatingPointError`` naming the step and the first parameter, in model order, whose
    gradient is not finite (on the ranks that hold it; the others name those ranks). A NaN or
    Inf loss is refused too: in the same check where the strategy keeps the step's loss
    (``GTPMegatronStrategy.last_train_loss``), else at the end of its step. Nothing of that
    step is saved.

    The check reads the device once per step (the flags, after their all-reduce): each read
    is a host sync on a GPU, where megatron's own check reads once per gradient bucket.

    Example: ``nl.Trainer(..., callbacks=[NonFiniteGradCheck()])``.
    """

    def __init__(self) -> None:
        self._loss_checked = False  # this step's loss was checked with its gradients

    def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        # megatron's own check (in the backward, per gradient bucket) would raise first and
        # name only a bucket: this one replaces it, at the same step, naming the parameter.
        ddp = getattr(trainer.strategy, "ddp_config", None)
        if getattr(ddp, "check_for_nan_in_grad", False):
            ddp.check_for_nan_in_grad = False

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        named = []
        for name, param in pl_module.named_parameters():
            grad = getattr(param, "main_grad", None)
            named.append((name, param.grad if grad is None else grad))
        named = [(name, grad) for name, grad in named if grad is not None]
        loss = getattr(trainer.strategy, "last_train_loss", None)
        self._loss_checked = loss is not None
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        # per rank: [a gradient is not finite, the loss is not finite], set on the device
        flags = torch.zeros(world, 2, device=_flag_device())
        finite = None
        if named:
            finite = torch.stack([torch.isfinite(grad).all() for _, grad in named])
            flags[rank, 0] = ~finite.all()
        if loss is not None:
            flags[rank, 1] = ~torch.isfinite(loss).all()
        if world > 1:
            dist.all_reduce(flags)
        if not flags.any().item():  # the step's one host read
            return
        found = flags.tolist()
        step = trainer.global_step
        if found[rank][0]:
            first = named[int((~finite).nonzero()[0])][0]
            raise FloatingPointError(
                f"non-finite gradient at step {step}: first parameter {first} (checked after "
                "the gradient reduction; ddp.check_for_nan_in_grad)"
            )
        if found[rank][1]:
            raise FloatingPointError(f"non-finite loss at step {step}: {loss}")
        grads = ", ".join(str(r) for r, (grad, _) in enumerate(found) if grad)
        raise FloatingPointError(
            f"non-finite gradient at step {step} on rank(s) {grads} (ddp.check_for_nan_in_grad)"
            if grads
            else f"non-finite loss at step {step} on rank(s) "
            + ", ".join(str(r) for r, (_, bad) in enumerate(found) if bad)
        )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, *a: Any
    ) -> None:
        if self._loss_checked:  # with the gradients, before the optimizer step
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and not bool(torch.isfinite(loss).all()):
            raise FloatingPointError(f"non-finite loss at step {trainer.global_step}: {loss}")


def ensure_nonfinite_check(trainer: pl.Trainer) -> NonFiniteGradCheck | None:
    """Give ``trainer`` a :class:`NonFiniteGradCheck` when its strategy's DDP config has
    megatron's ``check_for_nan_in_grad`` on and it has none yet (set up at once: the callbacks'
    ``setup`` hooks have run). ``GTPMegatronStrategy.setup`` calls it, so a NeMo user's flag
    names the parameter under GTP too. Returns the callback added, if any."""
    ddp = getattr(trainer.strategy, "ddp_config", None)
    if not getattr(ddp, "check_for_nan_in_grad", False):
        return None
    if any(isinstance(c, NonFiniteGradCheck) for c in trainer.callbacks):
        return None
    check = NonFiniteGradCheck()
    trainer.callbacks.insert(0, check)
    check.setup(trainer, trainer.lightning_module, "fit")
    return check
