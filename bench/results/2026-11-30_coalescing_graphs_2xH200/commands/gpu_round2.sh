#!/usr/bin/env bash
# Round 1 (2xH200): host cost with coalescing units; NeMo path local spec, units on/off.
set -x
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl/*.tar.gz .whl/*.zip 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r2
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/r2/gpu.txt
timeout 270 python3 bench/bench_nemo.py --modes dp2_local,gtp2_local,gtp2_local@coalesce_mb=96@separate_reduce_scatter_group=true,gtp2_local@coalesce_mb=96@copy_engine_min_tokens=8192,gtp2_local@coalesce_mb=192@copy_engine_min_tokens=8192@separate_reduce_scatter_group=true --tokens 4096 --warmup 5 --timed 15 --out $OUT/r2/nemo4k
timeout 230 python3 bench/bench_nemo.py --modes dp2_local,gtp2_local@coalesce_mb=192,gtp2_local@coalesce_mb=192@separate_reduce_scatter_group=true,gtp2_local@coalesce_mb=96@separate_reduce_scatter_group=true --tokens 2048 --warmup 5 --timed 15 --out $OUT/r2/nemo2k
cat $OUT/r2/nemo2k/bench_nemo.md
cat $OUT/r2/nemo4k/bench_nemo.md
cd $OUT && tar czf r2.tgz r2 && rm -rf r2
