"""Muon on GTP shards: orthogonalize the whole matrix, update this rank's rows (design §1.6).

Muon replaces a 2D weight's momentum by its orthogonalization (a few Newton–Schulz iterations
on the *whole* matrix), so a GTP rank cannot update its rows from its rows alone. Per step,
:class:`GTPMuon` all-gathers every sharded weight's Muon input (the nesterov-mixed momentum, the
shard's rows) over the weight's GTP group in flat collectives, one per GTP group and bucket of at
most ``gather_bucket_mb`` of whole inputs, not one per weight (the next bucket's in flight while
this one is orthogonalized; at most two buckets held), runs Newton–Schulz on the logical
(unpadded) matrix exactly as the run without GTP does on its replicated copy, and applies only
its own rows of the result. ``orthogonalize="owner"`` (default): each matrix goes to one GTP
peer only (:func:`assign_owners`, balanced by Newton–Schulz cost; an all-to-all of the shards),
which orthogonalizes it and deals the rows back (a second all-to-all, in the Newton–Schulz
dtype): 1/GTP of the Newton–Schulz work per rank, and for GTP > 2 fewer bytes than an
all-gather. ``"every_rank"``: one all-gather, every peer orthogonalizes every matrix (as every
data-parallel replica does without GTP). Both give the same bits. The momentum stays a shard
(1/GTP of its bytes per rank). At GTP size 1 no collective runs
and the update is the plain Muon update, bit for bit the same as ``torch.optim.Muon``'s with
``ns_dtype=torch.bfloat16`` (tested).

Example::

    optimizer = GTPMuon([shard_a, shard_b, other_2d], lr=0.02, ns_dtype=torch.float32)
    loss.backward(); optimizer.step()   # the two GTP shards: one bucket, two all-to-alls
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from nemo_gtp.engine.param import GTPShardedParam, is_gtp_param

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic Newton–Schulz coefficients of Keller Jordan's Muon (torch's defaults too)."""

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
ORTHOGONALIZE = ("owner", "every_rank")
"""Who runs Newton–Schulz on a sharded matrix: one GTP peer (its owner), or every peer."""


