#!/usr/bin/env bash
# Round 1b (same machine, TE in /tmp/te): the TE-spec strategy check (gpu_strategy_checks.sh
# step 0), a scaled Llama 3 recipe through with_gtp + NeMo-Run (GTP2 then its DP2 baseline), and
# the GTP communicator's NCCL options on the TE path at 2k tokens per GPU.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
export PYTHONPATH=/tmp/te:/tmp/site:$PWD
T0=$(date +%s)
mkdir -p $OUT/r1b
timeout 150 python3 -m nemo_gtp.run configs/gpt_1b_te.yaml trainer.max_steps=10 model.num_layers=4 \
  --compare-baseline > $OUT/r1b/te_spec_compare.out 2>&1; echo "te_spec_compare exit $?"
tail -25 $OUT/r1b/te_spec_compare.out
echo "t=$(( $(date +%s) - T0 )) s"
NEMORUN_HOME=$OUT/r1b/nemo_run timeout 240 python3 -m nemo_gtp.run $(cat bench/results/2026-11-30_te_path_2xH200/commands/llama_args.txt) \
  --dir $OUT/r1b/llama --plot $OUT/r1b/llama/loss.png --loss-log $OUT/r1b/llama/gtp.jsonl > $OUT/r1b/llama.out 2>&1
echo "llama exit $?"; tail -60 $OUT/r1b/llama.out
echo "t=$(( $(date +%s) - T0 )) s"
LEFT=$(( 570 - ($(date +%s) - T0) ))
timeout $LEFT python3 bench/bench_nemo.py --modes dp2_te,gtp2_te@nccl_max_ctas=8,gtp2_te@nccl_high_priority_stream=true,gtp2_te \
  --tokens 2048 --warmup 5 --timed 15 --out $OUT/r1b/knobs
grep -h '^{' $OUT/r1b/knobs/rank0.log | cut -c1-400 > $OUT/r1b/records.txt
find $OUT/r1b/nemo_run -name "*.log" -size -2M | head -20 > $OUT/r1b/nemo_run_logs.txt
cd $OUT && tar czf r1b.tgz r1b && rm -rf r1b
