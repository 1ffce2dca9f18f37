# MoE on real TE (TEGroupedMLP, top-2) as ranks sharing cuda:0: EP2·EGTP2 vs EP2·DP2 (4 ranks)
# and EGTP2 vs DP2 (2 ranks), a cut of configs/moe_1b.yaml, numerics only (stage moe of
# bench/gpu_pending.sh with ONE_GPU=1).
set -u
source bench/results/2026-12-02_pm_1xH200/commands/env.sh
ONE_GPU=1 OUT=$OUT bash bench/gpu_pending.sh moe
