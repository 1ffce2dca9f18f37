"""Which layout fits: per-GPU memory of a GPT under TP × GTP × DP, before launching anything.

``--pipeline-parallel PP`` plans TP × PP × GTP × DP layouts (each GPU its stage's layers; the
first stage keeps PP microbatches' activations in flight under 1F1B, the last the logits).

``python -m nemo_gtp.plan --recipe llama31_405b --gpus 128 --gpu-memory-gib 80 --flash-attention``
lists every candidate layout (TP × GTP × DP, activation recompute on/off,
``shard_replicated_params_over_gtp``) with its per-GPU bytes split into weights, gradients,
optimizer state, GTP gather buffers and activations, marks which fit, and recommends the one
expected fastest among those that fit: no activation recompute first (it re-runs the forward),
then fewest weight shards (every shard costs three collectives per weight per step), then TP
inside a node over GTP.

The byte model (design §1.7, §3.1 "Buffer / memory management", §3.2) assumes megatron's
mixed-precision distributed optimizer: bf16 (or fp32) model weights, a ``main_grad`` of the
``grad_dtype``, fp32 master weights and two fp32 Adam moments sharded over the replicate group
(DP) — for the params GTP leaves whole over DP × GTP with ``shard_replicated_params_over_gtp``;
``--optimizer muon``: Muon's non-distributed state instead (:func:`estimate`).
Activations follow megatron's per-layer estimate (sequence parallelism with TP > 1):
``s·b·h·(34 + 5·a·s/h)`` bytes per layer (less without dropout, without the attention-score
term under flash attention), divided by TP, or only the layer inputs (``2·s·b·h``)
plus one layer's full activations under full recompute. It is an estimate, not a measurement:
``overhead_gib`` stands for the CUDA context, NCCL buffers and allocator slack.

Example::

    model = ModelShape(layers=24, hidden=2048, ffn=8192, heads=16, vocab=32000, seq=2048)
    plans = plan_layouts(model, gpus=2, gpu_memory_gib=141, tokens_per_gpu=4096)
    best = recommend(plans)          # ValueError naming the shortfall when nothing fits
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field

from nemo_gtp.engine.grid import check_pipeline_split, layout_dims
from nemo_gtp.recipes.model_size import (
    embedding_params,
    linear_params_per_layer,
    parameter_count,
    yaml_model_sizes,
)

GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide a GPT's memory (a recipe's ``model`` section, or NeMo's config)."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    vocab: int
    seq: int
    query_groups: int | None = None  # GQA: key/value heads; None = heads (MHA)
    gated: bool = False  # SwiGLU-style fc1 (two weights in one)
    tied_embeddings: bool = False
    experts: int = 0
    softmax_fp32: bool = False
    """megatron's ``attention_softmax_in_fp32`` (NeMo's GPTConfig: False, megatron's default:
    True): unfused attention then also keeps the fp32 softmax output, 4 more bytes per score."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "ffn", "heads", "vocab", "seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.experts:
            raise ValueError(
                "the planner does not model MoE experts yet (num_moe_experts is set): plan the "
                "dense part, or leave the model's experts out"
            )

    @property
    def linear_params_per_layer(self) -> int:
        """qkv + projection + fc1 + fc2 weights of one layer (what GTP shards, design §1.5)."""
        return linear_params_per_layer(
            self.hidden, self.ffn, self.heads, self.query_groups, self.gated
        )

    @property
    def largest_linear(self) -> int:
        """Elements of the largest linear weight (sizes the gathered buffers)."""
        kv = self.hidden * (self.query_groups or self.heads) // self.heads
        return max(
            self.hidden * (self.hidden + 2 * kv), self.hidden * self.ffn * (2 if self.gated else 1)
        )

    @property
    def embedding_params(self) -> int:
        """Input embedding plus output layer (one matrix when tied)."""
        return embedding_params(self.vocab, self.hidden, self.tied_embeddings)

    @property
    def parameters(self) -> int:
        """Every parameter (norms included), for reporting."""
        return parameter_count(**dataclasses.asdict(self))


@dataclass(frozen=True)
class Layout:
    """One candidate: TP × CP × GTP × DP and the memory options."""

    tp: int
    gtp: int
    dp: int
    recompute: bool = False
    shard_replicated: bool = False
    cp: int = 1
    """Context parallelism: the CP peers hold the same weights and split the distributed
    optimizer's state with the DP ranks (megatron's ``dp_cp`` group, design §1.4 "CP")."""
    pp: int = 1
    """Pipeline stages: each GPU holds its stage's layers (design §1.4 "PP"); the estimate is
    the fuller of the first and the last stage."""

    @property
    def name(self) -> str:
        """E.g. ``TP2·GTP4·DP1 +recompute`` (``TP1·CP2·GTP4·DP1`` with context parallelism,
        ``TP1·PP2·GTP2·DP1`` with pipeline stages)."""
        extra = (" +recompute" if self.recompute else "") + (
            " +shard_replicated" if self.shard_replicated else ""
        )
        cp = (f"·PP{self.pp}" if self.pp > 1 else "") + (f"·CP{self.cp}" if self.cp > 1 else "")
        return f"TP{self.tp}{cp}·GTP{self.gtp}·DP{self.dp}{extra}"


