#!/usr/bin/env bash
# Round 1a (2xH200): TE build; host cost per weight on TE linears (te_plain / te_gtp /
# te_gtp_co8); FP8 GEMM probe (which operand cuBLAS refuses in fp8_gtp2); the NeMo TE path at 2k
# tokens/GPU, DP2 vs GTP2, profiled with a chrome trace. Each stage packed as soon as it ends.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
T0=$(date +%s)
mkdir -p .whl && cp /root/tw/whl/* .whl/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl/*.tar.gz .whl/*.zip 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
bash bench/te_build.sh > $OUT/te_build.log 2>&1; tail -1 $OUT/te_build.log
echo "te build done $(( $(date +%s) - T0 )) s"
export PYTHONPATH=/tmp/te:/tmp/site:$PWD
pack() { (cd $OUT && tar czf $1.tgz $1 && rm -rf $1); }
mkdir -p $OUT/r1_host
timeout 80 torchrun --nproc-per-node 2 bench/host_cost.py --modes plain,gtp_co8,te_plain,te_gtp,te_gtp_co8 \
  --weights 64 --steps 200 --profile $OUT/r1_host/prof --out $OUT/r1_host/host_cost.json 2>&1 | grep -v Warn | tail -12
echo "host cost done $(( $(date +%s) - T0 )) s"; pack r1_host
timeout 90 torchrun --nproc-per-node 2 bench/gpu_fp8_check.py --modes fp8_dp2,fp8_gtp2 --steps 4 \
  --timing-from 1 --probe-gemm --deadline 80 --out $OUT/r1_fp8 2>&1 | grep -v Warn | tail -5
echo "fp8 probe done $(( $(date +%s) - T0 )) s"; pack r1_fp8
timeout 150 python3 bench/bench_nemo.py --modes dp2_te,gtp2_te --tokens 2048 --warmup 5 --timed 15 \
  --profile-tokens 2048 --chrome-trace --out $OUT/r1_nemo | tail -6
echo "nemo done $(( $(date +%s) - T0 )) s"; pack r1_nemo
