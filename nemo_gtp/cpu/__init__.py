"""The CPU backend: NeMo and megatron-core training on CPU processes with gloo.

GPUs need none of this. It is what the main job (``python -m nemo_gtp.run configs/tiny_cpu.yaml``),
the CPU recipes (``cpu_compat: true``, ``--cpu``) and the test suite run on. Importing the package
imports nothing; each module is imported on its own:

``compat``
    ``enable_cpu_compat()``: opt-in patches that let megatron-core 0.15 and NeMo 2.7.3 run on a
    CPU-only torch with gloo (design §"Running on CPU"); the patches live in ``megatron_patches``
    and ``nemo_patches``, their machinery in ``patching``, the CPU RNG tracker in ``rng``.
``gloo_device``
    Every gloo group of a process on one TCP device (megatron builds dozens of groups per layout).
``layer_spec``
    ``cpu_layer_spec``: a NeMo recipe's layers from megatron's local modules (multi-latent
    attention, dense/MoE layer patterns, zero-centered norms included: ``CPUNorm``,
    ``MLADotProductAttention``).
``staged_gloo``
    The ``staged_gloo`` torch.distributed backend: several ranks sharing one GPU, collectives
    staged through host memory over gloo (``--shared-device`` numerics checks).

A NeMo recipe (``llm.*.pretrain_recipe``) is adapted to CPU processes by
:func:`nemo_gtp.recipes.cpu.on_cpu`, with the recipes.
"""
