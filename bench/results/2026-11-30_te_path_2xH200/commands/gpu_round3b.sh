#!/usr/bin/env bash
# Round 3b (same machine, TE in /tmp/te): a scaled Llama 3 recipe through with_gtp + NeMo-Run
# (GTP2 then its DP2 baseline in one launch); MoE with TEGroupedMLP experts (EP1·EGTP2 vs EP2,
# EP1·DP2); FP8 gathers under TE's FP8 current scaling (GTP2 vs DP2). Each stage packed at once.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
export PYTHONPATH=/tmp/te:/tmp/site:$PWD
T0=$(date +%s)
pack() { (cd $OUT && tar czf $1.tgz $1 && rm -rf $1); }
mkdir -p $OUT/r3_llama
NEMORUN_HOME=$OUT/r3_llama/nemo_run timeout 120 python3 -m nemo_gtp.run $(cat bench/results/2026-11-30_te_path_2xH200/commands/llama_args.txt) \
  --dir $OUT/r3_llama/exp --plot $OUT/r3_llama/loss.png --loss-log $OUT/r3_llama/gtp.jsonl > $OUT/r3_llama/llama.out 2>&1
echo "llama exit $? t=$(( $(date +%s) - T0 )) s"; grep -v "^ma3_8b\|^\s*$" $OUT/r3_llama/llama.out | tail -30
find $OUT/r3_llama -name "*.log" -size +2M -delete; pack r3_llama
timeout 110 python3 bench/bench_moe.py --modes grouped_dp2,grouped_egtp2,grouped_ep2 --timeout 100 --out $OUT/r3_moe 2>&1 | tail -12
echo "moe done $(( $(date +%s) - T0 )) s"; pack r3_moe
timeout 115 torchrun --nproc-per-node 2 bench/gpu_fp8_check.py --out $OUT/r3_fp8 2>&1 | grep -v Warning | tail -15
echo "fp8 done $(( $(date +%s) - T0 )) s"; pack r3_fp8
