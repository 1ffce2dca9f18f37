#!/usr/bin/env bash
# Round 1a (2xH200): TE build, then the NeMo TE path after the protocol fix (units no longer
# skip prefetches) with and without TE's fused wgrad into GTP's scratch, 2k and 4k tokens per GPU,
# each mode twice (interleaved), a torch.profiler summary at 2k.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl/*.tar.gz .whl/*.zip 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r1a
bash bench/te_build.sh > $OUT/r1a/te_build.log 2>&1; tail -1 $OUT/r1a/te_build.log
echo "te build done $(( $(date +%s) - T0 )) s"
export PYTHONPATH=/tmp/te:/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/r1a/gpu.txt
LEFT=$(( 580 - ($(date +%s) - T0) ))
timeout $LEFT python3 bench/bench_nemo.py --modes dp2_te,gtp2_te,gtp2_te@te_fuse_wgrad=false \
  --tokens 2048,4096 --repeat 2 --warmup 5 --timed 15 --profile-tokens 2048 --out $OUT/r1a/nemo
echo "nemo done $(( $(date +%s) - T0 )) s"
grep -h '^{' $OUT/r1a/nemo/rank0.log | cut -c1-400 > $OUT/r1a/records.txt
cd $OUT && tar czf r1a.tgz r1a && rm -rf r1a
