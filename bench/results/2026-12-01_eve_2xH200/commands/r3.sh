#!/usr/bin/env bash
# Round 3 (2xH200, fresh machine): as round 2, with the timer inside GTP's entry points (collective issue,
# waits, finalize) and larger coalescing units (coalesce_mb=768) beside the default, 2k only.

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
T0=$(date +%s)
mkdir -p .whl && cp /root/tw/whl/* .whl/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl/*.tar.gz .whl/*.zip 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
bash bench/te_build.sh > $OUT/te_build.log 2>&1; tail -1 $OUT/te_build.log
echo "te ready $(( $(date +%s) - T0 )) s"
export PYTHONPATH=/tmp/te:/tmp/site:$PWD
pack() { (cd $OUT && tar czf $1.tgz $1 && rm -rf $1); echo "$1 done $(( $(date +%s) - T0 )) s"; }
timeout 220 python3 bench/bench_nemo.py --modes dp2_te,gtp2_te,gtp2_te@coalesce_mb=768 --tokens 2048 --host-timer \
  --warmup 5 --timed 19 --fit-timeout 60 --out $OUT/timer3_te | tail -7
pack timer3_te
