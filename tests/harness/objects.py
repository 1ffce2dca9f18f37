"""The strategy harness's Lightning callbacks and logger, at module level.

A fit that saves NeMo's checkpoint ``context/`` serializes the trainer's arguments, callbacks
and logger included, as importable class references: classes defined inside a function cannot
be. This module imports Lightning and NeMo, so the harness imports it only inside a spawned fit.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers.logger import Logger
from megatron.core.transformer.transformer_layer import TransformerLayer
from nemo.collections.llm import GPTModel


class Recorder(pl.Callback):
    """Per-step loss, grad norm, learning rate; end-of-fit batch bookkeeping."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.lrs: list[float] = []
        self.end: dict[str, Any] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))
        self.grad_norms.append(float(trainer.callback_metrics["grad_norm"]))

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        sampler = trainer.strategy.data_sampler
        self.end = {
            "num_microbatches": sampler.num_microbatches,
            "global_batch_size": sampler.current_global_batch_size,
            "consumed_samples": int(sampler.compute_consumed_samples(trainer.global_step)),
            "logged_consumed_samples": float(trainer.callback_metrics["consumed_samples"]),
            "logged_global_batch_size": float(trainer.callback_metrics["global_batch_size"]),
            "global_step": trainer.global_step,
        }


class HostReadsWindow(pl.Callback):
    """Counts the host reads (:class:`bench.sync_sites.HostReads`: ``.item()``, ``float()``,
    data-dependent shapes; each a host sync on a GPU) of training step ``step``'s whole loop
    iteration, from its ``on_train_batch_start`` to the next step's: put it first in the
    trainer's callbacks."""

    def __init__(self, step: int) -> None:
        from bench.sync_sites import HostReads

        self.step, self.reads = step, HostReads()

    def on_train_batch_start(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
        if trainer.global_step == self.step:
            self.reads.start()
        elif trainer.global_step == self.step + 1:
            self.reads.stop()


class EmulatedFP8Params(pl.Callback):
    """megatron's FP8 params emulated on the full linear weights of a run without GTP: the
    reference of FP8 primary GTP shards (design §1.3 "FP8 primary weights").

    The fp32 masters are kept here; between optimizer steps the linear weights that GTP shards
    hold their masters quantized on one rank (in the recipe the model config asks for, as GTP's
    shards would get it: ``fp8_primary_scaling``; the engine's formula) and dequantized, and the
    optimizer steps on the masters
    (:func:`~tests.harness.gpt.quantize_full_weights`, as the megatron-level
    harness does around its own steps).
    """

    def __init__(self) -> None:
        self.masters: dict[str, Any] = {}
        self.scaling: Any = None  # the model config's, at train start

    @staticmethod
    def _weights(pl_module: pl.LightningModule) -> dict[str, Any]:
        from tests.harness.gpt import FP8_PRIMARY_WEIGHTS

        return {n: p for n, p in pl_module.named_parameters() if n.endswith(FP8_PRIMARY_WEIGHTS)}

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        from nemo_gtp.integrations.megatron.model_config import fp8_primary_scaling
        from tests.harness.gpt import quantize_full_weights

        self.scaling = fp8_primary_scaling(pl_module.config)
        self.masters = quantize_full_weights(self._weights(pl_module), self.scaling)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: ANN001
        import torch

        with torch.no_grad():  # the optimizer updates the masters, not their quantization
            for name, param in self._weights(pl_module).items():
                param.copy_(self.masters[name])

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:  # noqa: ANN001, ANN002
        from tests.harness.gpt import quantize_full_weights

        self.masters = quantize_full_weights(self._weights(pl_module), self.scaling)


class TestableGPTModel(GPTModel):
    """NeMo's ``llm.GPTModel`` plus the ``test_step`` it lacks (``trainer.test`` refuses it with
    "No `test_step()` method defined"): a test step is a validation step, on the test split."""

    def test_step(self, batch: Any, batch_idx: int | None = None) -> Any:
        return self.validation_step(batch, batch_idx)

    @property
    def test_loss_reduction(self) -> Any:
        return self.validation_loss_reduction


class EvalRecorder(pl.Callback):
    """Every validation / test step's loss, each evaluation's ``val_loss``, and what GTP left
    outstanding (:meth:`GTPRuntime.outstanding`) when an evaluation loop ended (before the
    strategy's end-of-loop drain) and when the next training step started."""

    def __init__(self) -> None:
        self.steps: dict[str, list[tuple[int, float]]] = {"sanity": [], "val": [], "test": []}
        self.val_loss: list[tuple[int, float]] = []  # (global step, the epoch's val_loss)
        self.at_eval_end: list[list[dict[str, int]]] = []
        self.at_next_step: list[list[dict[str, int]]] = []
        self._evaluated = False

    @staticmethod
    def _outstanding(trainer: pl.Trainer) -> list[dict[str, int]]:
        return [r.outstanding() for r in getattr(trainer.strategy, "gtp_runtimes", [])]

    def on_validation_batch_end(self, trainer, pl_module, outputs, *args) -> None:  # noqa: ANN001, ANN002
        kind = "sanity" if trainer.sanity_checking else "val"
        self.steps[kind].append((trainer.global_step, float(outputs)))

    def on_test_batch_end(self, trainer, pl_module, outputs, *args) -> None:  # noqa: ANN001, ANN002
        self.steps["test"].append((trainer.global_step, float(outputs)))

    def on_validation_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        if not trainer.sanity_checking:
            self.val_loss.append((trainer.global_step, float(trainer.callback_metrics["val_loss"])))
        self._eval_end(trainer)

    def on_test_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        self._eval_end(trainer)

    def _eval_end(self, trainer: pl.Trainer) -> None:
        self.at_eval_end.append(self._outstanding(trainer))
        self._evaluated = True

    def on_train_batch_start(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
        if self._evaluated:
            self.at_next_step.append(self._outstanding(trainer))
            self._evaluated = False

    def results(self) -> dict[str, Any]:
        """What a harness result records (JSON-serializable)."""
        return {
            "eval_steps": self.steps,
            "val_loss": self.val_loss,
            "outstanding_at_eval_end": self.at_eval_end,
            "outstanding_at_next_step": self.at_next_step,
        }


class MemoryLogger(Logger):
    """A Lightning logger keeping every ``log_metrics`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int, dict[str, float]]] = []
        self.directory: str | None = None

    @property
    def name(self) -> str:
        return "memory"

    @property
    def save_dir(self) -> str | None:
        """``trainer.log_dir``; NeMo's ModelCheckpoint writes its git/log files there."""
        return self.directory

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((step, dict(metrics)))


class StopAfter(pl.Callback):
    """Ends the fit after ``steps`` optimizer steps (the run a crash would have cut short)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
        if trainer.global_step >= self.steps:
            trainer.should_stop = True


class StateDump(pl.Callback):
    """Rank 0 saves the model's full state, weights and optimizer state (``optimizer=False``:
    the fp32 mains alone, as after a weights-only load)
    (:func:`tests.harness.checkpoint.moe_full_state`: layout and expert-kind independent
    keys), to ``path`` once the global step is ``step``: at the train start (a fit resumed at that
    step: the state right after the checkpoint load) or after that training step. Every rank
    takes part (the state is gathered)."""

    def __init__(self, step: int, path: str, optimizer: bool = True) -> None:
        self.step, self.path, self.optimizer, self.done = step, path, optimizer, False

    def _dump(self, trainer: pl.Trainer) -> None:
        import torch
        import torch.distributed as dist

        from tests.harness.checkpoint import moe_full_state

        if self.done or trainer.global_step != self.step:
            return
        strategy = trainer.strategy
        optimizer = strategy.optimizers[0].mcore_optimizer
        state = moe_full_state(
            strategy.megatron_parallel[0].module, optimizer, moments=self.optimizer
        )
        if dist.get_rank() == 0:
            torch.save(state, self.path)
        self.done = True

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        self._dump(trainer)

    def on_train_batch_end(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
        self._dump(trainer)


# Transformer Engine's fused norm+linear names, the ones NeMo's Hugging Face exporters map from;
# megatron's local spec keeps the norms as modules of their own (and already saves them under
# these names in dist checkpoints, through its ``sharded_state_dict_keys_map``).
_TE_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def _te_norm_names(module: Any, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for local, te_name in _TE_NORM_NAMES.items():
        if prefix + local in state_dict:
            state_dict[prefix + te_name] = state_dict.pop(prefix + local)


def te_named_local_layer_spec(config: Any) -> Any:
    """NeMo's ``local_layer_spec`` (no Transformer Engine: CPU) whose layers' ``state_dict()`` names
    the norms as Transformer Engine's spec does, as NeMo's HF exporters read them.

    Only ``state_dict()`` changes: parameters, ``load_state_dict`` and dist checkpoints (which
    already use these names) are the local spec's.
    """
    from megatron.core.transformer.spec_utils import ModuleSpec
    from nemo.collections.llm.gpt.model.base import local_layer_spec

    spec = local_layer_spec(config)
    return ModuleSpec(
        module=TENamedTransformerLayer, params=spec.params, submodules=spec.submodules
    )


class TENamedTransformerLayer(TransformerLayer):
    """A local-spec ``TransformerLayer`` whose ``state_dict()`` uses Transformer Engine's norm
    names (see :func:`te_named_local_layer_spec`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._register_state_dict_hook(_te_norm_names)


def make_peft(kind: str) -> Any:
    """A NeMo PEFT method for the harness's tiny GPT, set up as ``llm.finetune(..., peft=...)``
    does (the model's ``model_transform`` and a trainer callback).

    - ``"lora"``: NeMo's ``llm.peft.LoRA``, rank-4 adapters beside every linear of the attention
      and the MLP; the rest of the model frozen.
    - ``"freeze_attention"``: no adapters; the attention's linears frozen, everything else
      trained (one chain, and one coalescing unit, then holds frozen and trained GTP weights).
    """
    from nemo.lightning.pytorch.callbacks.peft import PEFT

    from nemo_gtp.recipes.loader import peft_method

    if kind == "lora":
        targets = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
        lora = {"method": "lora", "target_modules": targets, "dim": 4, "alpha": 8, "dropout": 0.0}
        return peft_method(lora)
    if kind == "canonical_lora":  # the recipes' default targets: no gated-MLP halves
        return peft_method({"method": kind, "dim": 4, "alpha": 8, "dropout": 0.0})
    if kind == "dora":
        from nemo.collections import llm

        return llm.peft.DoRA(dim=4, alpha=8, dropout=0.0)
    if kind != "freeze_attention":
        raise ValueError(
            f"peft={kind!r}: the harness knows 'lora', 'canonical_lora', 'dora' and "
            "'freeze_attention'"
        )

    class FreezeAttention(PEFT):
        def transform(self, module: Any, name: Any = None, prefix: Any = None) -> Any:
            return module

        def freeze_model(self, model: Any) -> None:
            for name, param in model.named_parameters():
                if ".self_attention.linear_" in name:
                    param.requires_grad_(False)

    return FreezeAttention()
