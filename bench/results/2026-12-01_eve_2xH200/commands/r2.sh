#!/usr/bin/env bash
# Round 2 (2xH200, fresh machine): TE from the extension round 1 built (.te_ext, no build); the
# eager TE rows at 2k and 4k with the in-process host timer (--host-timer: ms per step inside
# GTP's entry points, megatron's DDP bucket calls and optimizer step; the fwd+bwd / rest split).
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
timeout 220 python3 bench/bench_nemo.py --modes dp2_te,gtp2_te --tokens 2048,4096 --host-timer \
  --warmup 5 --timed 19 --fit-timeout 60 --out $OUT/timer_te | tail -7
pack timer_te
