"""Fixes for NeMo 2.7.3 bugs a user of this stack hits; each one contained and documented.

``SyntheticGPTDataModule``
    ``nemo.collections.llm.gpt.data.mock.MockDataModule.setup`` passes ``create_attention_mask``
    positionally into ``_MockGPTDataset``'s ``seed`` slot (``shared/notes/nemo_cpu.md`` R7). The
    datasets therefore never emit an ``attention_mask`` (and use seed ``int(flag)``), so without
    TransformerEngine ``gpt_forward_step`` fails with "dataloader did not provide an attention
    mask". The subclass passes both by keyword. ``MockDataModule`` also keeps no data position
    in checkpoints, so a resumed fit restarts at sample 0; the subclass saves and restores the
    consumed-sample count the way NeMo's ``PreTrainingDataModule`` does, so a resumed run sees
    exactly the samples the uninterrupted run would have. Everything else is
    ``MockDataModule``'s.
"""

from __future__ import annotations

from typing import Any

from nemo.collections.llm.gpt.data.mock import MockDataModule, _MockGPTDataset


class SyntheticGPTDataModule(MockDataModule):
    """NeMo's random-token ``MockDataModule`` with the attention-mask / seed bug fixed.

    Sample ``i`` of a split is ``numpy.random.default_rng(seed + i)`` tokens, so every data
    rank's samples are reproducible and distinct (the Megatron sampler hands out indices).

    Example::

        data = SyntheticGPTDataModule(seq_length=32, tokenizer=NullTokenizer(255),
                                      micro_batch_size=2, global_batch_size=8,
                                      num_workers=0, pin_memory=False)
    """

    def __init__(self, *args: Any, seed: int = 42, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seed = seed
        self.init_global_step = 0

    def _create_dataloader(self, dataset: Any, **kwargs: Any) -> Any:
        # The step this fit's data stream starts at (after any restore): consumed samples are
        # counted from here on top of the restored count.
        self.init_global_step = self.trainer.global_step
        self.data_sampler.init_global_step = self.init_global_step
        return super()._create_dataloader(dataset, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        """``{"consumed_samples": n}``, saved in checkpoints (Lightning's datamodule state)."""
        steps = self.trainer.global_step - self.init_global_step
        return {"consumed_samples": self.data_sampler.compute_consumed_samples(steps)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the sample stream where the checkpoint left it (before dataloaders exist)."""
        from megatron.core.num_microbatches_calculator import update_num_microbatches

        consumed = int(state_dict["consumed_samples"])
        self.data_sampler.init_consumed_samples = consumed
        self.data_sampler.prev_consumed_samples = consumed
        update_num_microbatches(consumed_samples=consumed, consistency_check=False)
        self.data_sampler.if_first_step = 1

    def setup(self, stage: str = "") -> None:
        """Build the three splits with ``seed`` and ``create_attention_mask`` by keyword."""
        for attr, name, num in (
            ("_train_ds", "train", self.num_train_samples),
            ("_validation_ds", "valid", self.num_val_samples),
            ("_test_ds", "test", self.num_test_samples),
        ):
            setattr(self, attr, _MockGPTDataset(
                self.tokenizer, name, num, self.seq_length, seed=self.seed,
                create_attention_mask=self.create_attention_mask,
            ))