def newton_schulz(
    update: torch.Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Muon's approximate orthogonalization of the 2D ``update`` (a new tensor of ``dtype``).

    Runs on the wide orientation (a tall matrix is transposed first), normalized by its
    Frobenius norm, ``steps`` quintic iterations ``X <- aX + (bA + cA^2)X`` with ``A = XX^T``.

    Example::

        ortho = newton_schulz(torch.randn(64, 32), dtype=torch.float32)
    """
    a, b, c = coefficients
    x = update.to(dtype, copy=True)  # never normalize the caller's tensor in place
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: tuple[int, ...]) -> float:
    """Muon's shape-dependent learning rate for a ``shape`` (rows, cols) matrix: ``"original"``
    (default) ``sqrt(max(1, rows/cols))``, ``"match_rms_adamw"`` ``0.2*sqrt(max(rows, cols))``.
    Under GTP the *logical* shape counts, never the shard's.

    Example::

        adjusted_lr(0.02, None, (4096, 1024))   # 0.04
    """
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")


def _default_shard_of(param: torch.Tensor) -> GTPShardedParam | None:
    return param if is_gtp_param(param) else None


class GTPMuon(torch.optim.Optimizer):
    """Muon (momentum, Newton–Schulz orthogonalization, decoupled weight decay) for 2D params,
    GTP shards included (module docstring; design §1.6 "Muon").

    ``shard_of(p)`` names the :class:`GTPShardedParam` whose rows ``p`` holds (None: ``p`` is a
    whole matrix). The default answers ``p`` itself for a GTP shard; megatron's mixed-precision
    wrapper hands the optimizer fp32 copies of the shards, and
    :func:`nemo_gtp.integrations.megatron.muon.get_muon_optimizer` passes their map. Every GTP
    peer must step the same params in the same order (the flat gathers are collective).
    ``gather_bucket_mb``: the most gathered (whole-matrix) Muon input one collective moves; a
    matrix larger than it is gathered alone.

    Example::

        opt = GTPMuon(model_2d_params, lr=0.02, momentum=0.95, weight_decay=0.01)
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype = torch.bfloat16,
        shard_of: Callable[[torch.Tensor], GTPShardedParam | None] | None = None,
        gather_bucket_mb: float = 256.0,
        orthogonalize: str = "owner",
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(
                f"GTPMuon: lr ({lr}), momentum ({momentum}) and weight_decay ({weight_decay}) "
                "must be >= 0"
            )
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(
                f"GTPMuon: adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}"
            )
        if not 0 < ns_steps < 100:
            raise ValueError(f"GTPMuon: ns_steps must be in 1..99, got {ns_steps}")
        if orthogonalize not in ORTHOGONALIZE:
            raise ValueError(
                f"GTPMuon: orthogonalize must be one of {ORTHOGONALIZE}, got {orthogonalize!r}"
            )
        if gather_bucket_mb <= 0:
            raise ValueError(f"GTPMuon: gather_bucket_mb must be > 0, got {gather_bucket_mb}")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            ns_dtype=ns_dtype,
        )
        super().__init__(params, defaults)
        self.shard_of = shard_of or _default_shard_of
        self.gather_bucket_mb = gather_bucket_mb
        self.orthogonalize = orthogonalize
        for group in self.param_groups:
            for param in group["params"]:
                if param.ndim != 2:
                    raise ValueError(
                        f"GTPMuon takes 2D params only, got one of shape {tuple(param.shape)} "
                        "(give biases, norms and embeddings to Adam)"
                    )

    def init_state(self) -> None:
        """Create every param's momentum buffer (zeros) before a checkpoint load fills it
        (megatron's ``init_state_fn``)."""
        for group in self.param_groups:
            for param in group["params"]:
                if "momentum_buffer" not in self.state[param]:
                    self.state[param]["momentum_buffer"] = torch.zeros_like(param)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # noqa: D102
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        momentum, nesterov = group["momentum"], group["nesterov"]
        whole: list[tuple[torch.Tensor, torch.Tensor]] = []
        sharded: dict[int, list[tuple[torch.Tensor, torch.Tensor, GTPShardedParam]]] = {}
        for param in group["params"]:
            if param.grad is None:
                continue
            grad = param.grad
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if nesterov else buf
            shard = self.shard_of(param)
            if shard is None or shard.gtp_spec.gtp_size == 1:
                whole.append((param, update))
            else:
                sharded.setdefault(id(shard.runtime.group), []).append((param, update, shard))
        for param, update in whole:
            self._apply(group, param, update, None)
        start = _ToOwners if self.orthogonalize == "owner" else _Gather
        for members in sharded.values():  # GTP groups in first-param order: the same everywhere
            buckets = _buckets(members, int(self.gather_bucket_mb * 2**20))
            pending = start(buckets[0])
            for index in range(len(buckets)):
                # the next bucket's inputs in flight while this one is orthogonalized
                ahead = start(buckets[index + 1]) if index + 1 < len(buckets) else None
                if isinstance(pending, _Gather):
                    for (param, _, shard), full in zip(buckets[index], pending.wait()):
                        self._apply(group, param, full, shard)
                else:
                    self._step_owned(group, pending)
                pending = ahead

    def _step_owned(self, group: dict[str, Any], inputs: _ToOwners) -> None:
        """One bucket under ``orthogonalize="owner"``: orthogonalize the matrices this rank
        owns, hand every rank its rows of every matrix, step this rank's shards."""
        owned = [(index, self._orthogonalize(group, full)) for index, full in inputs.wait()]
        dealt = _FromOwners(inputs, owned, group["ns_dtype"]).wait()
        for (param, _, shard), rows in zip(inputs.members, dealt):
            _step_rows(group, param, rows, shard.gtp_spec.logical_shape)

    @staticmethod
    def _orthogonalize(group: dict[str, Any], full: torch.Tensor) -> torch.Tensor:
        return newton_schulz(
            full, group["ns_steps"], group["ns_coefficients"], group["eps"], group["ns_dtype"]
        )

    @staticmethod
    def _apply(
        group: dict[str, Any],
        param: torch.Tensor,
        full: torch.Tensor,
        shard: GTPShardedParam | None,
    ) -> None:
        """Orthogonalize the whole ``full`` update, then step ``param`` (a shard: its rows)."""
        ortho = GTPMuon._orthogonalize(group, full)
        shape = tuple(full.shape)
        if shard is not None:  # this rank's rows of the logical matrix (pad rows: none)
            spec = shard.gtp_spec
            start = spec.gtp_rank * spec.shard_dim0
            ortho = ortho[start : min(start + spec.shard_dim0, shape[0])]
        _step_rows(group, param, ortho, shape)


