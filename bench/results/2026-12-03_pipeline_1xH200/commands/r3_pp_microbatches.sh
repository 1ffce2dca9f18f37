# r2 again with 4 microbatches per step (r2's default global batch gave 1 per step at PP2 on 4
# ranks, so no forward ran before another microbatch's backward, and the interleaved schedule
# refused it: megatron needs >= PP microbatches there): NeMo's 1F1B with stage 0 running two
# forwards before its first backward, and the interleaved schedule with two chunks per rank.
set -u
source bench/results/2026-12-03_pipeline_1xH200/commands/env.sh
mkdir -p $OUT/r3
PP="@strategy.pipeline_model_parallel_size=2@data.global_batch_size=8"
timeout 280 python3 bench/bench_nemo.py --shared-device --devices 4 \
  --modes "dp2_te$PP,gtp2_te$PP@preshard_linears=none" \
  --tokens 2048 --warmup 2 --timed 8 --fit-timeout 130 --out $OUT/r3/pp 2>&1 | tail -9
VP="$PP@strategy.virtual_pipeline_model_parallel_size=2"
timeout 280 python3 bench/bench_nemo.py --shared-device --devices 4 \
  --modes "dp2_te$VP,gtp2_te$VP@preshard_linears=none" \
  --tokens 2048 --warmup 2 --timed 8 --fit-timeout 130 --out $OUT/r3/vpp 2>&1 | tail -9
