#!/usr/bin/env bash
# Round 5 (2xH200, fresh machine): the rows never run before: eager 1k with NeMo's Megatron-FSDP
# (mfsdp_te) as the second baseline, and 8k (nothing slower at large token counts), TE spec.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
T0=$(date +%s)
mkdir -p .whl && cp /root/tw/whl/* .whl/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl/*.tar.gz .whl/*.zip 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
bash bench/te_build.sh > $OUT/te_build.log 2>&1; tail -1 $OUT/te_build.log
export PYTHONPATH=/tmp/te:/tmp/site:$PWD
pack() { (cd $OUT && tar czf $1.tgz $1 && rm -rf $1); echo "$1 done $(( $(date +%s) - T0 )) s"; }
timeout 130 python3 bench/bench_nemo.py --modes dp2_te,gtp2_te,mfsdp_te --tokens 1024 \
  --warmup 5 --timed 19 --fit-timeout 50 --out $OUT/rows_1k | tail -6
pack rows_1k
timeout 110 python3 bench/bench_nemo.py --modes dp2_te,gtp2_te --tokens 8192 \
  --warmup 5 --timed 15 --fit-timeout 50 --out $OUT/rows_8k | tail -5
pack rows_8k
