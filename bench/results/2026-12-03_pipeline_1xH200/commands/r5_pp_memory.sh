# Peak memory per rank under PP against the planner (python -m nemo_gtp.plan configs/gpt_1b.yaml
# --pipeline-parallel 2): the full 1B recipe (local spec, no TE needed), 4k tokens per GPU,
# PP2·DP2 and PP2·GTP2 with 2 microbatches per step (= PP: the first stage's 1F1B warm-up keeps
# both in flight), four ranks sharing one H200; each rank's own allocator peak (rank 0: stage 0).
set -u
source bench/results/2026-12-03_pipeline_1xH200/commands/env.sh
mkdir -p $OUT/r5
PP="@strategy.pipeline_model_parallel_size=2@data.global_batch_size=8"
timeout 500 python3 bench/bench_nemo.py --shared-device --full-size --devices 4 \
  --modes "dp2_local$PP,gtp2_local$PP" \
  --tokens 4096 --warmup 2 --timed 4 --fit-timeout 230 --out $OUT/r5 2>&1 | tail -9