@dataclass
class Plan:
    """Per-GPU bytes of one layout."""

    layout: Layout
    bytes: dict[str, float] = field(default_factory=dict)
    budget: float = 0.0  # bytes of one GPU
    fits: bool = False

    @property
    def total(self) -> float:
        """Every counted byte, overhead included."""
        return sum(self.bytes.values())


def estimate(
    model: ModelShape,
    layout: Layout,
    *,
    tokens_per_gpu: int,
    param_bytes: int = 2,
    grad_bytes: int = 4,
    overhead_gib: float = 3.0,
    prefetch_depth: int = 1,
    coalesce_mb: float = 192.0,
    dropout: bool = False,
    flash_attention: bool = False,
    optimizer: str = "adam",
    muon_bucket_mb: float = 256.0,
) -> dict[str, float]:
    """Per-GPU bytes of ``model`` under ``layout`` (see the module docstring for the model).

    ``optimizer="muon"`` (design §1.6 "Muon"): megatron's non-distributed optimizer, so every
    rank keeps whole state for its own params: an fp32 master and a momentum (8 bytes) per
    element of the hidden matrices — 1/(TP·GTP) of them, never divided by DP — and Adam's 12 for
    the rest; plus the step's transient: two buckets of gathered fp32 Muon inputs under GTP
    (``muon_bucket_mb``, ``MuonConfig.gather_bucket_mb``) and Newton–Schulz's bf16 copies of the
    largest matrix (counted in ``optimizer``; they never coexist with the activations, so this
    overestimates a little).

    Activations per layer and token: ``34·h`` bytes with dropout (its masks), ``32·h`` without;
    plus the attention scores ``a·s`` times 5 bytes (scores, dropout mask and output) with
    dropout, 2 without, 4 more with ``ModelShape.softmax_fp32``, none with flash / fused
    attention (TE's default spec).
    """
    kwargs = dict(
        param_bytes=param_bytes, grad_bytes=grad_bytes, overhead_gib=overhead_gib,
        prefetch_depth=prefetch_depth, coalesce_mb=coalesce_mb, dropout=dropout,
        flash_attention=flash_attention, optimizer=optimizer, muon_bucket_mb=muon_bucket_mb,
    )  # fmt: skip
    if layout.pp == 1:
        whole = (model.layers, model.embedding_params, 1, 1, True)
        return _stage_bytes(model, layout, *whole, tokens_per_gpu, **kwargs)
    check_pipeline_split(model.layers, layout.pp, key="model.layers")
    # Under 1F1B (with at least PP microbatches per step) the first stage keeps PP microbatches'
    # activations of its layers in flight (its warm-up forwards), the last stage one; the first
    # holds the input embedding, the last the output layer (its own copy when tied), the final
    # norm and the logits.
    stage_layers, embedding = model.layers // layout.pp, model.vocab * model.hidden
    first = _stage_bytes(
        model, layout, stage_layers, embedding, 0, layout.pp, False, tokens_per_gpu, **kwargs
    )
    last = _stage_bytes(
        model, layout, stage_layers, embedding, 1, 1, True, tokens_per_gpu, **kwargs
    )
    return max(first, last, key=lambda part: sum(part.values()))