def _step_rows(
    group: dict[str, Any], param: torch.Tensor, rows: torch.Tensor, shape: tuple[int, ...]
) -> None:
    """Decoupled weight decay on ``param``, then ``rows`` (its first rows' orthogonalized
    update, or all of them) at the lr of the logical ``shape``."""
    lr = group["lr"]
    param.mul_(1 - lr * group["weight_decay"])
    target = param if rows.size(0) == param.size(0) else param[: rows.size(0)]
    target.add_(rows, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], shape))


_Member = tuple[torch.Tensor, torch.Tensor, GTPShardedParam]


def _wholes(
    per_rank: torch.Tensor, members: list[_Member], indices: list[int]
) -> list[torch.Tensor]:
    """The whole logical matrices of ``members[i]`` for ``i`` in ``indices`` from ``per_rank``
    (one row per GTP rank: those members' shards, flat, in that order; pad rows dropped)."""
    wholes, offset = [], 0
    for index in indices:
        spec, numel = members[index][2].gtp_spec, members[index][1].numel()
        block = per_rank[:, offset : offset + numel]
        offset += numel
        wholes.append(spec.unpad(block.reshape(spec.gathered_shape)))  # rank-major rows
    return wholes


def _buckets(members: list[_Member], cap_bytes: int) -> list[list[_Member]]:
    """``members`` in order, cut where their gathered (whole) inputs pass ``cap_bytes`` (at
    least one member per bucket): what one all-gather moves and holds."""
    buckets: list[list[_Member]] = [[]]
    held = 0
    for member in members:
        update, spec = member[1], member[2].gtp_spec
        size = update.numel() * update.element_size() * spec.gtp_size
        if buckets[-1] and held + size > cap_bytes:
            buckets.append([])
            held = 0
        buckets[-1].append(member)
        held += size
    return buckets


class _Gather:
    """One bucket's Muon inputs, all-gathered (async) over their GTP group as one flat tensor;
    :meth:`wait` returns each member's whole logical matrix (rank-major rows, pad dropped)."""

    def __init__(self, members: list[_Member]) -> None:
        self.members = members
        parts = [update.reshape(-1) for _, update, _ in members]
        flat = torch.cat(parts) if len(parts) > 1 else parts[0]  # one member: no copy
        self.size = members[0][2].gtp_spec.gtp_size
        self.gathered = flat.new_empty(self.size * flat.numel())
        group = members[0][2].runtime.group
        self.work = dist.all_gather_into_tensor(self.gathered, flat, group=group, async_op=True)

    def wait(self) -> list[torch.Tensor]:
        self.work.wait()
        per_rank = self.gathered.view(self.size, -1)
        return _wholes(per_rank, self.members, list(range(len(self.members))))


def _ns_cost(shape: tuple[int, ...]) -> int:
    """Multiply-adds of one Newton–Schulz iteration on a ``shape`` matrix (wide orientation)."""
    small, large = sorted(shape[:2])
    return 2 * small * small * large + small**3


