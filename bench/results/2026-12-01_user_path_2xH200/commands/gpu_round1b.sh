#!/usr/bin/env bash
# Round 1b (same machine, TE in /tmp/te): the NeMo 1B recipe with CUDA graphs: full-iteration
# (@graph) and per-layer (@layergraph), GTP2 vs DP2 graphed, TE spec at 1k/2k/4k and local spec
# at 2k; eager GTP2 twins at 2k for the graphed-vs-eager loss / grad-norm comparison. 30 steps.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
export PYTHONPATH=/tmp/te:/tmp/site:$PWD
T0=$(date +%s)
pack() { (cd $OUT && tar czf $1.tgz $1 && rm -rf $1); }
timeout 330 python3 bench/bench_nemo.py --modes dp2_te@graph,gtp2_te@graph,dp2_te@layergraph,gtp2_te@layergraph \
  --tokens 1024,2048,4096 --warmup 5 --timed 19 --out $OUT/r1_graphs_te | tail -14
echo "te graphs done $(( $(date +%s) - T0 )) s"; pack r1_graphs_te
timeout 230 python3 bench/bench_nemo.py --modes gtp2_te,gtp2_local,gtp2_local@graph,dp2_local@graph,gtp2_local@layergraph,dp2_local@layergraph \
  --tokens 2048 --warmup 5 --timed 19 --out $OUT/r1_graphs_local | tail -12
echo "local graphs done $(( $(date +%s) - T0 )) s"; pack r1_graphs_local
