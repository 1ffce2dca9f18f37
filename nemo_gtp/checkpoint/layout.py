"""The layout a checkpoint was saved with, stored in its common state (design §1.8, §3.3).

The tensors of a nemo_gtp checkpoint do not depend on the layout (see
:mod:`nemo_gtp.checkpoint.pieces`), so this record is informational: it tells a reader (the
``show`` CLI, a person debugging a resume) which grid and padding produced the checkpoint.
It lives in ``common.pt`` under :data:`LAYOUT_KEY`, which rank 0 writes and every load returns.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

LAYOUT_KEY = "nemo_gtp_layout"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class CheckpointLayout:
    """Parallel sizes and GTP padding of the run that saved a checkpoint.

    Example::

        CheckpointLayout(tensor_model_parallel_size=2, gtp_size=2, data_parallel_size=1,
                         pipeline_model_parallel_size=1, context_parallel_size=1, world_size=4,
                         pad_for_alignment=16,
                         padded_rows={"decoder.layers.mlp.linear_fc1.weight": (40, 64)})
    """

    tensor_model_parallel_size: int
    gtp_size: int
    data_parallel_size: int
    """Replicate size: DP without GTP."""
    pipeline_model_parallel_size: int
    context_parallel_size: int
    world_size: int
    pad_for_alignment: int | None
    """GTP alignment padding (``GTPConfig.pad_for_alignment``); ``None`` without GTP."""
    padded_rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Checkpoint key of each GTP weight -> (TP-local rows, padded TP-local rows)."""
    format_version: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python form stored in the checkpoint's common state."""
        out = asdict(self)
        out["padded_rows"] = {k: list(v) for k, v in sorted(self.padded_rows.items())}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckpointLayout:
        """Inverse of :meth:`to_dict`; unknown keys (a newer writer) are ignored."""
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        known["padded_rows"] = {k: tuple(v) for k, v in known.get("padded_rows", {}).items()}
        return cls(**known)

    def describe(self) -> str:
        """One line, e.g. ``TP2 x GTP2 x DP1 (PP1, CP1; world 4), pad_for_alignment=16``."""
        return (
            f"TP{self.tensor_model_parallel_size} x GTP{self.gtp_size} x "
            f"DP{self.data_parallel_size} (PP{self.pipeline_model_parallel_size}, "
            f"CP{self.context_parallel_size}; world {self.world_size}), "
            f"pad_for_alignment={self.pad_for_alignment}"
        )


def read_layout(checkpoint_dir: str | Path) -> CheckpointLayout | None:
    """The layout stored in a checkpoint, or ``None`` for a checkpoint nemo_gtp did not write."""
    from megatron.core.dist_checkpointing import load_common_state_dict

    common = load_common_state_dict(str(checkpoint_dir))
    data = common.get(LAYOUT_KEY) if isinstance(common, dict) else None
    return None if data is None else CheckpointLayout.from_dict(data)
