# shard_replicated_params_over_gtp beside context parallelism (built 2026-12-03, CPU-tested
# only): four ranks sharing one GPU, TE's CP attention, the 4-layer cut of the 1B TE recipe at
# 2k tokens per GPU: TP1·CP2·GTP2 with the replicated params' optimizer state over CP x DP x GTP
# (TE linears built full and sliced) vs TP1·CP2·DP2.
set -u
source bench/results/2026-12-03_muon_1xH200/commands/env.sh
mkdir -p $OUT/r3
timeout 400 python3 bench/bench_nemo.py --shared-device --devices 4 \
  --modes "dp2_te@strategy.context_parallel_size=2,gtp2_te@strategy.context_parallel_size=2@preshard_linears=none@shard_replicated_params_over_gtp=true" \
  --tokens 2048 --warmup 2 --timed 10 --fit-timeout 190 --out $OUT/r3/sr_cp 2>&1 | tail -16