def _stage_bytes(
    model: ModelShape,
    layout: Layout,
    layers: int,
    embedding: float,
    final_norms: int,
    in_flight: int,
    logits: bool,
    tokens_per_gpu: int,
    *,
    param_bytes: int,
    grad_bytes: int,
    overhead_gib: float,
    prefetch_depth: int,
    coalesce_mb: float,
    dropout: bool,
    flash_attention: bool,
    optimizer: str,
    muon_bucket_mb: float,
) -> dict[str, float]:
    """:func:`estimate` for one GPU holding ``layers`` transformer layers, ``embedding``
    elements of embedding / output matrices, ``final_norms`` final layer norms and
    ``in_flight`` microbatches' activations of its layers (``logits``: and the fp32 logits)."""
    tp, gtp = layout.tp, layout.gtp
    replicas = layout.dp * layout.cp  # the distributed optimizer shards over CP x DP
    sharded = layers * model.linear_params_per_layer / (tp * gtp)
    replicated = embedding / tp + (2 * layers + final_norms) * model.hidden
    optimizer_bytes = 12  # fp32 master + Adam m and v
    replicated_shards = replicas * gtp if layout.shard_replicated else replicas
    weights = (sharded + replicated) * param_bytes
    grads = (sharded + replicated) * grad_bytes
    if optimizer == "muon":
        if layout.shard_replicated:
            raise ValueError(
                "optimizer='muon' runs without the distributed optimizer, so "
                "without shard_replicated_params_over_gtp"
            )
        full = model.largest_linear / tp
        inputs = sharded * gtp * 4  # every hidden matrix's whole fp32 Muon input
        transient = (2 * min(muon_bucket_mb * 2**20, inputs) if gtp > 1 else 0) + 3 * full * 2
        optimizer = sharded * 8 + replicated * optimizer_bytes + transient
    elif optimizer == "adam":
        optimizer = (
            sharded * optimizer_bytes / replicas + replicated * optimizer_bytes / replicated_shards
        )
    else:
        raise ValueError(f"--optimizer must be adam or muon, got {optimizer!r}")
    gather = 0.0
    if gtp > 1:  # live gathered units (current + prefetched per direction, the tail's
        # hand-over) and the wgrad scratch of the staged and the in-flight unit; a coalescing
        # unit (GTPConfig.coalesce_mb) is at least the largest weight, at most the model
        full = model.largest_linear / tp
        unit = min(max(full, coalesce_mb * 2**20 / param_bytes), sharded * gtp)
        gather = (2 + prefetch_depth) * unit * param_bytes + 2 * unit * grad_bytes
    h, a, s = model.hidden, model.heads, model.seq
    scores = 0 if flash_attention else (5 if dropout else 2) + 4 * model.softmax_fp32
    per_layer = tokens_per_gpu * ((34 if dropout else 32) * h + scores * a * s) / tp
    if layout.recompute:
        activations = in_flight * layers * 2 * tokens_per_gpu * h / tp + per_layer
    else:
        activations = in_flight * layers * per_layer
    if logits:
        activations += 2 * tokens_per_gpu * model.vocab / tp * 4  # fp32 logits and their grad
    return {
        "weights": weights,
        "grads": grads,
        "optimizer": optimizer,
        "gather": gather,
        "activations": activations,
        "overhead": overhead_gib * GIB,
    }


