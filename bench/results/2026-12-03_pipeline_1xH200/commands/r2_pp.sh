# Pipeline parallelism under GTP (design §1.4 "PP") through NeMo on real TE, four ranks sharing
# one GPU through the staged backend (numerics only), the 4-layer cut of the 1B TE recipe at 2k
# tokens per GPU, bf16, tied embeddings (NeMo's default; the GPU path: megatron all-reduces the
# embedding grads between the first and last stage):
#  a) PP2·GTP2 vs PP2·DP2, NeMo's 1F1B schedule: TE linears built full and sliced (the
#     baseline's initial weights), and built as GTP shards (their own init: statistical);
#  b) the same pair with two model chunks per rank (interleaved schedule, 1 layer per chunk).
set -u
source bench/results/2026-12-03_pipeline_1xH200/commands/env.sh
mkdir -p $OUT/r2
PP="@strategy.pipeline_model_parallel_size=2"
timeout 290 python3 bench/bench_nemo.py --shared-device --devices 4 \
  --modes "dp2_te$PP,gtp2_te$PP@preshard_linears=none,gtp2_te$PP" \
  --tokens 2048 --warmup 2 --timed 10 --fit-timeout 90 --out $OUT/r2/pp 2>&1 | tail -12
VP="$PP@strategy.virtual_pipeline_model_parallel_size=2"
timeout 250 python3 bench/bench_nemo.py --shared-device --devices 4 \
  --modes "dp2_te$VP,gtp2_te$VP@preshard_linears=none" \
  --tokens 2048 --warmup 2 --timed 10 --fit-timeout 110 --out $OUT/r2/vpp 2>&1 | tail -12
