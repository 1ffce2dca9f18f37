"""NeMo-Run executors for GTP recipes: one node (local torchrun) and many nodes (Slurm).

Both launch with torchrun, one process per GPU, the way NeMo's own recipes are launched; GTP
needs nothing else from the launcher (the strategy builds its process groups from torchrun's
``RANK`` / ``WORLD_SIZE``). Example::

    recipe = with_gtp(llm.llama3_70b.pretrain_recipe(num_nodes=4, num_gpus_per_node=8), 16)
    run.run(recipe, executor=slurm_executor(account="acct", partition="batch", nodes=4,
                                             devices=8, container_image="nvcr.io/nvidia/nemo:25.09",
                                             job_dir="/lustre/me/nemo_run"))
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

# What NeMo's launch examples set for Megatron training on NCCL.
DEFAULT_ENV = {
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
    "NCCL_NVLS_ENABLE": "0",
}


def local_executor(devices: int, nodes: int = 1, env: dict[str, str] | None = None) -> Any:
    """``run.LocalExecutor``: torchrun with ``devices`` processes on this machine.

    With ``nodes > 1`` run the same launch on every node with ``MASTER_ADDR``, ``MASTER_PORT``
    and ``NODE_RANK`` set (NeMo-Run then passes them to torchrun's rendezvous). torchrun is
    taken from this Python's environment (its ``bin`` directory is put first on ``PATH`` when
    ``torchrun`` is not found there). Example::

        run.run(recipe, executor=local_executor(devices=8))
    """
    import nemo_run as run

    if shutil.which("torchrun") is None:  # a venv used without activating it
        bin_dir = os.path.dirname(sys.executable)
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    return run.LocalExecutor(
        ntasks_per_node=devices,
        nodes=nodes,
        launcher="torchrun",
        env_vars={**DEFAULT_ENV, **(env or {})},
    )


def slurm_executor(
    *,
    account: str,
    nodes: int,
    devices: int,
    partition: str | None = None,
    time: str = "04:00:00",
    container_image: str | None = None,
    container_mounts: list[str] | None = None,
    job_dir: str = "",
    env: dict[str, str] | None = None,
    packager: Any = None,
    **slurm_options: Any,
) -> Any:
    """``run.SlurmExecutor``: ``nodes`` x ``devices`` GPUs, torchrun on every node.

    The sbatch script runs one ``srun ... torchrun --nnodes {nodes} --nproc-per-node {devices}
    --node-rank $SLURM_NODEID --rdzv-endpoint $head_node_ip:29500 -m
    nemo_run.core.runners.fdl_runner ...`` per node. ``job_dir``: where NeMo-Run puts the
    job's files, on a filesystem the nodes share (submitted from the cluster's login node:
    ``LocalTunnel``). ``packager``: how the code reaches the nodes; default ``run.Packager()``
    (nemo_gtp installed in the container or on the shared ``PYTHONPATH``); ``run.
    GitArchivePackager()`` ships this repository's committed tree instead. ``slurm_options``
    go to ``run.SlurmExecutor`` (``qos``, ``exclusive``, ``gres``, ...).

    Example::

        executor = slurm_executor(account="acct", partition="batch", nodes=2, devices=8,
                                  job_dir="/lustre/me/nemo_run")
        run.run(recipe, executor=executor)            # sbatch
        run.run(recipe, executor=executor, dryrun=True)  # print the sbatch script only
    """
    import nemo_run as run

    return run.SlurmExecutor(
        account=account,
        partition=partition,
        nodes=nodes,
        ntasks_per_node=devices,
        gpus_per_node=devices,
        time=time,
        container_image=container_image,
        container_mounts=list(container_mounts or []),
        tunnel=run.LocalTunnel(job_dir=job_dir),
        packager=packager if packager is not None else run.Packager(),
        launcher="torchrun",
        env_vars={**DEFAULT_ENV, **(env or {})},
        **slurm_options,
    )
