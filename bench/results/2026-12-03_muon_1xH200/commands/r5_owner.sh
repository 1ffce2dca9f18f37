# After orthogonalize="owner" became the default (each matrix orthogonalized by one GTP peer,
# two all-to-alls): (a) the Muon GTP2 vs DP2 pair again, local spec (no TE needed: the optimizer
# path is the same), two ranks sharing the GPU (numerics); (b) the GPU time of the Newton-Schulz
# work per optimizer step for the 1B recipe's 96 matrices, all of them (every_rank, and a DP
# replica without GTP) vs rank 0's owned share at GTP 2 and 4 (no collective).
set -u
source bench/results/2026-12-03_muon_1xH200/commands/env.sh
mkdir -p $OUT/r5
M="@optim.optimizer=muon@optim.use_distributed_optimizer=false@ddp.use_distributed_optimizer=false"
timeout 250 python3 bench/bench_nemo.py --shared-device \
  --modes "dp2_local$M,gtp2_local$M" \
  --tokens 2048 --warmup 2 --timed 14 --fit-timeout 115 --out $OUT/r5/local 2>&1 | tail -5
# (first run: the GTP2 fit never started, the teardown after the DP2 fit died on a machine
# without TE: data/r5/r5_local_rank1_teardown_failure.log; fixed, then r6_owner_pair.sh)
timeout 200 python3 bench/muon_step.py --out $OUT/r5/muon_step.json
