# Muon (design §1.6) through NeMo on real TE, two ranks sharing one GPU through the staged
# backend (numerics only), the 4-layer cut of the 1B recipes at 2k tokens per GPU, bf16 with
# megatron's mixed-precision wrapper (fp32 masters) and bf16 Newton-Schulz: GTP2 vs DP2 with the
# same optimizer (MuonOptimizerModule; Adam for embeddings, norms, output layer), TE spec (TE
# linears built full and sliced: the baseline's initial weights) and local spec.
set -u
source bench/results/2026-12-03_muon_1xH200/commands/env.sh
mkdir -p $OUT/r2
M="@optim.optimizer=muon@optim.use_distributed_optimizer=false@ddp.use_distributed_optimizer=false"
timeout 280 python3 bench/bench_nemo.py --shared-device \
  --modes "dp2_te$M,gtp2_te$M@preshard_linears=none" \
  --tokens 2048 --warmup 2 --timed 14 --fit-timeout 130 --out $OUT/r2/te 2>&1 | tail -14
timeout 250 python3 bench/bench_nemo.py --shared-device \
  --modes "dp2_local$M,gtp2_local$M" \
  --tokens 2048 --warmup 2 --timed 14 --fit-timeout 115 --out $OUT/r2/local 2>&1 | tail -14
