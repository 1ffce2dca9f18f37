"""``nemo_gtp.strategy.step_syncs``: logging (``SyncFreeLogging``) and megatron's gradient clip
(``SyncFreeGradClip``) make no host read per step, and change no value.

On CPU the reads a GPU step would sync on are counted by ``bench.sync_sites.HostReads``
(``.item()`` and the like, by Python site); Lightning's per-step conversion of every
``prog_bar`` metric is one of them (a tiny Lightning module on Lightning's own CPU trainer),
megatron's read of the grad norm another (megatron's optimizers on two gloo ranks, and NeMo
fits in the shared 2-rank launch).
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
from tests.harness.shared_launch import shared_launch
from tests.harness.strategy import Fit
from tests.test_strategy import UNLOGGED_STEP  # and its fits: base_tp1_dp2, tp1_gtp2_log3


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


# ------------------------------------------------------------ gradient clipping on the device
def _clip_worker(rank: int, world: int, out: str) -> None:
    """Each rank: megatron's optimizers (one, and a chain of two whose grad stats reduce over
    different groups) stepped with megatron's clip and with ``clip_grads_on_device``, from the
    same gradients: a norm that clips, one that does not, a NaN one."""
    import json
    import math

    from megatron.core import parallel_state
    from megatron.core.optimizer import ChainedOptimizer, FP32Optimizer, OptimizerConfig

    from nemo_gtp.cpu.compat import enable_cpu_compat
    from nemo_gtp.integrations.megatron.grad_clip import clip_grads_on_device

    enable_cpu_compat()
    parallel_state.initialize_model_parallel()

    def build(scale: float, nan: bool, chained: bool) -> tuple[list[torch.nn.Parameter], Any]:
        generator = torch.Generator().manual_seed(rank)
        params = [torch.nn.Parameter(torch.randn(n, generator=generator)) for n in (5, 7, 3, 4)]
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator) * scale
        if nan:  # one element: the norm is NaN, the other gradients stay finite
            params[1].grad[2] = float("nan")
        config = OptimizerConfig(clip_grad=1.0, lr=0.1)
        first = FP32Optimizer(torch.optim.SGD(params[:2], lr=0.1), config, None)
        if not chained:
            first.optimizer.add_param_group({"params": params[2:]})
            return params, first
        second = FP32Optimizer(torch.optim.SGD(params[2:], lr=0.1), config, None)
        second.grad_stats_parallel_group = torch.distributed.group.WORLD  # not shared
        return params, ChainedOptimizer([first, second])

    result = {}
    for chained in (False, True):
        cases = (("clips", 10.0, False), ("does_not_clip", 0.01, False), ("nan", 10.0, True))
        for name, scale, nan in cases:
            params, optimizer = build(scale, nan, chained)
            _, megatron_norm, _ = optimizer.step()
            reference = [p.detach().clone() for p in params]
            params, optimizer = build(scale, nan, chained)
            undo = clip_grads_on_device(optimizer)
            with HostReads(depth=1) as reads:
                _, norm, _ = optimizer.step()
            undo()
            same = all(
                torch.equal(p.detach().view(torch.int32), r.view(torch.int32))
                for p, r in zip(params, reference, strict=True)
            )
            # the fp32 rounding of megatron's float: what NeMo logs for it
            ours, theirs = float(norm), float(torch.tensor(megatron_norm, dtype=torch.float32))
            same_norm = ours == theirs or (math.isnan(ours) and math.isnan(theirs))
            restored = "step" not in vars(optimizer) and "clip_grad_norm" not in vars(optimizer)
            key = f"{'chained' if chained else 'single'}_{name}"
            result[key] = [same, same_norm, restored, megatron_norm, _our_reads(reads)]
    parallel_state.destroy_model_parallel()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)


def _our_reads(reads: HostReads) -> float:
    """Host reads outside megatron's L2 norm (its CPU fallback reads; TE's on a GPU does not)."""
    return sum(n for site, n in reads.counts.items() if "local_multi_tensor_l2_norm" not in site)


def test_clip_on_device_gives_megatrons_gradients_without_a_host_read(tmp_path: Path) -> None:
    """``clip_grads_on_device`` (``SyncFreeGradClip``): on two ranks, for one megatron optimizer
    and a chain of two with different grad-stats groups, the step's parameters equal megatron's
    bit for bit whether megatron clips or not (and with a NaN gradient, which neither clips),
    the norm equals megatron's, the step reads nothing on the host but megatron's own CPU
    fallback of the L2 norm (TE's on a GPU reads nothing), and ``undo`` restores megatron's."""
    import json

    from tests.harness.checkpoint import run_ranks

    out = tmp_path / "clip.json"
    run_ranks(_clip_worker, 2, str(out))
    for rank in range(2):
        result = json.loads(Path(f"{out}.{rank}").read_text())
        assert len(result) == 6
        for key, (same, same_norm, restored, _, reads) in result.items():
            assert same and same_norm and restored, (rank, key, result[key])
            assert reads == 0, (rank, key, reads)
        assert result["single_clips"][3] > 1.0 > result["single_does_not_clip"][3]
        assert result["chained_clips"][3] > 1.0 > result["chained_does_not_clip"][3]


CLIP_FITS = [  # in the shared 2-rank launch, beside test_strategy's (imported: registered)
    Fit("dp2_clip_on_device", clip_on_device=True, host_reads_at=UNLOGGED_STEP),
    Fit(
        "gtp2_clip_on_device",
        gtp=2,
        metrics=True,
        log_every=3,
        clip_on_device=True,
        host_reads_at=UNLOGGED_STEP,
    ),
]
shared_launch(2).add(CLIP_FITS)


def _sites(rank: dict[str, Any]) -> dict[str, float]:
    return {site.split(" < ")[0]: n for n, site in rank["host_reads"]}


def test_clip_on_device_fits_train_as_megatrons_clip_without_its_host_read(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Through NeMo's trainer (clip_grad=1.0, which clips the first steps): DP2 with
    ``SyncFreeGradClip`` has DP2's losses and grad norms bit for bit, GTP2 with it GTP2's; an
    unlogged step reads on the host where the fit without it does, except megatron's grad norm
    (``clip_grads.py``), which is gone."""
    results = shared_launch(2).results(tmp_path_factory)
    pairs = (("dp2_clip_on_device", "base_tp1_dp2"), ("gtp2_clip_on_device", "tp1_gtp2_log3"))
    for ours, megatrons in pairs:
        for mine, theirs in zip(results[ours], results[megatrons], strict=True):
            assert mine["losses"] == theirs["losses"], ours
            assert mine["grad_norms"] == theirs["grad_norms"], ours
            assert theirs["grad_norms"][0] > 1.0  # the clip really clips
            gone = {s for s in _sites(theirs) if s.startswith("megatron/core/optimizer/clip")}
            assert gone and not gone & _sites(mine).keys(), (gone, _sites(mine))
            assert _sites(mine).keys() == _sites(theirs).keys() - gone, ours


def test_the_recipes_step_reads_on_the_host_only_in_cpu_fallbacks(tmp_path: Path) -> None:
    """The step as users run it (a YAML recipe through ``nemo_gtp.recipes.loader``, its
    callbacks, ``GTPMegatronStrategy``, ``nl.Trainer``; ``bench.host_fake`` on CPU, GTP2 and
    DP2, free-running steps): the only host reads left are two CPU-only fallbacks that a GPU
    run does not take, torch's CPU Adam reading its step counters (TE's fused Adam on a GPU)
    and megatron's L2 norm without TE or apex (TE's multi-tensor norm on a GPU)."""
    import json
    import subprocess
    import sys

    command = [sys.executable, "-m", "bench.host_fake", "--one-process", "--modes"]
    command += ["gtp2_cpu,dp2_cpu", "--warmup", "2", "--steps", "1", "--free-steps", "3"]
    command += ["--sync-sites", "--out", str(tmp_path)]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    records = json.loads((tmp_path / "host_fake.json").read_text())
    assert [r["mode"] for r in records] == ["gtp2_cpu", "dp2_cpu"]
    for record in records:
        innermost = {site.split(" < ")[0]: n for n, site in record["sync_sites_per_step"]}
        functions = {site.split(" ")[-1]: n for site, n in innermost.items()}
        assert functions.keys() == {"step_with_ready_grads", "local_multi_tensor_l2_norm"}, (
            record["mode"],
            innermost,
        )
        assert functions["local_multi_tensor_l2_norm"] == 1.0  # one norm a step
