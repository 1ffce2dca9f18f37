#!/usr/bin/env bash
# Round 3a (2xH200): TE build; the NeMo TE path after the host-work changes (DP2 vs GTP2 at
# 2k/4k, each twice, interleaved; a profile at 2k); per-layer CUDA graphs under GTP (local spec,
# fp32: graphed GTP2 vs eager GTP2 vs DP2). Each stage is packed as soon as it ends.
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
timeout 170 python3 bench/bench_nemo.py --modes dp2_te,gtp2_te --tokens 2048,4096 --repeat 2 \
  --warmup 5 --timed 15 --profile-tokens 2048 --out $OUT/r3_nemo | tail -16
echo "nemo done $(( $(date +%s) - T0 )) s"; pack r3_nemo
timeout 130 python3 bench/gpu_layer_graphs.py --out $OUT/r3_layer_graphs 2>&1 | tail -30
echo "layer graphs done $(( $(date +%s) - T0 )) s"; pack r3_layer_graphs
