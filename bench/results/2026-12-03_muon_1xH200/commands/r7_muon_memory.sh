# Peak memory per rank with Muon on the full 1B recipe (local spec, 4k tokens per GPU), two
# ranks sharing the GPU (each rank's own allocator peak; step times meaningless): DP2 (every
# replica keeps whole Muon state: fp32 masters + momenta) vs GTP2 (1/GTP of it, plus the
# step's buckets), against python -m nemo_gtp.plan --optimizer muon.
set -u
source bench/results/2026-12-03_muon_1xH200/commands/env.sh
mkdir -p $OUT/r7
M="@optim.optimizer=muon@optim.use_distributed_optimizer=false@ddp.use_distributed_optimizer=false"
timeout 420 python3 bench/bench_nemo.py --shared-device --full-size \
  --modes "dp2_local$M,gtp2_local$M" \
  --tokens 4096 --warmup 2 --timed 4 --fit-timeout 200 --out $OUT/r7/mem 2>&1 | tail -12
