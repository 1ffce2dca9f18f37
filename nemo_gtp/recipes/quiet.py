"""Drop known-harmless third-party warnings from CLI runs, by message (no heavy imports).

A CPU run of the tiny recipe printed ~60 lines of warnings per rank before the first step
(TransformerEngine / Apex missing, zarr missing, OneLogger telemetry, megatron's experimental-API
notices, NeMo's optional modules); none of them is actionable for a recipe user, and they buried
the lines that are. Each filter matches one exact message, so anything else (errors included)
still shows. Installed by ``python -m nemo_gtp.run`` in every process it starts.

:func:`quiet_console` goes further for a fit that logs to a directory: NeMo's and Lightning's
informational output (the DDP and optimizer config dumps, every gradient bucket's parameter
list, the model summary, accelerator availability, the logger's directory notices) goes to the
log files in that directory instead of the console, which keeps what a user reads: the run's
layout line, one line per logged step, warnings and errors. ``--verbose``
(:data:`VERBOSE_ENV` ``=1``) leaves the console as NeMo and Lightning set it.

Example::

    quiet_known_warnings()   # before NeMo / megatron are imported
    quiet_console("runs/tiny_cpu")   # after: in each rank, before the trainer is built
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from pathlib import Path

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


# Errors a library logs (with the whole recipe) and then raises, which the CLI reports again as
# its one ``error:`` line: NeMo-Run's override parser (nemo_cli.apply_overrides).
RERAISED_ERRORS: dict[str, tuple[str, ...]] = {
    "nemo_run.cli.cli_parser": (r"^Error processing argument", r"^Unexpected error: "),
}


class _DropMessages(logging.Filter):
    """Drops records whose message matches one of ``patterns`` (``errors``: errors too)."""

    def __init__(self, patterns: tuple[str, ...], errors: bool = False) -> None:
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns))
        self.errors = errors

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and not self.errors:
            return True  # never hide an error
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: let logging report it as usual
            return True
        return self.pattern.search(message) is None


def quiet_known_warnings() -> None:
    """Install the filters (idempotent) in this process; call before importing NeMo. Under
    :data:`VERBOSE_ENV` ``=1`` (``--verbose``) nothing is filtered."""
    if os.environ.get(VERBOSE_ENV) == "1":
        return
    for pattern in WARNING_MESSAGES:
        warnings.filterwarnings("ignore", message=f".*{pattern}")
    for name, patterns in LOG_MESSAGES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(patterns))
    for name, patterns in RERAISED_ERRORS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(patterns, errors=True))


VERBOSE_ENV = "NEMO_GTP_VERBOSE"
"""``1``: :func:`quiet_console` changes nothing (``python -m nemo_gtp.run --verbose`` sets it for
every process it starts)."""
# The loggers whose console handlers NeMo and Lightning install at import (they do not
# propagate): NeMo's own (megatron's messages reach the console through it), Lightning's, and
# the standalone pytorch_lightning's (some NeMo module imports it, and its rank_zero_info then
# logs Lightning's "GPU available" and distributed-backend lines).
CONSOLE_LOGGERS = (
    "nemo_logger",
    "lightning.pytorch",
    "lightning.fabric",
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
)
# Warnings that say nothing a recipe user can act on: to the log files only.
CONSOLE_QUIET_WARNINGS = (
    r'"update_logger_directory" is True',  # NeMoLogger points TensorBoard into the log dir
    r"is logging to .*, but it already exists",  # a rerun into the same --log-dir
    r"There were no checkpoints found in checkpoint_dir",  # resume_if_exists on a first run
)


class _ConsoleFilter(logging.Filter):
    """On a console handler: warnings and errors only, less :data:`CONSOLE_QUIET_WARNINGS`."""

    pattern = re.compile("|".join(f"(?:{p})" for p in CONSOLE_QUIET_WARNINGS))

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        if record.levelno < logging.WARNING:
            return False
        try:
            return self.pattern.search(record.getMessage()) is None
        except Exception:  # a malformed record: let logging report it as usual
            return True


def quiet_console(log_dir: str | Path | None) -> Path | None:
    """Send NeMo's and Lightning's informational output to files in ``log_dir`` instead of the
    console (NeMo's records already reach its ``nemo_log_globalrank-*.txt``; Lightning's go to
    ``lightning_log_globalrank-<RANK>.txt``, returned). Call once NeMo and Lightning are
    imported; idempotent. Nothing changes without a ``log_dir`` or under :data:`VERBOSE_ENV`.

    Example::

        quiet_console("runs/tiny_cpu/gtp")   # loader.build_fit does it for every recipe fit
    """
    if log_dir is None or os.environ.get(VERBOSE_ENV) == "1":
        return None
    path = Path(log_dir, f"lightning_log_globalrank-{os.environ.get('RANK', '0')}.txt")
    path.parent.mkdir(parents=True, exist_ok=True)
    for name in CONSOLE_LOGGERS:
        logger = logging.getLogger(name)
        for handler in logger.handlers:
            console = isinstance(handler, logging.StreamHandler) and not isinstance(
                handler, logging.FileHandler
            )
            if console and not any(isinstance(f, _ConsoleFilter) for f in handler.filters):
                handler.addFilter(_ConsoleFilter())
        if name in ("nemo_logger", "lightning"):  # NeMo writes its own; "lightning" propagates
            continue
        for handler in [h for h in logger.handlers if isinstance(h, _RunLogFile)]:
            logger.removeHandler(handler)  # an earlier fit's (a baseline after its GTP run)
            handler.close()
        logger.addHandler(_RunLogFile(path))
    return path


class _RunLogFile(logging.FileHandler):
    """Lightning's records of one fit, in its log directory (:func:`quiet_console`)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.setFormatter(logging.Formatter("[%(asctime)s %(name)s] %(message)s"))
