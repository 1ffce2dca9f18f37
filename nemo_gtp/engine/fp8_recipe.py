"""megatron's FP8 / FP4 settings as GTP sees them: the scaling kinds and their validation
(design §1.3 "FP8 shards", "FP8 primary weights").

:class:`ScalingKind` names the scalings an FP8 shard can hold (megatron's ``fp8_recipe``
values); :func:`check_low_precision_recipe` and :func:`check_fp8_training_for_gtp` check a run's
settings against what the shards, the FP8 gather and the hardware support, before any process
group exists (pure, no collective). The quantization itself is :mod:`nemo_gtp.engine.fp8`.
Imports no torch at module level, so the recipe checks read the recipe names from here before
torch loads.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class ScalingKind(enum.Enum):
    """How an FP8 shard is scaled; values are megatron's ``fp8_recipe`` names."""

    TENSORWISE = "tensorwise"
    """Per-tensor current scaling: the scale comes from the weight's own amax at each quantize,
    agreed over the GTP group (one all-reduce MAX of a 4-byte amax)."""
    DELAYED = "delayed"
    """Per-tensor delayed scaling: the quantize uses the scale already in the shard (set by the
    caller from an amax history, :func:`scale_from_amax`) and records the GTP-global amax of the
    new weight in ``amax`` for that history."""
    BLOCKWISE = "blockwise"
    """One scale per ``block`` (1x128 or 128x128); a block never spans two shards, so each rank
    scales its own blocks with no collective."""


FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
"""megatron's ``fp8_recipe`` values."""
FP8_FORMATS = ("e4m3", "hybrid")
"""megatron's ``fp8`` values."""


def device_capability(device: torch.device | str) -> tuple[int, int] | None:
    """CUDA compute capability of ``device``; ``None`` for a CPU (no FP8 tensor cores).

    Example::

        device_capability("cpu")      # None
        device_capability("cuda:0")   # (9, 0) on an H200
    """
    import torch  # here, not at module level: the recipe checks import this module without torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def check_low_precision_recipe(
    fp8: str | None,
    fp8_recipe: str | None = "delayed",
    fp4: str | None = None,
    fp4_recipe: str | None = "nvfp4",
    capability: tuple[int, int] | None = None,
) -> ScalingKind | None:
    """Validate megatron's ``fp8`` / ``fp8_recipe`` / ``fp4`` settings for FP8 GTP shards.

    Pure (no collective): run it before any process group exists. Rejects MXFP8 and NVFP4 below
    compute capability 10.0 (Hopper and older, and a CPU: ``capability=None``), FP8 GEMMs below
    8.9, unknown names, and the recipes the shards cannot hold yet. Returns the shards'
    :class:`ScalingKind`, or ``None`` when FP8 is off. On a CPU the per-tensor and blockwise
    recipes pass: the engine plumbing runs there with torch's FP8 types (TE does not).

    Example::

        check_low_precision_recipe("e4m3", "blockwise", capability=(9, 0))  # BLOCKWISE
        check_low_precision_recipe("e4m3", "mxfp8", capability=(9, 0))      # ValueError
    """
    where = "a CPU" if capability is None else f"compute capability {capability[0]}.{capability[1]}"
    blackwell = capability is not None and capability >= (10, 0)
    if fp4 is not None:
        if fp4_recipe != "nvfp4":
            raise ValueError(f"fp4_recipe must be 'nvfp4', got {fp4_recipe!r}")
        if not blackwell:
            raise ValueError(
                f"fp4={fp4!r} (NVFP4) needs compute capability >= 10.0 (Blackwell); this is "
                f"{where}: unset fp4, or use fp8 with fp8_recipe='blockwise' or 'tensorwise'"
            )
        raise NotImplementedError(
            "NVFP4 GTP shards are not implemented yet (design §1.3); unset fp4"
        )
    if fp8 is None:
        return None
    if fp8 not in FP8_FORMATS:
        raise ValueError(f"fp8 must be one of {FP8_FORMATS} or None, got {fp8!r}")
    if fp8_recipe not in FP8_RECIPES:
        raise ValueError(f"fp8_recipe must be one of {FP8_RECIPES}, got {fp8_recipe!r}")
    if fp8_recipe == "mxfp8":
        if not blackwell:
            raise ValueError(
                f"fp8_recipe='mxfp8' needs compute capability >= 10.0 (Blackwell); this is "
                f"{where}: set fp8_recipe='blockwise' (1x128/128x128 blocks) or 'tensorwise'"
            )
        raise NotImplementedError(
            "MXFP8 GTP shards are not implemented yet (design §1.3); set fp8_recipe="
            "'blockwise' or 'tensorwise'"
        )
    if capability is not None and capability < (8, 9):
        raise ValueError(
            f"fp8={fp8!r} needs FP8 tensor cores (compute capability >= 8.9); this is {where}: "
            f"unset fp8"
        )
    if fp8_recipe == "blockwise" and capability is not None and capability < (9, 0):
        raise ValueError(
            f"fp8_recipe='blockwise' needs compute capability >= 9.0 (Hopper); this is {where}: "
            f"set fp8_recipe='tensorwise'"
        )
    return ScalingKind(fp8_recipe)


