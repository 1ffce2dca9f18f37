#!/usr/bin/env bash
# Round 4 (2xH200, fresh machine): the host timer with thread CPU time per entry (wall - CPU: blocked)
# and the consume's inner steps; DP2 vs GTP2, TE spec, 2k.

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
timeout 150 python3 bench/bench_nemo.py --modes dp2_te,gtp2_te --tokens 2048 --host-timer \
  --warmup 5 --timed 19 --fit-timeout 60 --out $OUT/timer4_te | tail -7
pack timer4_te
