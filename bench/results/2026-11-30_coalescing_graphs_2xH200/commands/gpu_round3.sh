#!/usr/bin/env bash
# Round 3 (2xH200): TE build; TE spec GTP2 vs DP2 with coalescing units; full-iteration graphs.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl/*.tar.gz .whl/*.zip 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r3
T0=$(date +%s)
bash bench/te_build.sh > $OUT/r3/te_build.log 2>&1; tail -2 $OUT/r3/te_build.log
echo "te build $(( $(date +%s) - T0 )) s"
export PYTHONPATH=/tmp/te:/tmp/site:$PWD
timeout 240 python3 bench/bench_nemo.py --modes dp2_te,gtp2_te,gtp2_te@coalesce_mb=0 --tokens 2048,4096 --warmup 5 --timed 15 --out $OUT/r3/te
echo "te bench done $(( $(date +%s) - T0 )) s"
timeout 150 python3 bench/bench_nemo.py --modes dp2_te@graph,gtp2_te@graph --tokens 2048 --warmup 5 --timed 15 --out $OUT/r3/graph
echo "graph bench done $(( $(date +%s) - T0 )) s"
grep -h "Error\|error" $OUT/r3/graph/rank0.log | tail -5
cat $OUT/r3/te/bench_nemo.md $OUT/r3/graph/bench_nemo.md
cd $OUT && tar czf r3.tgz r3 && rm -rf r3
