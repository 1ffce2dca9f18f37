#!/usr/bin/env bash
# Round 2b (same machine): per-layer graphs under GTP2 (TE spec, 2k) with a fit timeout: the hang
# of round 1 leaves every thread's stack in the rank logs.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
export PYTHONPATH=/tmp/te:/tmp/site:$PWD
T0=$(date +%s)
pack() { (cd $OUT && tar czf $1.tgz $1 && rm -rf $1); }
timeout 130 python3 bench/bench_nemo.py --modes gtp2_te@layergraph --tokens 2048 \
  --warmup 5 --timed 19 --fit-timeout 80 --out $OUT/r2_layergraph | tail -6
echo "layergraph done $(( $(date +%s) - T0 )) s"; pack r2_layergraph
