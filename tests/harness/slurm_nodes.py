"""Run the per-node command of a NeMo-Run Slurm job on this host, as N "nodes" (CPU tests).

NeMo-Run's ``SlurmExecutor`` writes an sbatch script whose job step is ``srun ... torchrun
--rdzv-endpoint $head_node_ip:29500 --nnodes N --nproc-per-node P --node-rank $SLURM_NODEID -m
nemo_run.core.runners.fdl_runner ... <serialized task>``. :func:`node_commands` takes that
torchrun command out of the script and fills in what Slurm would (the head node's address, each
node's ``SLURM_NODEID``); :func:`run_nodes` starts one torchrun agent per "node" here and
waits. What runs is exactly the script's command and the serialized task it names: only
``srun`` is emulated. Example::

    commands = node_commands(Path(sbatch).read_text(), nodes=2, port=29611)
    run_nodes(commands, env={"PYTHONPATH": repo}, timeout=300)
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path


def sbatch_exports(script: str) -> dict[str, str]:
    """The ``export NAME=value`` lines of an sbatch script.

    Example::

        sbatch_exports("export LOGLEVEL=INFO\n")  # {"LOGLEVEL": "INFO"}
    """
    return dict(re.findall(r"^export (\w+)=(\S*)$", script, flags=re.M))


def node_commands(script: str, nodes: int, port: int, host: str = "127.0.0.1") -> list[list[str]]:
    """The script's torchrun command once per node, as Slurm would expand it there.

    Example: the module docstring.
    """
    match = re.search(r"\btorchrun (.*)$", script, flags=re.M)
    if match is None:
        raise ValueError("no torchrun command in the sbatch script")
    line = match.group(1).replace("$head_node_ip:29500", f"{host}:{port}")
    if "$head_node_ip" in line:
        raise ValueError(f"unexpected rendezvous endpoint in: {line}")
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [
        [torchrun, *shlex.split(line.replace("$SLURM_NODEID", str(node)))] for node in range(nodes)
    ]


def run_nodes(
    commands: list[list[str]], env: dict[str, str], cwd: str | None = None, timeout: float = 600
) -> list[str]:
    """Start every node's agent, wait for all; returns each one's output. ``RuntimeError``
    with the failing node's output tail when one exits non-zero or the timeout passes.
    Example: the module docstring."""
    procs = [
        subprocess.Popen(
            command,
            env={**os.environ, **env},
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for command in commands
    ]
    deadline = time.monotonic() + timeout
    outputs = []
    for node, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:  # SIGTERM: each torchrun agent stops its workers
                other.terminate()
            for other in procs:
                other.communicate(timeout=60)
            raise RuntimeError(f"node {node} did not finish in {timeout} s") from None
        outputs.append(out)
    for node, proc in enumerate(procs):
        if proc.returncode != 0:
            raise RuntimeError(
                f"node {node} exited with {proc.returncode}:\n{outputs[node][-6000:]}"
            )
    return outputs
