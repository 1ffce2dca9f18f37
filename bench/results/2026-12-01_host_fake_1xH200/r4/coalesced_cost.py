"""Host µs per call of GTP's collectives on torch's fake backend (world 2), CPU and CUDA tensors.

What ran on 1xH200 (2026-12-01), reformatted for the linter (the same calls): ``output.txt``.
    python3 coalesced_cost.py
"""

import time

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from torch.testing._internal.distributed.fake_pg import FakeStore


def bench(dev: str, name: str, f, n: int = 300) -> None:  # noqa: ANN001
    for _ in range(20):
        f()
    if dev == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    print(f"{dev:5s} {name:40s} {(time.perf_counter() - t) / n * 1e6:8.1f} us", flush=True)


def run(dev: str, g: dist.ProcessGroup) -> None:
    ag, rs = c10d.AllgatherOptions(), c10d.ReduceScatterOptions()
    kw = dict(device=dev, dtype=torch.bfloat16)
    outs = [torch.empty(2 * 2048 * 1024, **kw) for _ in range(8)]
    ins = [torch.empty(2048 * 1024, **kw) for _ in range(8)]
    flat_out = torch.empty(16 * 2048 * 1024, **kw)
    flat_in = torch.empty(8 * 2048 * 1024, **kw)
    pairs = list(zip(outs, ins))
    bench(
        dev,
        "allgather_into_tensor_coalesced x8",
        lambda: g.allgather_into_tensor_coalesced(outs, ins, ag),
    )
    bench(dev, "_allgather_base flat", lambda: g._allgather_base(flat_out, flat_in, ag))
    bench(dev, "_allgather_base x8", lambda: [g._allgather_base(a, b, ag) for a, b in pairs])
    bench(
        dev,
        "reduce_scatter_tensor_coalesced x8",
        lambda: g.reduce_scatter_tensor_coalesced(ins, outs, rs),
    )
    bench(dev, "_reduce_scatter_base flat", lambda: g._reduce_scatter_base(flat_in, flat_out, rs))
    if dev == "cuda":
        chunks = flat_out.view(2, 8, -1)
        side = torch.cuda.Stream()
        bench(
            dev,
            "split copy of flat (8 copies)",
            lambda: [a.view(2, -1).copy_(chunks[:, i]) for i, a in enumerate(outs)],
        )
        bench(
            dev, "event record + wait_event", lambda: torch.cuda.current_stream().wait_stream(side)
        )


def main() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    for dev in ("cpu", "cuda"):
        run(dev, dist.group.WORLD)


if __name__ == "__main__":
    main()
