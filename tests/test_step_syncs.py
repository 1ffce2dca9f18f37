"""``SyncFreeLogging`` (``nemo_gtp.strategy.step_syncs``): logging makes no host read per step.

On CPU the reads a GPU step would sync on are counted by ``bench.sync_sites.HostReads``
(``.item()`` and the like, by Python site); Lightning's per-step conversion of every
``prog_bar`` metric is one of them. A tiny Lightning module on Lightning's own CPU trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from bench.sync_sites import HostReads
from nemo_gtp.strategy.step_syncs import SyncFreeLogging
from tests.harness.objects import HostReadsWindow


class _Tiny(pl.LightningModule):
    """Logs as NeMo does: a Python number (``lr``) and a device tensor (the loss), both
    ``prog_bar=True``; a third value positionally (``prog_bar`` as the third argument)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch).square().mean()
        self.log("lr", 0.1, prog_bar=True, batch_size=1)
        self.log("loss", loss.detach(), prog_bar=True, batch_size=1)
        self.log("step_size", 2, True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.randn(16, 2), batch_size=2)


class _Window(HostReadsWindow):
    """Host reads of step 2's whole loop iteration (the harness's window, put first), and the
    metrics Lightning holds when it closes."""

    def __init__(self) -> None:
        super().__init__(step=2)
        self.reads.depth = 1

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_batch_start(trainer, *args)
        if trainer.global_step == self.step + 1:
            self.progress_bar = dict(trainer.progress_bar_metrics)
            self.callback_metrics = dict(trainer.callback_metrics)


def _fit(*callbacks: pl.Callback, progress_bar: bool = False) -> tuple[_Tiny, HostReads, _Window]:
    window, module = _Window(), _Tiny()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=4,
        log_every_n_steps=100,  # no logged step in the window
        enable_progress_bar=progress_bar,
        enable_checkpointing=False,
        enable_model_summary=False,
        logger=False,
        callbacks=[window, *callbacks],
    )
    trainer.fit(module)
    return module, window.reads, window


def _lightning_reads(reads: HostReads) -> float:
    return sum(n for n, site in reads.per_step(1) if site.startswith("lightning/"))


def test_without_a_progress_bar_no_metric_is_read_back_per_step() -> None:
    """Plain Lightning reads each ``prog_bar`` metric back at every step's end (3 here); with
    the callback none, every value still reaches ``callback_metrics`` (``lr`` as a host tensor),
    and the module's own ``log`` is back after the fit."""
    _, plain, plain_window = _fit()
    assert _lightning_reads(plain) == 3
    assert sorted(plain_window.progress_bar) == ["loss", "lr", "step_size"]
    module, reads, window = _fit(SyncFreeLogging())
    assert _lightning_reads(reads) == 0 and window.progress_bar == {}
    assert sorted(window.callback_metrics) == ["loss", "lr", "step_size"]
    assert window.callback_metrics["lr"].device.type == "cpu"
    assert float(window.callback_metrics["lr"]) == pytest.approx(0.1)
    assert "log" not in vars(module)


def test_with_a_progress_bar_the_metrics_stay_on_it() -> None:
    """A progress bar keeps its metrics, read back per step as plain Lightning does."""
    _, plain, _ = _fit(progress_bar=True)
    _, reads, window = _fit(SyncFreeLogging(), progress_bar=True)
    assert sorted(window.progress_bar) == ["loss", "lr", "step_size"]
    assert _lightning_reads(reads) == _lightning_reads(plain) > 0


def _reduce_worker(rank: int, world: int, out: str) -> None:
    """Each rank: NeMo's reduction and ours of the same microbatch outputs (DP = 2)."""
    import json

    from megatron.core import parallel_state
    from nemo.lightning.megatron_parallel import MaskedTokenLossReduction

    from nemo_gtp.cpu.compat import enable_cpu_compat
    from nemo_gtp.strategy.step_syncs import SyncFreeTokenLossReduction

    enable_cpu_compat()
    parallel_state.initialize_model_parallel()
    generator = torch.Generator().manual_seed(rank)

    def outputs(tokens: list[int]) -> list[dict[str, torch.Tensor]]:
        sums = torch.rand(len(tokens), generator=generator, dtype=torch.float32) * 100
        return [
            {"loss_sum_and_ub_size": torch.cat([s.view(1), torch.tensor([n], dtype=torch.int)])}
            for s, n in zip(sums * torch.tensor([n > 0 for n in tokens]), tokens, strict=True)
        ]

    result = {}
    for name, tokens in (("all_have_tokens", [7, 5, 9, 3]), ("one_empty", [7, 0, 9, 3])):
        micro = outputs(tokens)
        nemo = MaskedTokenLossReduction().reduce(micro)
        with HostReads(depth=1) as reads:
            ours = SyncFreeTokenLossReduction().reduce(micro)
        same = bool(torch.equal(nemo, ours))
        result[name] = [float(nemo), float(ours), same, reads.counts.total()]
    with HostReads(depth=1) as reads:
        MaskedTokenLossReduction().reduce(outputs([7, 5, 9, 3]))
    result["nemo_reads"] = reads.counts.total()
    parallel_state.destroy_model_parallel()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def test_the_loss_reduction_reads_nothing_on_the_host_and_keeps_nemos_value(
    tmp_path: Path,
) -> None:
    """``SyncFreeTokenLossReduction`` (what ``SyncFreeLogging`` gives NeMo's GPT models): the
    logged loss over two data-parallel ranks equals NeMo's bit for bit when every microbatch
    has a token, and to rounding with an empty one; NeMo's reads each microbatch's token count
    on the host (a sync on a GPU, right after the backward is queued), ours reads nothing."""
    import json

    from tests.harness.checkpoint import run_ranks

    out = tmp_path / "reduce.json"
    run_ranks(_reduce_worker, 2, str(out))
    result = json.loads(out.read_text())
    nemo, ours, identical, reads = result["all_have_tokens"]
    assert identical and reads == 0
    nemo, ours, _, reads = result["one_empty"]
    assert ours == pytest.approx(nemo, rel=1e-6) and reads == 0
    assert result["nemo_reads"] == 4  # one per microbatch
