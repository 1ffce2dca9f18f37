#!/usr/bin/env bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
export PYTHONPATH=/tmp/te:/tmp/site:$PWD
mkdir -p $OUT/r4; T0=$(date +%s)
timeout 200 python3 bench/bench_nemo.py --modes gtp2_te@graph,gtp2_te --tokens 2048 --profile-tokens 2048 --warmup 5 --timed 15 --out $OUT/r4/graph
echo "graph done $(( $(date +%s) - T0 )) s"; grep -h "Error" $OUT/r4/graph/rank0.log | tail -3
timeout 230 python3 bench/bench_nemo.py --modes dp2_local,gtp2_local,gtp2_local@copy_engine_min_tokens=16384 --tokens 4096,8192 --warmup 5 --timed 15 --out $OUT/r4/local
echo "local done $(( $(date +%s) - T0 )) s"
cat $OUT/r4/graph/bench_nemo.md $OUT/r4/local/bench_nemo.md
cd $OUT && tar czf r4.tgz r4 && rm -rf r4
