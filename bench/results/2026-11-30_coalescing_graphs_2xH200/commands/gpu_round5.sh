#!/usr/bin/env bash
# Round 5 (2xH200): TE build; full-iteration graph under GTP (TE and local spec); TE copy engine;
# then what is left of the call for the largest-model sweep (gtp2, dp2).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl/*.tar.gz .whl/*.zip 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r5
bash bench/te_build.sh > $OUT/r5/te_build.log 2>&1; tail -1 $OUT/r5/te_build.log
echo "te build done $(( $(date +%s) - T0 )) s"
export PYTHONPATH=/tmp/te:/tmp/site:$PWD
timeout 270 python3 bench/bench_nemo.py --modes gtp2_te@graph,gtp2_te,gtp2_te@copy_engine_min_tokens=0,dp2_te,gtp2_local@graph,dp2_local --tokens 2048 --warmup 5 --timed 15 --out $OUT/r5/nemo
echo "nemo done $(( $(date +%s) - T0 )) s"
grep -h "Capture CUDA graph\|CUDA graph capture\|full-iteration\|Error" $OUT/r5/nemo/rank0.log | head -8
cat $OUT/r5/nemo/bench_nemo.md
LEFT=$(( 515 - ($(date +%s) - T0) ))
echo "left for max model: $LEFT s"
if [ $LEFT -gt 90 ]; then
  PYTHONPATH=/tmp/site:$PWD timeout $LEFT python3 bench/bench_max_model.py --modes gtp2,dp2 --budget-s $(( LEFT - 15 )) --out $OUT/r5/max_model > $OUT/r5/max_model.log 2>&1
  tail -15 $OUT/r5/max_model.log; cat $OUT/r5/max_model/max_model.md
fi
cd $OUT && tar czf r5.tgz r5 && rm -rf r5