def candidate_layouts(
    gpus: int,
    *,
    gpus_per_node: int = 8,
    max_tp: int = 8,
    cp: int = 1,
    shard_replicated: bool = True,
    pp: int = 1,
) -> list[Layout]:
    """Every TP × PP × CP × GTP × DP = ``gpus`` (CP and PP fixed, the recipe's) with TP ≤
    ``max_tp`` inside a node, each with and without recompute and (GTP > 1,
    ``shard_replicated``: it needs the distributed optimizer) with and without
    ``shard_replicated_params_over_gtp``."""
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    if cp < 1 or gpus % cp:
        raise ValueError(f"--context-parallel {cp} must be >= 1 and divide --gpus {gpus}")
    if pp < 1 or gpus % (cp * pp):
        raise ValueError(
            f"--pipeline-parallel {pp} must be >= 1 and divide --gpus {gpus} / CP {cp}"
        )
    out, ranks = [], gpus // (cp * pp)  # the TP x GTP x DP ranks of each CP slice and stage
    for tp in range(1, min(ranks, max_tp, gpus_per_node) + 1):
        if ranks % tp:
            continue
        for gtp in range(1, ranks // tp + 1):
            if (ranks // tp) % gtp:
                continue
            sizes = {
                "tensor_model_parallel_size": tp,
                "num_weight_shards": tp * gtp,
                "context_parallel_size": cp,
                "pipeline_model_parallel_size": pp,
            }
            dp = layout_dims(sizes).with_world_size(gpus).dp  # the grid's own arithmetic
            for recompute in (False, True):
                for over_gtp in (False, True) if gtp > 1 and shard_replicated else (False,):
                    out.append(Layout(tp, gtp, dp, recompute, over_gtp, cp, pp))
    return out


def plan_layouts(
    model: ModelShape,
    *,
    gpus: int,
    gpu_memory_gib: float,
    tokens_per_gpu: int,
    gpus_per_node: int = 8,
    cp: int = 1,
    pp: int = 1,
    **estimate_kwargs: float,
) -> list[Plan]:
    """A :class:`Plan` per candidate layout (context parallelism ``cp``: each GPU holds
    ``tokens_per_gpu`` of a sample's ``seq / cp``; ``pp`` pipeline stages), ordered as
    :func:`recommend` prefers them."""
    if tokens_per_gpu < 1:
        raise ValueError(f"--tokens-per-gpu must be >= 1, got {tokens_per_gpu}")
    if not gpu_memory_gib > 0:
        raise ValueError(f"--gpu-memory-gib must be > 0, got {gpu_memory_gib:g}")
    if gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node must be >= 1, got {gpus_per_node}")
    budget = gpu_memory_gib * GIB
    plans = []
    distributed = estimate_kwargs.get("optimizer", "adam") != "muon"  # Muon: non-distributed
    for layout in candidate_layouts(
        gpus, gpus_per_node=gpus_per_node, cp=cp, shard_replicated=distributed, pp=pp
    ):
        if model.heads % layout.tp or (model.query_groups or model.heads) % layout.tp:
            continue  # megatron splits attention heads and key/value groups over TP
        plan = Plan(
            layout,
            estimate(model, layout, tokens_per_gpu=tokens_per_gpu, **estimate_kwargs),
            budget,
        )
        plan.fits = plan.total <= budget
        plans.append(plan)
    plans.sort(key=_preference)
    return plans


def _preference(plan: Plan) -> tuple:
    layout = plan.layout
    # No recompute first (it re-runs the forward: ~1/3 more compute, where GTP2 costs ~nothing
    # at >= 4k tokens per GPU); then fewest shards; among equal shard counts TP (inside a node)
    # before GTP; shard_replicated costs nothing measurable, so it sorts last and is picked when
    # it is what makes a layout fit.
    return (layout.recompute, layout.tp * layout.gtp, layout.gtp, layout.shard_replicated)


def recommend(plans: list[Plan]) -> Plan:
    """The preferred plan that fits; ``ValueError`` saying by how much the smallest misses."""
    for plan in plans:
        if plan.fits:
            return plan
    smallest = min(plans, key=lambda p: p.total)
    raise ValueError(
        f"no layout fits: the smallest, {smallest.layout.name}, needs "
        f"{smallest.total / GIB:.1f} GiB per GPU, {(smallest.total - smallest.budget) / GIB:.1f} "
        f"GiB more than the {smallest.budget / GIB:.1f} GiB available: add GPUs, shorten "
        "--tokens-per-gpu, or shrink the model"
    )


def _table(plans: list[Plan], best: Plan | None) -> str:
    width = max(len("layout"), *(len(plan.layout.name) for plan in plans))
    columns = ("weights", "grads", "optim", "gather", "activ", "total")
    span = len(columns) * 9 - 1
    rows = [
        f"{'':<{width}} {' GiB per GPU (overhead in total) '.center(span, '-')}",
        f"{'layout':<{width}} " + " ".join(f"{c:>8}" for c in columns) + "  fits",
    ]
    for plan in plans:
        b = {k: v / GIB for k, v in plan.bytes.items()}
        mark = "yes" if plan.fits else "no"
        if plan is best:
            mark += "  <- recommended"
        rows.append(
            f"{plan.layout.name:<{width}} {b['weights']:8.2f} {b['grads']:8.2f} "
            f"{b['optimizer']:8.2f} {b['gather']:8.2f} {b['activations']:8.2f} "
            f"{plan.total / GIB:8.2f}  {mark}"
        )
    return "\n".join(rows)


def why(plans: list[Plan], best: Plan) -> str:
    """Why ``best`` is recommended over plain TP + DP (and over recompute): one clause.

    Example: ``without GTP nothing fits: the smallest, TP8·GTP1·DP4 +recompute, needs 80.5 GiB
    per GPU`` (design §1.7).
    """
    plain = [plan for plan in plans if plan.layout.gtp == 1]
    fitting = [plan for plan in plain if plan.fits]
    if best.layout.gtp == 1:
        return "fits without GTP: plain TP + DP, no gathers"
    if not fitting:
        smallest = min(plain, key=lambda plan: plan.total)
        return (
            f"without GTP nothing fits: the smallest, {smallest.layout.name}, needs "
            f"{smallest.total / GIB:.1f} GiB per GPU"
        )
    if not best.layout.recompute and all(plan.layout.recompute for plan in fitting):
        return (
            f"without GTP only {fitting[0].layout.name} fits ({fitting[0].total / GIB:.1f} GiB "
            "per GPU), and recompute re-runs the forward"
        )
    return "the fewest weight shards that fit"  # a GTP layout preferred among fitting TP + DP


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
    (``RecipeError``) naming a bad recipe or override; MoE recipes: ``ModelShape``'s refusal.

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
        prog="python -m nemo_gtp.plan", description=__doc__.splitlines()[0]
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
            print(_table(plans, None))
            print(f"{parser.prog}: error: {err}", file=sys.stderr)
            return 1
        print(_table(plans, best))
        print(
            f"recommended: {best.layout.name} ({best.total / GIB:.1f} of {args.gpu_memory_gib:g}"
            f" GiB per GPU): {why(plans, best)}"
        )
        return 0
    except (ValueError, OSError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
