#!/usr/bin/env bash
# Round 3b (same machine, TE in /tmp/te): a scaled Llama 3 recipe through with_gtp + NeMo-Run
# (GTP2, then its DP2 baseline, in one launch), and the full-iteration CUDA graph for DP2 and
# GTP2 (the DP2 graph baseline NeMo alone cannot build).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
export PYTHONPATH=/tmp/te:/tmp/site:$PWD
T0=$(date +%s)
mkdir -p $OUT/r3b
NEMORUN_HOME=$OUT/r3b/nemo_run timeout 260 python3 -m nemo_gtp.run $(cat bench/results/2026-11-30_te_path_2xH200/commands/llama_args.txt) \
  --dir $OUT/r3b/llama --plot $OUT/r3b/llama/loss.png --loss-log $OUT/r3b/llama/gtp.jsonl > $OUT/r3b/llama.out 2>&1
echo "llama exit $? t=$(( $(date +%s) - T0 )) s"; grep -v "^ma3_8b\|^\s*$" $OUT/r3b/llama.out | tail -50
LEFT=$(( 560 - ($(date +%s) - T0) ))
timeout $LEFT python3 bench/bench_nemo.py --modes dp2_te@graph,gtp2_te@graph --tokens 2048,4096 \
  --warmup 5 --timed 15 --out $OUT/r3b/graph | tail -8
echo "all done $(( $(date +%s) - T0 )) s"
find $OUT/r3b/nemo_run -name "*.log" -size +3M -delete
cd $OUT && tar czf r3b.tgz r3b && rm -rf r3b
