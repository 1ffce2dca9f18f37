#!/usr/bin/env bash
# Round 1 (2xH200): host cost with coalescing units; NeMo path local spec, units on/off.
set -x
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl/*.tar.gz .whl/*.zip 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r1
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/r1/gpu.txt
timeout 90 torchrun --nproc-per-node 2 bench/host_cost.py --modes plain,gtp,gtp_co4,gtp_co8,collectives --steps 100 --out $OUT/r1/host_cost.json > $OUT/r1/host_cost.log 2>&1
tail -30 $OUT/r1/host_cost.log
timeout 420 python3 bench/bench_nemo.py --modes dp2_local,gtp2_local,gtp2_local@coalesce_mb=96,gtp2_local@coalesce_mb=192 --tokens 2048,4096 --warmup 5 --timed 15 --out $OUT/r1/nemo
cat $OUT/r1/nemo/bench_nemo.md
cd $OUT && tar czf r1.tgz r1 && rm -rf r1
