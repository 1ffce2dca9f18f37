"""The README's "Use it from NeMo" pattern under an external launcher (torchrun, Slurm), on CPU.

An external launcher sets ``RANK`` before NeMo is imported, which switches NeMo's one-logger
telemetry on for rank 0; a plain ``trainer.fit`` then needs ``GTPMegatronStrategy`` to give it
its training config (``configure_nemo_telemetry``) before the first ``ModelCheckpoint`` save.
Each rank runs three fits of ``tests.harness.strategy``'s tiny GPT at TP1·GTP2·DP(world/2): 2 steps
without checkpoints (rendezvous through torchrun's ``env://``), then 4 steps with a
``ModelCheckpoint`` every 2 steps (the telemetry config is the first fit's, which saved
nothing), then, after ``teardown_fit``, a resume from the last checkpoint to step 6. The later
fits meet through a ``FileStore`` each: a second ``init_process_group`` in one process on
torchrun's agent store fails (gloo's full-mesh connect finds the first group's stale
addresses), so further fits in one process under torchrun need a store of their own. Rank 0
writes ``<out_dir>/result.json``.

Example::

    torchrun --nproc-per-node 4 --master-port 29511 -m tests.harness.torchrun_fit /tmp/out
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(out_dir: str) -> None:
    """Train, checkpoint, resume (see the module docstring); rank 0 writes ``result.json``."""
    import torch

    from nemo_gtp.cpu.compat import enable_cpu_compat
    from nemo_gtp.recipes.launch import freeze_imports, teardown_fit
    from tests.harness.strategy import Fit, _fit

    torch.set_num_threads(1)
    enable_cpu_compat()
    freeze_imports()
    world, out = int(os.environ["WORLD_SIZE"]), Path(out_dir)
    # a fit without checkpoints first: NeMo's telemetry keeps its config, and the checkpointing
    # fit after it used to fail at its first save (configure_nemo_telemetry)
    results = [_fit(Fit("plain", gtp=2, steps=2), world, None)]
    teardown_fit()
    first = Fit("first", gtp=2, steps=4, checkpoint_every=2, checkpoint_dir=str(out / "ckpts"))
    results.append(_fit(first, world, str(out / "first_store")))
    teardown_fit()
    saved = sorted(
        (p for p in (out / "ckpts").iterdir() if p.name.startswith("step=")),
        key=lambda p: int(p.name.split("=")[1].split("-")[0]),
    )
    resume = Fit("resume", gtp=2, steps=6, resume_from=str(saved[-1]))
    results.append(_fit(resume, world, str(out / "resume_store")))
    teardown_fit()
    if int(os.environ["RANK"]) == 0:
        summary = {r["name"]: {k: r[k] for k in ("losses", "global_step")} for r in results}
        summary["checkpoints"] = [p.name for p in saved]
        (out / "result.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main(sys.argv[1])
