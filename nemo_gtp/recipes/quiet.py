"""Drop known-harmless third-party warnings from CLI runs, by message (no heavy imports).

A CPU run of the tiny recipe printed ~60 lines of warnings per rank before the first step
(TransformerEngine / Apex missing, zarr missing, OneLogger telemetry, megatron's experimental-API
notices, NeMo's optional modules); none of them is actionable for a recipe user, and they buried
the lines that are. Each filter matches one exact message, so anything else (errors included)
still shows. Installed by ``python -m nemo_gtp.run`` in every process it starts.

Example::

    quiet_known_warnings()   # before NeMo / megatron are imported
"""

from __future__ import annotations

import logging
import re
import warnings

# Python warnings (``warnings.warn``), by message regex.
WARNING_MESSAGES = (
    r"Transformer Engine and Apex are not installed",  # megatron's torch fallbacks on CPU
    r"Failed to create unified memory mempool",  # megatron inference, not used by training
    r"`zarr` distributed checkpoint backend is deprecated",
    r"The pynvml package is deprecated",  # torch.cuda's import, in every process
)
# Log records, by logger name -> message regexes (a logger's filter sees only its own records).
LOG_MESSAGES: dict[str, tuple[str, ...]] = {
    "megatron.core.utils": (r"has reached end of life",),  # megatron's experimental-API notice
    "megatron.core.dist_checkpointing.serialization": (
        r"DEPRECATED: Passing 'checkpoint_dir' as a Path",
    ),
    "nv_one_logger.api.config": (r"OneLogger: Setting error_handling_strategy",),
    # telemetry switched off for a later fit of the process (configure_nemo_telemetry)
    "nv_one_logger.core.internal.safe_execution": (
        r"Skipping execution of \w+ because OneLogger is not enabled",
    ),
    "nv_one_logger.training_telemetry.api.training_telemetry_provider": (
        r"No exporters were provided",
    ),
    "NeMo": (r"Cannot import zarr",),
    "nemo.collections.llm.gpt.model.megatron.hyena.hyena_mixer": (
        r"transformer_engine not installed",
    ),
    "nemo_logger": (
        r"The (deploy|evaluate) module could not be imported",
        r"Could not copy Trainer's 'max_steps' to LR scheduler",  # recipes use no scheduler
        r"^Ranks? \d+ has ",  # megatron_init's per-group listing
        r"^All .*group ranks",
    ),
}


class _DropMessages(logging.Filter):
    """Drops records whose message matches one of ``patterns``."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True  # never hide an error
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: let logging report it as usual
            return True
        return self.pattern.search(message) is None


def quiet_known_warnings() -> None:
    """Install the filters (idempotent) in this process; call before importing NeMo."""
    for pattern in WARNING_MESSAGES:
        warnings.filterwarnings("ignore", message=f".*{pattern}")
    for name, patterns in LOG_MESSAGES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(patterns))
