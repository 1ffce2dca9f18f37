"""Several NeMo recipes trained one after the other in one launch (the worker side).

``python -m nemo_gtp.run --recipe ... --compare-baseline`` trains the GTP recipe and its baseline
in the same processes: starting ranks and importing NeMo costs far more than a short fit. The
launched task is ``run.Partial(run_recipes, recipes=[...])`` whose recipes are serialized
``run.Partial``s (nemo_run's ``ZlibJSONSerializer``), built here one at a time: the next one is
built only after the previous fit has been torn down (:func:`~nemo_gtp.recipes.launch.
teardown_fit`), and ``cpu_compat`` is switched on before anything is built.

Every fit after the first meets through a ``FileStore`` under ``store_dir`` (a directory every
rank sees): a second ``init_process_group`` on torchrun's agent store fails in the same
processes (the README's "Two fits in one process").

Example (what the CLI launches)::

    task = run.Partial(run_recipes, recipes=[serialize(gtp), serialize(baseline)],
                       store_dir="/shared/stores/abc")
    run.run(task, executor=run.LocalExecutor(ntasks_per_node=4, launcher="torchrun"))
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def serialize(recipe: Any) -> str:
    """A recipe (any nemo_run ``Buildable``) as the string :func:`run_recipes` takes.

    Example::

        run.Partial(run_recipes, recipes=[serialize(recipe)], cpu_compat=True)
    """
    from nemo_run.core.serialization.zlib_json import ZlibJSONSerializer

    return ZlibJSONSerializer().serialize(recipe)


def nemo_log_dir(log: Any) -> Path:
    """Where a recipe's ``NeMoLogger`` (built, or its ``run.Config``) writes: its
    ``explicit_log_dir``, else ``log_dir`` (NeMo's default ``nemo_experiments``) / ``name``.

    Example: ``nemo_log_dir(recipe.log)``.
    """
    explicit = getattr(log, "explicit_log_dir", None)
    if explicit:
        return Path(explicit)
    base = getattr(log, "log_dir", None) or "nemo_experiments"
    return Path(base, getattr(log, "name", None) or "default")


def run_recipes(recipes: list[str], store_dir: str = "", cpu_compat: bool = False) -> None:
    """Build and run each serialized recipe in order, tearing down between them (every rank).

    ``cpu_compat``: enable :mod:`nemo_gtp.cpu.compat` first (recipes adapted with
    :func:`nemo_gtp.recipes.cpu.on_cpu`). ``store_dir`` is required with more than one
    recipe (see the module docstring). Example: the module docstring.
    """
    import fiddle as fdl
    import torch.distributed as dist
    from nemo_run.core.serialization.zlib_json import ZlibJSONSerializer

    from nemo_gtp.recipes.launch import freeze_imports, teardown_fit
    from nemo_gtp.recipes.quiet import quiet_console, quiet_known_warnings

    quiet_known_warnings()
    if len(recipes) > 1 and not store_dir:
        raise ValueError("run_recipes: give store_dir (a directory every rank sees) for 2+ recipes")
    if cpu_compat:
        import torch

        from nemo_gtp.cpu.compat import enable_cpu_compat

        torch.set_num_threads(1)
        enable_cpu_compat(nemo=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    freeze_imports()
    for index, text in enumerate(recipes):
        recipe = ZlibJSONSerializer().deserialize(text)
        # NeMo's and Lightning's notices to the run's log files (unless --verbose), before the
        # build: Lightning's Trainer announces its devices as it is made
        quiet_console(nemo_log_dir(getattr(recipe, "log", None)))
        task = fdl.build(recipe)
        if index > 0:
            Path(store_dir).mkdir(parents=True, exist_ok=True)
            store = dist.FileStore(str(Path(store_dir, f"store{index}")), world)
            task.keywords["trainer"].strategy.store = store
        try:
            task()
        finally:
            del task
            teardown_fit()
