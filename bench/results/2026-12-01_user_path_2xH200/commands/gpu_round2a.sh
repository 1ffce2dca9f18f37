#!/usr/bin/env bash
# Round 2a (2xH200): TE build (and keep the built extension); FP8 after the scale-alignment fix
# and the consumer-quantized backward (all modes of gpu_fp8_check); the NeMo TE path at 2k / 4k:
# DP2 vs GTP2 eager and with the full-iteration CUDA graph, profiled at 2k (full pstats).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
T0=$(date +%s)
mkdir -p .whl && cp /root/tw/whl/* .whl/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl/*.tar.gz .whl/*.zip 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
bash bench/te_build.sh > $OUT/te_build.log 2>&1; tail -1 $OUT/te_build.log
ls -la /tmp/te2/transformer_engine/wheel_lib/ >> $OUT/te_build.log
# the built torch extension comes back (a later round carries it instead of building again)
mkdir -p $OUT/te_ext && cp /tmp/te2/transformer_engine/wheel_lib/*.so $OUT/te_ext/ 2>/dev/null
echo "te build done $(( $(date +%s) - T0 )) s"
export PYTHONPATH=/tmp/te:/tmp/site:$PWD
pack() { (cd $OUT && tar czf $1.tgz $1 && rm -rf $1); }
timeout 120 torchrun --nproc-per-node 2 bench/gpu_fp8_check.py --deadline 110 --out $OUT/r2_fp8 2>&1 | grep -v Warn | tail -22
echo "fp8 done $(( $(date +%s) - T0 )) s"; pack r2_fp8
timeout 250 python3 bench/bench_nemo.py --modes dp2_te,gtp2_te,dp2_te@graph,gtp2_te@graph --tokens 2048 \
  --warmup 5 --timed 19 --profile-tokens 2048 --fit-timeout 100 --out $OUT/r2_nemo_2k | tail -14
echo "nemo 2k done $(( $(date +%s) - T0 )) s"; pack r2_nemo_2k
