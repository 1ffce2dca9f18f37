"""Candidate layouts, their plans, and the recommendation (design §1.7)."""

from __future__ import annotations

from nemo_gtp.engine.grid import layout_dims
from nemo_gtp.plan.memory import estimate
from nemo_gtp.plan.shapes import GIB, Layout, ModelShape, Plan

__all__ = ["candidate_layouts", "plan_layouts", "recommend", "table", "why"]


def candidate_layouts(
    gpus: int,
    *,
    gpus_per_node: int = 8,
    max_tp: int = 8,
    cp: int = 1,
    shard_replicated: bool = True,
    pp: int = 1,
    experts: int = 0,
) -> list[Layout]:
    """Every TP × PP × CP × GTP × DP = ``gpus`` (CP and PP fixed, the recipe's) with TP ≤
    ``max_tp`` inside a node, each with and without recompute and (GTP > 1,
    ``shard_replicated``: it needs the distributed optimizer) with and without
    ``shard_replicated_params_over_gtp``; with ``experts`` (MoE) each also at every EP
    (dividing ``experts``) × EGTP that divides GTP · CP · DP."""
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
            for ep, egtp in _expert_splits(experts, gtp * cp * dp):
                for recompute in (False, True):
                    for over_gtp in (False, True) if gtp > 1 and shard_replicated else (False,):
                        out.append(Layout(tp, gtp, dp, recompute, over_gtp, cp, pp, ep, egtp))
    return out


def _expert_splits(experts: int, ranks: int) -> list[tuple[int, int]]:
    """(EP, EGTP) pairs for ``experts`` routed experts over the ``ranks`` (GTP · CP · DP) that
    share a TP rank: EP divides the experts, EP × EGTP divides the ranks."""
    if not experts:
        return [(1, 1)]
    return [
        (ep, egtp)
        for ep in range(1, ranks + 1)
        if experts % ep == 0 and ranks % ep == 0
        for egtp in range(1, ranks // ep + 1)
        if (ranks // ep) % egtp == 0
    ]


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
        gpus,
        gpus_per_node=gpus_per_node,
        cp=cp,
        shard_replicated=distributed,
        pp=pp,
        experts=model.experts,
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
    # it is what makes a layout fit. Routed experts: fewest gathered expert shards (EGTP), then
    # the smallest EP.
    return (
        layout.recompute,
        layout.tp * layout.gtp,
        layout.gtp,
        layout.egtp,
        layout.ep,
        layout.shard_replicated,
    )


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


def table(plans: list[Plan], best: Plan | None) -> str:
    """The plans as a table in GiB per GPU, ``best`` marked."""
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
    plain = [plan for plan in plans if plan.layout.gtp == 1 and plan.layout.egtp == 1]
    fitting = [plan for plan in plain if plan.fits]
    if best in plain:
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
