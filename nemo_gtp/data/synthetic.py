"""The recipes' synthetic GPT data: NeMo's mock data with its bugs fixed, and a learnable variant.

``SyntheticGPTDataModule``
    ``nemo.collections.llm.gpt.data.mock.MockDataModule.setup`` (NeMo 2.7.3) passes
    ``create_attention_mask`` positionally into ``_MockGPTDataset``'s ``seed`` slot. The datasets
    therefore never emit an ``attention_mask`` (and use seed ``int(flag)``), so without
    TransformerEngine ``gpt_forward_step`` fails with "dataloader did not provide an attention
    mask". The subclass passes both by keyword. ``MockDataModule`` also keeps no data position
    in checkpoints, so a resumed fit restarts at sample 0; the subclass saves and restores the
    consumed-sample count with NeMo's ``PreTrainingDataModule`` methods, so a resumed run sees
    exactly the samples the uninterrupted run would have. ``MockDataModule``'s loaders also
    carry no mode, so NeMo's sampler started validation and test at the *training* position
    (a restored consumed-sample count moved the validation samples: ``trainer.validate`` from a
    checkpoint saw other samples than the same weights validated in the fit); the subclass's
    loaders say ``validation`` / ``test``, as NeMo's pre-training data module's do, so every
    evaluation starts at sample 0 of its split. Everything else is ``MockDataModule``'s.
``ExportableNullTokenizer``
    NeMo's ``NullTokenizer`` (no vocabulary: the data are token ids) recorded in a checkpoint's
    ``context/``, which NeMo's ``llm.export_ckpt`` and ``llm.peft.merge_lora`` rebuild the model
    from (NeMo's own is not serializable, so the dump failed with a warning).
``ArithmeticGPTDataModule``
    A learnable synthetic dataset, so a demo's loss visibly goes down (random tokens cannot).
    Sample ``i`` is an arithmetic token sequence ``(start + stride * t) mod V`` with ``start``
    and ``stride`` drawn from ``numpy.random.default_rng(seed + i)``: a model learns to infer the
    stride from the context and predict the next token.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from nemo.collections.common.tokenizers.null_tokenizer import NullTokenizer
from nemo.collections.llm.gpt.data.mock import MockDataModule, _MockGPTDataset
from nemo.collections.llm.gpt.data.pre_training import PreTrainingDataModule
from nemo.lightning.data import WrappedDataLoader
from nemo.lightning.io import track_io

__all__ = ["ArithmeticGPTDataModule", "ExportableNullTokenizer", "SyntheticGPTDataModule"]


@track_io
class ExportableNullTokenizer(NullTokenizer):
    """NeMo's ``NullTokenizer`` with the ``bos_id`` / ``eos_id`` NeMo's Hugging Face exporters read
    (none; the end-of-document id), recorded in a checkpoint's ``context/`` (``track_io``)."""

    @property
    def bos_id(self) -> int | None:
        return None

    @property
    def eos_id(self) -> int:
        return self.eod


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

    def _create_dataloader(self, dataset: Any, mode: str = "train", **kwargs: Any) -> Any:
        # The step this fit's data stream starts at (after any restore): consumed samples are
        # counted from here on top of the restored count.
        self.init_global_step = self.trainer.global_step
        self.data_sampler.init_global_step = self.init_global_step
        return WrappedDataLoader(  # the mode tells NeMo's sampler where the split starts
            mode=mode,
            dataset=dataset,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.persistent_workers,
            collate_fn=dataset.collate_fn,
            **kwargs,
        )

    def train_dataloader(self) -> Any:
        """The training split, from the consumed-sample position."""
        if not hasattr(self, "_train_ds"):
            self.setup()
        return self._create_dataloader(self._train_ds, mode="train")

    def val_dataloader(self) -> Any:
        """The validation split, from its first sample at every evaluation."""
        if not hasattr(self, "_validation_ds"):
            self.setup()
        return self._create_dataloader(self._validation_ds, mode="validation")

    def test_dataloader(self) -> Any:
        """The test split, from its first sample."""
        if not hasattr(self, "_test_ds"):
            self.setup()
        return self._create_dataloader(self._test_ds, mode="test")

    # The consumed-sample position in checkpoints, exactly as NeMo's pre-training data module
    # keeps it (both read ``data_sampler``, ``trainer`` and ``init_global_step``).
    state_dict = PreTrainingDataModule.state_dict
    load_state_dict = PreTrainingDataModule.load_state_dict

    def setup(self, stage: str = "") -> None:
        """Build the three splits with ``seed`` and ``create_attention_mask`` by keyword."""
        for attr, name, num in (
            ("_train_ds", "train", self.num_train_samples),
            ("_validation_ds", "valid", self.num_val_samples),
            ("_test_ds", "test", self.num_test_samples),
        ):
            setattr(
                self,
                attr,
                _MockGPTDataset(
                    self.tokenizer,
                    name,
                    num,
                    self.seq_length,
                    seed=self.seed,
                    create_attention_mask=self.create_attention_mask,
                ),
            )


class _ArithmeticGPTDataset(_MockGPTDataset):
    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng(seed=self.seed + idx)
        start = int(rng.integers(self.vocab_size))
        stride = int(rng.integers(1, 8))
        steps = np.arange(self.seq_length + 1, dtype=np.int64)
        tokens = torch.from_numpy((start + stride * steps) % self.vocab_size)
        batch = {
            "tokens": tokens[:-1],
            "labels": tokens[1:],
            "loss_mask": self.loss_mask,
            "position_ids": self.position_ids,
        }
        if self.create_attention_mask:
            batch["attention_mask"] = self.attention_mask
        return batch


class ArithmeticGPTDataModule(SyntheticGPTDataModule):
    """:class:`SyntheticGPTDataModule` whose samples are learnable arithmetic sequences.

    Example::

        data = ArithmeticGPTDataModule(seq_length=32, tokenizer=NullTokenizer(255),
                                       micro_batch_size=4, global_batch_size=16)
    """

    def setup(self, stage: str = "") -> None:
        """Build train/validation/test splits of arithmetic sequences."""
        kwargs: dict[str, Any] = dict(
            seed=self.seed, create_attention_mask=self.create_attention_mask
        )
        self._train_ds = _ArithmeticGPTDataset(
            self.tokenizer, "train", self.num_train_samples, self.seq_length, **kwargs
        )
        self._validation_ds = _ArithmeticGPTDataset(
            self.tokenizer, "valid", self.num_val_samples, self.seq_length, **kwargs
        )
        self._test_ds = _ArithmeticGPTDataset(
            self.tokenizer, "test", self.num_test_samples, self.seq_length, **kwargs
        )