def assign_owners(shapes: list[tuple[int, ...]], size: int) -> list[int]:
    """The GTP rank that orthogonalizes each matrix of a bucket: the largest first, each to the
    least loaded rank (ties: the lowest); the same answer on every peer (shapes only).

    Example::

        assign_owners([(4096, 1024), (1024, 1024), (1024, 1024)], 2)   # [0, 1, 1]
    """
    load, owners = [0] * size, [0] * len(shapes)
    for index in sorted(range(len(shapes)), key=lambda i: (-_ns_cost(shapes[i]), i)):
        owner = min(range(size), key=lambda r: (load[r], r))
        owners[index] = owner
        load[owner] += _ns_cost(shapes[index])
    return owners


class _ToOwners:
    """One bucket's Muon inputs sent (async, one ``all_to_all_single``) to the ranks that
    orthogonalize them (:func:`assign_owners`): every rank sends its shard of each matrix to
    the matrix's owner. :meth:`wait` returns ``(bucket index, whole logical matrix)`` of the
    matrices this rank owns."""

    def __init__(self, members: list[_Member]) -> None:
        self.members = members
        spec = members[0][2].gtp_spec
        self.size, self.rank = spec.gtp_size, spec.gtp_rank
        self.group = members[0][2].runtime.group
        shapes = [m[2].gtp_spec.logical_shape for m in members]
        self.owners = assign_owners(shapes, self.size)
        self.by_owner = [[i for i, o in enumerate(self.owners) if o == r] for r in range(self.size)]
        self.numel = [m[1].numel() for m in members]  # a shard's elements (pad rows included)
        parts = [members[i][1].reshape(-1) for owned in self.by_owner for i in owned]
        send = torch.cat(parts)
        self.send_counts = [sum(self.numel[i] for i in owned) for owned in self.by_owner]
        mine = self.send_counts[self.rank]
        self.recv = send.new_empty(self.size * mine)
        self.work = dist.all_to_all_single(
            self.recv, send, [mine] * self.size, self.send_counts, group=self.group, async_op=True
        )

    def wait(self) -> list[tuple[int, torch.Tensor]]:
        self.work.wait()
        owned = self.by_owner[self.rank]
        per_rank = self.recv.view(self.size, -1)
        return list(zip(owned, _wholes(per_rank, self.members, owned)))


class _FromOwners:
    """The owners' orthogonalized matrices dealt back by rows (one ``all_to_all_single``, in
    the Newton–Schulz ``dtype``): :meth:`wait` returns this rank's shard-shaped rows of every
    matrix of the bucket, in bucket order (pad rows zero)."""

    def __init__(
        self, inputs: _ToOwners, owned: list[tuple[int, torch.Tensor]], dtype: torch.dtype
    ) -> None:
        self.inputs = inputs
        size = inputs.size
        chunks: list[list[torch.Tensor]] = [[] for _ in range(size)]
        for index, ortho in owned:
            spec = inputs.members[index][2].gtp_spec
            padded = ortho
            if spec.pad_length:
                padded = ortho.new_zeros(spec.gathered_shape)
                padded[: ortho.size(0)] = ortho
            for rank, rows in enumerate(padded.chunk(size)):
                chunks[rank].append(rows.reshape(-1))
        parts = [t for per_rank in chunks for t in per_rank]
        update = inputs.members[0][1]
        send = torch.cat(parts) if parts else update.new_empty(0, dtype=dtype)
        mine = inputs.send_counts[inputs.rank]
        # from owner r: this rank's rows of the matrices r owns
        self.recv = update.new_empty(sum(inputs.send_counts), dtype=dtype)
        dist.all_to_all_single(
            self.recv, send, inputs.send_counts, [mine] * size, group=inputs.group
        )

    def wait(self) -> list[torch.Tensor]:
        inputs = self.inputs
        rows: list[torch.Tensor | None] = [None] * len(inputs.members)
        offset = 0
        for owned in inputs.by_owner:
            for index in owned:
                shape = inputs.members[index][1].shape
                rows[index] = self.recv[offset : offset + inputs.numel[index]].view(shape)
                offset += inputs.numel[index]
        return rows  # type: ignore[return-value]
