#!/usr/bin/env bash
# Round 2 (2xH200, no TE): the largest-model rows still missing (FSDP2, GTP2 with sharded
# replicated params, Megatron-FSDP) and GTP2 + full recompute at GTP2's largest size.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl/*.tar.gz .whl/*.zip 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r2
echo "install $(( $(date +%s) - T0 )) s"
timeout 420 python3 bench/bench_max_model.py --modes gtp2,gtp2_recompute,fsdp2,gtp2_srp,mfsdp \
  --max-probes 2 --budget-s 380 --out $OUT/r2/max_model > $OUT/r2/max_model.log 2>&1
tail -25 $OUT/r2/max_model.log; cat $OUT/r2/max_model/max_model.md
cd $OUT && tar czf r2.tgz r2 && rm -rf r2