GATHER_FP8 = "fp8"
""":func:`check_fp8_training_for_gtp`: the runtime gathers FP8 bytes (design §1.3 "FP8 gather")."""
GATHER_TRAINING_DTYPE = "training_dtype"
""":func:`check_fp8_training_for_gtp`: the runtime gathers the training dtype and TE quantizes the
gathered weight itself (recipes the FP8 gather does not cover yet)."""
FP8_PRIMARY = "fp8_primary"
""":func:`check_fp8_training_for_gtp`: the shards are FP8 primary weights and every gather moves
their own FP8 bytes (design §1.3 "FP8 primary weights"; ``fp8_param`` with per-tensor current
scaling or blockwise scaling)."""
FP8_PRIMARY_RECIPES = ("tensorwise", "blockwise")
"""The ``fp8_recipe`` values FP8 primary GTP shards support (design §1.3 "FP8 primary
weights"): one scale per weight agreed over replicate x GTP, or one per 128x128 tile."""

_KEYS = {
    "fp8": "fp8",
    "fp8_recipe": "fp8_recipe",
    "fp8_param": "fp8_param",
    "fp4": "fp4",
    "fp4_recipe": "fp4_recipe",
}


def check_fp8_training_for_gtp(
    fp8: str | None,
    fp8_recipe: str | None = "delayed",
    fp4: str | None = None,
    fp4_recipe: str | None = "nvfp4",
    *,
    fp8_param: bool = False,
    capability: tuple[int, int] | None = None,
    keys: dict[str, str] | None = None,
) -> str | None:
    """Validate the FP8 / FP4 settings of a GTP run: FP8 compute, and FP8 primary weights.

    Pure, no collective: run it before any process group. ``capability`` is the GPU's compute
    capability, or ``None`` when unknown (a launcher without the GPU: only names are checked,
    the device repeats the check). ``keys`` maps ``fp8``, ``fp8_recipe``, ``fp8_param``,
    ``fp4``, ``fp4_recipe`` to the caller's names of those settings, so the error names the
    key the user writes (e.g. ``fp8.recipe`` in a recipe YAML). Returns ``None`` when neither
    is on, :data:`GATHER_FP8` when the runtime will gather FP8 bytes (per-tensor current
    scaling, ``fp8_recipe="tensorwise"``; ``"blockwise"``, for every weight whose shards are
    whole 128-row tiles, the others in the training dtype), :data:`GATHER_TRAINING_DTYPE` for
    the recipes whose gathered weight TE quantizes itself (``"delayed"``; MXFP8 / NVFP4 on
    Blackwell), :data:`FP8_PRIMARY` for FP8 primary weights (``fp8_param`` with
    ``fp8_recipe="tensorwise"`` or ``"blockwise"``: the shards themselves are FP8, design §1.3
    "FP8 primary weights"). Raises ``ValueError`` for FP8 primary weights under any other
    recipe (delayed, MXFP8) or with FP4, unknown names and recipes the hardware cannot run (MXFP8 /
    NVFP4 below compute capability 10.0, FP8 below 8.9, blockwise below 9.0).

    Example::

        check_fp8_training_for_gtp("hybrid", "tensorwise", capability=(9, 0))   # "fp8"
        check_fp8_training_for_gtp("hybrid", "tensorwise", fp8_param=True)     # "fp8_primary"
        check_fp8_training_for_gtp("e4m3", "delayed", fp8_param=True)          # ValueError
        check_fp8_training_for_gtp("e4m3", "mxfp8", capability=(9, 0))         # ValueError
    """
    key = {**_KEYS, **(keys or {})}
    where = "" if capability is None else f"compute capability {capability[0]}.{capability[1]}"
    known = capability is not None
    if fp8_param and fp4 is not None:
        raise ValueError(
            f"{key['fp8_param']}=True with {key['fp4']}={fp4!r}: FP4 primary weights are not "
            f"supported with GTP (design §1.3): set {key['fp8_param']}=False"
        )
    if fp4 is not None:
        if fp4_recipe != "nvfp4":
            raise ValueError(f"{key['fp4_recipe']} must be 'nvfp4', got {fp4_recipe!r}")
        if known and capability < (10, 0):
            raise ValueError(
                f"{key['fp4']}={fp4!r} (NVFP4) needs compute capability >= 10.0 (Blackwell); "
                f"this is {where}: unset {key['fp4']}, or use {key['fp8']} with "
                f"{key['fp8_recipe']}='tensorwise'"
            )
        return GATHER_TRAINING_DTYPE
    if fp8 is None:
        return None
    if fp8 not in FP8_FORMATS:
        raise ValueError(f"{key['fp8']} must be one of {FP8_FORMATS} or None, got {fp8!r}")
    if fp8_recipe not in FP8_RECIPES:
        raise ValueError(f"{key['fp8_recipe']} must be one of {FP8_RECIPES}, got {fp8_recipe!r}")
    if known and capability < (8, 9):
        raise ValueError(
            f"{key['fp8']}={fp8!r} needs FP8 tensor cores (compute capability >= 8.9); this is "
            f"{where}: unset {key['fp8']}"
        )
    if fp8_recipe == "mxfp8" and known and capability < (10, 0):
        raise ValueError(
            f"{key['fp8_recipe']}='mxfp8' needs compute capability >= 10.0 (Blackwell); this is "
            f"{where}: set {key['fp8_recipe']}='tensorwise' (per-tensor current scaling, "
            f"gathered in FP8 under GTP) or 'blockwise'"
        )
    if fp8_recipe == "blockwise" and known and capability < (9, 0):
        raise ValueError(
            f"{key['fp8_recipe']}='blockwise' needs compute capability >= 9.0 (Hopper); this is "
            f"{where}: set {key['fp8_recipe']}='tensorwise'"
        )
    if fp8_param and fp8_recipe not in FP8_PRIMARY_RECIPES:
        raise ValueError(
            f"{key['fp8_param']}=True (FP8 primary weights, megatron's fp8_param_gather) with "
            f'{key["fp8_recipe"]}={fp8_recipe!r} is not supported with GTP (design §1.3 "FP8 '
            f"primary weights\": GTP's FP8 primary shards use per-tensor current scaling or "
            f"128x128 blockwise scaling): set {key['fp8_recipe']}='tensorwise' or 'blockwise', "
            f"or {key['fp8_param']}=False (the shards then stay in the training dtype)"
        )
    if fp8_param:
        return FP8_PRIMARY
    return GATHER_FP8 if fp8_recipe in ("tensorwise", "blockwise") else GATHER_TRAINING_DTYPE
