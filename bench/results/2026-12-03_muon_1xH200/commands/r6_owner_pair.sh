# r5's Muon pair again after the teardown fix (release_live_cuda_graphs finds graphs by type):
# GTP2 vs DP2, local spec, orthogonalize="owner" (the default), two ranks sharing the GPU.
set -u
source bench/results/2026-12-03_muon_1xH200/commands/env.sh
mkdir -p $OUT/r6
M="@optim.optimizer=muon@optim.use_distributed_optimizer=false@ddp.use_distributed_optimizer=false"
timeout 250 python3 bench/bench_nemo.py --shared-device \
  --modes "dp2_local$M,gtp2_local$M" \
  --tokens 2048 --warmup 2 --timed 14 --fit-timeout 115 --out $OUT/r6/local 2>&1 | tail -4
