# Muon on routed experts (design §1.6): TEGroupedMLP experts (real TE GroupedLinear, one 2D
# weight per expert) under expert GTP, two ranks sharing one GPU (numerics only), the cut of the
# MoE recipe: EGTP2 vs EP1·DP2, both with MuonOptimizerModule (expert matrices orthogonalized
# whole: their Muon inputs gathered over EGTP).
set -u
source bench/results/2026-12-03_muon_1xH200/commands/env.sh
mkdir -p $OUT/r4
M="@optim.optimizer=muon@optim.use_distributed_optimizer=false@ddp.use_distributed_optimizer=false"
timeout 250 python3 bench/bench_moe.py --shared-device --modes "grouped_dp2$M,grouped_egtp2$M" \
  --timeout 240 --out $OUT/r4/moe 2>&1 | tail -8
