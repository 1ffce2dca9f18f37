"""Test harnesses and stand-ins shared by the tests and the GPU checks under ``bench/``.

Not part of the product (``nemo_gtp``), which never imports them. Importing this package imports
nothing; each module is imported on its own:

``spawn``
    ``run_distributed``: a function on N gloo ranks, failures re-raised; ``run_cases``: many named
    cases in one spawn; ``start_distributed``: a job joined later. Ranks fork from one preloaded
    fork server per test session.
``gpt``
    megatron-core's GPTModel trained with and without GTP at any layout (``Run``): parity tests and
    ``bench/``'s NCCL checks.
``checkpoint``
    Build, train and fully gather (weights and optimizer state) a GPT or MoE model at any layout.
``strategy`` / ``objects``
    Real ``nl.Trainer`` fits with ``GTPMegatronStrategy`` or plain ``MegatronStrategy`` in spawned
    CPU/gloo processes, and the callbacks they record with.
``te_grouped`` / ``te_fp8_stand_in``
    TransformerEngine's weight-protocol callers, a ``GroupedLinear`` stand-in, and an FP8
    ``LayerNormLinear`` stand-in with TE's quantizers (CPU tests of the TE paths).
``graph_stand_in`` / ``cp_attention``
    megatron's per-layer CUDA-graph flow with an eager stand-in; context-parallel attention on CPU.
``memory``
    ``allocation_peak``: peak and kept bytes while a function runs (CUDA allocator or CPU profiler).
``corpus`` / ``slurm_nodes`` / ``torchrun_fit``
    A small offline corpus; a Slurm script's per-node torchrun run as local "nodes"; a fit under
    torchrun.
"""
