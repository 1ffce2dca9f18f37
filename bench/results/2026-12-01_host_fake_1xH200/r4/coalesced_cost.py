import time, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch._C import _distributed_c10d as c10d
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
g = dist.group.WORLD
o = c10d.AllgatherOptions()
ro = c10d.ReduceScatterOptions()
for dev in ("cpu", "cuda"):
    outs = [torch.empty(2 * 2048 * 1024, device=dev, dtype=torch.bfloat16) for _ in range(8)]
    ins = [torch.empty(2048 * 1024, device=dev, dtype=torch.bfloat16) for _ in range(8)]
    flat_out = torch.empty(16 * 2048 * 1024, device=dev, dtype=torch.bfloat16)
    flat_in = torch.empty(8 * 2048 * 1024, device=dev, dtype=torch.bfloat16)
    def bench(name, f, n=300):
        for _ in range(20): f()
        if dev == "cuda": torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n): f()
        dt = (time.perf_counter() - t) / n * 1e6
        print(f"{dev:5s} {name:40s} {dt:8.1f} us", flush=True)
    bench("allgather_into_tensor_coalesced x8", lambda: g.allgather_into_tensor_coalesced(outs, ins, o))
    bench("_allgather_base flat", lambda: g._allgather_base(flat_out, flat_in, o))
    bench("_allgather_base x8", lambda: [g._allgather_base(a, b, o) for a, b in zip(outs, ins)])
    bench("reduce_scatter_tensor_coalesced x8", lambda: g.reduce_scatter_tensor_coalesced(ins, outs, ro))
    bench("_reduce_scatter_base flat", lambda: g._reduce_scatter_base(flat_in, flat_out, ro))
    if dev == "cuda":
        s = torch.cuda.Stream()
        bench("split copy of flat (8 copies)", lambda: [a.view(2, -1).copy_(flat_out.view(2, 8, -1)[:, i]) for i, a in enumerate(outs)])
        bench("event record + wait_event", lambda: (torch.cuda.current_stream().wait_stream(s)))
