"""Tooling around GTP: what the tests, the benchmarks and the CPU recipes share.

Nothing here is needed to train with GTP on GPUs; the product is ``nemo_gtp.engine``,
``nemo_gtp.integrations``, ``nemo_gtp.strategy``, ``nemo_gtp.checkpoint`` and
``nemo_gtp.recipes``. Importing this package imports nothing; each module is imported on its own:

``cpu_compat``
    Opt-in patches that let megatron-core and NeMo run on a CPU-only torch with gloo (the test
    suite and the CPU recipes, ``cpu_compat: true`` in ``configs/tiny_cpu.yaml``).
``spawn``
    ``run_distributed``: a function on N spawned gloo ranks, failures re-raised;
    ``run_cases``: many named cases in one spawn, each one's outcome per rank;
    ``start_distributed``: a job joined later.
``gpt_harness``
    megatron-core's GPTModel trained with and without GTP at any layout (parity tests,
    ``bench/parity_nccl.py``, ``bench/ckpt_nccl.py``, ``bench/te_gpt_nccl.py``).
``ckpt_harness``
    Build, train and fully gather (weights and optimizer state) a GPT at any layout
    (checkpoint tests); ``moe_full_state``: the same for MoE models, experts by global index.
``te_grouped``
    TE's weight-protocol dispatchers and CPU stand-ins of megatron's ``TEGroupedLinear``
    wrappers (``TEGroupedMLP`` on CPU, checkpoint entries included).
``memory``
    ``allocation_peak``: peak and kept bytes while a function runs (CUDA allocator or CPU
    profiler).
``strategy_harness``
    Real ``nl.Trainer`` fits with ``GTPMegatronStrategy`` or plain ``MegatronStrategy`` in
    spawned CPU/gloo processes (strategy tests); ``shared_launch``: the fits of several test
    modules in one spawn.
``nemo_cpu``
    ``on_cpu(recipe)``: a NeMo 2 recipe (``llm.*.pretrain_recipe``) adapted to CPU processes
    with gloo (``python -m nemo_gtp.run --recipe ... --cpu``).
``te_grouped`` / ``te_fp8_stand_in``
    TransformerEngine's weight-protocol callers, a ``GroupedLinear`` stand-in, and an FP8
    ``LayerNormLinear`` stand-in with TE's quantizers (CPU tests of the TE paths).
``corpus``
    A small offline corpus: the READMEs of installed packages, as JSONL.
``slurm_nodes``
    The per-node torchrun command of a NeMo-Run Slurm script, run here as N "nodes".
"""
