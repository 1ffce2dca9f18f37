#!/usr/bin/env bash
# Round 1b (2xH200, same machine as r1a): grouped experts on real TE (issue 16), FP8 per-tensor
# and blockwise at lr 1e-4 over 50 steps (17), per-layer graphs' teardown (14), the 1B FP8
# recipe with FP8 primary weights through the strategy at 4k tokens per GPU (17).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
export PYTHONPATH=/tmp/te:/tmp/site:$PWD
OUT=$OUT bash bench/gpu_pending.sh grouped fp8 layergraph
T0=$(date +%s)
timeout 170 python3 bench/bench_nemo.py --modes dp2_fp8param,gtp2_fp8param \
  --tokens 4096 --warmup 5 --timed 19 --fit-timeout 80 --out $OUT/fp8param_nemo | tail -8
(cd $OUT && tar czf fp8param_nemo.tgz fp8param_nemo && rm -rf fp8param_nemo)
echo "fp8param_nemo done $(( $(date +%s) - T0 )) s"
