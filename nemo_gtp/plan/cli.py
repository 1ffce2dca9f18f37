"""``python -m nemo_gtp.plan``: a model from a recipe (YAML or NeMo's own) or sizes, its plans,
the recommended layout and why."""

from __future__ import annotations

import argparse
import sys

from nemo_gtp.plan.layouts import plan_layouts, recommend, table, why
from nemo_gtp.plan.shapes import GIB, ModelShape
from nemo_gtp.recipes.model_size import yaml_model_sizes

__all__ = ["main", "model_from_nemo_recipe", "model_from_recipe"]

DESCRIPTION = "Which layout fits: per-GPU memory of a GPT under TP × GTP × DP, before launching."


def model_from_recipe(path: str, overrides: list[str] = ()) -> tuple[ModelShape, int]:
    """The :class:`ModelShape` and sequence length of a recipe YAML's ``model``/``data``
    (after OmegaConf ``key=value`` ``overrides``, as ``python -m nemo_gtp.run`` takes them)."""
    from nemo_gtp.recipes.config import load_recipe

    cfg = load_recipe(path, list(overrides))  # a missing or malformed file: RecipeError
    sizes = yaml_model_sizes(cfg)
    return ModelShape(**sizes), sizes["seq"]


def model_from_nemo_recipe(name: str, overrides: list[str] = ()) -> tuple[ModelShape, int]:
    """The :class:`ModelShape` and sequence length of NeMo's own recipe
    ``nemo.collections.llm.recipes.<name>.pretrain_recipe()`` after NeMo-Run ``key=value``
    ``overrides``, read from its model config without building anything
    (:func:`nemo_gtp.recipes.model_shape.nemo_recipe_model_sizes`). ``ValueError``
    (``RecipeError``) naming a bad recipe or override.

    Example::

        shape, seq = model_from_nemo_recipe("llama3_70b", ["model.config.num_layers=40"])
    """
    from nemo_gtp.recipes.quiet import quiet_known_warnings

    quiet_known_warnings()  # NeMo's import-time notices (the planner prints a table)
    from nemo_gtp.recipes.model_shape import nemo_recipe_model_sizes

    sizes = nemo_recipe_model_sizes(name, list(overrides))
    return ModelShape(**sizes), sizes["seq"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m nemo_gtp.plan``."""
    parser = argparse.ArgumentParser(
        prog="python -m nemo_gtp.plan",
        description=DESCRIPTION,
    )
    parser.add_argument(
        "items",
        nargs="*",
        metavar="RECIPE.yaml | key=value",
        help="a recipe YAML (model and data sections) and its overrides, or with --recipe "
        "NeMo-Run overrides of NeMo's recipe (model.config.num_layers=40)",
    )
    parser.add_argument(
        "--recipe",
        metavar="NAME",
        help="NeMo's own recipe: nemo.collections.llm.recipes.NAME.pretrain_recipe() (e.g. "
        "llama3_70b); its model config is read, nothing is built",
    )
    for name in ("layers", "hidden", "ffn", "heads", "vocab", "seq"):
        parser.add_argument(f"--{name}", type=int, help=f"model {name} (overrides the recipe)")
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--gpu-memory-gib", type=float, required=True)
    parser.add_argument(
        "--tokens-per-gpu",
        type=int,
        help="micro-batch x sequence length / CP (default: one sequence of the recipe's "
        "length per micro batch)",
    )
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument(
        "--context-parallel",
        type=int,
        default=1,
        metavar="CP",
        help="context_parallel_size (fixed; --tokens-per-gpu is then micro-batch x seq / CP)",
    )
    parser.add_argument(
        "--pipeline-parallel",
        type=int,
        default=1,
        metavar="PP",
        help="pipeline_model_parallel_size (fixed; 1F1B with >= PP microbatches per step)",
    )
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument(
        "--grad-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="main_grad dtype (grad_reduce_in_fp32)",
    )
    parser.add_argument(
        "--overhead-gib",
        type=float,
        default=3.0,
        help="CUDA context, NCCL buffers, allocator slack per GPU",
    )
    parser.add_argument(
        "--flash-attention",
        action="store_true",
        help="fused attention (TE spec): no s x s score activations",
    )
    parser.add_argument("--dropout", action="store_true", help="dropout masks are kept")
    parser.add_argument(
        "--optimizer",
        choices=("adam", "muon"),
        default="adam",
        help="adam: megatron's distributed Adam; muon: Muon for the hidden matrices (design "
        "§1.6), megatron's non-distributed optimizer",
    )
    parser.add_argument(
        "--coalesce-mb",
        type=float,
        default=192.0,
        help="GTPConfig.coalesce_mb: bytes of weights gathered as one unit",
    )
    args = parser.parse_args(argv)
    try:
        fields = {}
        overrides = [item for item in args.items if "=" in item]
        paths = [item for item in args.items if "=" not in item]
        if len(paths) > 1 or (paths and args.recipe):
            raise ValueError(f"give one recipe, got {' and '.join(paths + [args.recipe or ''])}")
        if args.recipe or paths:
            shape, _ = (
                model_from_nemo_recipe(args.recipe, overrides)
                if args.recipe
                else model_from_recipe(paths[0], overrides)
            )
            fields = {k: getattr(shape, k) for k in ModelShape.__dataclass_fields__}
        elif overrides:
            raise ValueError(f"overrides {' '.join(overrides)} need a recipe")
        for name in ("layers", "hidden", "ffn", "heads", "vocab", "seq"):
            if getattr(args, name) is not None:
                fields[name] = getattr(args, name)
        missing = [n for n in ("layers", "hidden", "heads", "vocab", "seq") if n not in fields]
        if missing:
            raise ValueError(f"give a recipe or --{' --'.join(missing)}")
        fields.setdefault("ffn", 4 * fields["hidden"])
        model = ModelShape(**fields)
        if args.tokens_per_gpu is None:
            args.tokens_per_gpu = max(model.seq // max(args.context_parallel, 1), 1)
        plans = plan_layouts(
            model,
            gpus=args.gpus,
            gpu_memory_gib=args.gpu_memory_gib,
            tokens_per_gpu=args.tokens_per_gpu,
            gpus_per_node=args.gpus_per_node,
            cp=args.context_parallel,
            pp=args.pipeline_parallel,
            param_bytes=2 if args.precision == "bf16" else 4,
            grad_bytes=4 if args.grad_dtype == "fp32" else 2,
            overhead_gib=args.overhead_gib,
            flash_attention=args.flash_attention,
            dropout=args.dropout,
            coalesce_mb=args.coalesce_mb,
            optimizer=args.optimizer,
        )
        print(
            f"{model.parameters / 1e9:.2f} B parameters, {args.gpus} GPUs x "
            f"{args.gpu_memory_gib:g} GiB, {args.tokens_per_gpu} tokens per GPU"
        )
        try:
            best = recommend(plans)
        except ValueError as err:
            print(table(plans, None))
            print(f"{parser.prog}: error: {err}", file=sys.stderr)
            return 1
        print(table(plans, best))
        print(
            f"recommended: {best.layout.name} ({best.total / GIB:.1f} of {args.gpu_memory_gib:g}"
            f" GiB per GPU): {why(plans, best)}"
        )
        return 0
    except (ValueError, OSError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
