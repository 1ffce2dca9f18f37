"""A learnable synthetic GPT dataset, so a demo's loss visibly goes down (random tokens cannot).

Sample ``i`` is an arithmetic token sequence ``(start + stride * t) mod V`` with ``start`` and
``stride`` drawn from ``numpy.random.default_rng(seed + i)``: a model learns to infer the stride
from the context and predict the next token.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from nemo.collections.llm.gpt.data.mock import _MockGPTDataset

from nemo_gtp.strategy.nemo_compat import SyntheticGPTDataModule


class _ArithmeticGPTDataset(_MockGPTDataset):
    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng(seed=self.seed + idx)
        start = int(rng.integers(self.vocab_size))
        stride = int(rng.integers(1, 8))
        steps = np.arange(self.seq_length + 1, dtype=np.int64)
        tokens = torch.from_numpy((start + stride * steps) % self.vocab_size)
        batch = {"tokens": tokens[:-1], "labels": tokens[1:], "loss_mask": self.loss_mask,
                 "position_ids": self.position_ids}
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
        kwargs: dict[str, Any] = dict(seed=self.seed,
                                      create_attention_mask=self.create_attention_mask)
        self._train_ds = _ArithmeticGPTDataset(
            self.tokenizer, "train", self.num_train_samples, self.seq_length, **kwargs)
        self._validation_ds = _ArithmeticGPTDataset(
            self.tokenizer, "valid", self.num_val_samples, self.seq_length, **kwargs)
        self._test_ds = _ArithmeticGPTDataset(
            self.tokenizer, "test", self.num_test_samples, self.seq_length, **kwargs)
