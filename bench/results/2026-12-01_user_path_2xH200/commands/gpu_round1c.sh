#!/usr/bin/env bash
# Round 1c (same machine): NeMo's llama3_8b recipe scaled to ~1B (16 layers, hidden 2048, ffn 8192)
# through with_gtp + NeMo-Run's local executor, 30 steps, GTP2 built from the same initial weights
# as the baseline (preshard_linears=none), then the unconverted recipe at DP2 (--compare-baseline).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
export PYTHONPATH=/tmp/te:/tmp/site:$PWD
T0=$(date +%s)
pack() { (cd $OUT && tar czf $1.tgz $1 && rm -rf $1); }
mkdir -p $OUT/r1_llama
NEMORUN_HOME=$OUT/r1_llama/nemo_run timeout 200 python3 -m nemo_gtp.run $(cat bench/results/2026-12-01_user_path_2xH200/commands/llama_1b_args.txt) \
  --dir $OUT/r1_llama/exp --plot $OUT/r1_llama/loss.png --loss-log $OUT/r1_llama/gtp.jsonl > $OUT/r1_llama/llama.out 2>&1
echo "llama exit $? t=$(( $(date +%s) - T0 )) s"; grep -v "^ma3_8b\|^\s*$" $OUT/r1_llama/llama.out | tail -30
find $OUT/r1_llama -name "*.log" -size +2M -delete; pack r1_llama
