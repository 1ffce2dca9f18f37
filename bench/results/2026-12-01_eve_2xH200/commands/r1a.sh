#!/usr/bin/env bash
# Round 1a (2xH200): TE built from the parts carried earlier (/root/tw), the extension sent back
# as te_ext.tgz; then the eager NeMo rows (TE and local spec, GTP2 vs DP2, 2k and 4k tokens/GPU).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
T0=$(date +%s)
mkdir -p .whl && cp /root/tw/whl/* .whl/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl/*.tar.gz .whl/*.zip 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
bash bench/te_build.sh > $OUT/te_build.log 2>&1; tail -1 $OUT/te_build.log
(cd /tmp/te/transformer_engine/wheel_lib && tar czf $OUT/te_ext.tgz transformer_engine_torch*.so)
echo "te ready $(( $(date +%s) - T0 )) s"
export PYTHONPATH=/tmp/te:/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc
pack() { (cd $OUT && tar czf $1.tgz $1 && rm -rf $1); echo "$1 done $(( $(date +%s) - T0 )) s"; }
timeout 200 python3 bench/bench_nemo.py --modes dp2_te,gtp2_te --tokens 2048,4096 \
  --warmup 5 --timed 19 --fit-timeout 60 --out $OUT/eager_te | tail -8
pack eager_te
timeout 200 python3 bench/bench_nemo.py --modes dp2_local,gtp2_local --tokens 2048,4096 \
  --warmup 5 --timed 19 --fit-timeout 60 --out $OUT/eager_local | tail -8
pack eager_local
