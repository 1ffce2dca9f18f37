# Expert GTP beside context parallelism on real TE (TEGroupedMLP experts, TE's CP attention):
# four ranks sharing one GPU through the staged backend (numerics only), the cut of
# configs/moe_1b.yaml: EP2·EGTP2·CP2 vs EP2·(expert DP2)·CP2, same initial weights.
set -u
source bench/results/2026-12-03_mfsdp_1xH200/commands/env.sh
mkdir -p $OUT/r5
timeout 400 python3 bench/bench_moe.py --shared-device --timeout 390 \
  --modes "grouped_ep2_dp2@strategy.context_parallel_size=2,grouped_ep2_egtp2@strategy.context_parallel_size=2" \
  --out $OUT/r5/moe_cp 2>&1 | tail -12
