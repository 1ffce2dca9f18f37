# The shared-device parity pair after this session's strategy changes (async-save commit,
# train-end / teardown hooks): GTP2 vs DP2, 4-layer cut of configs/gpt_1b.yaml, local spec,
# same initial weights, 12 steps; success = "PARITY ... match".
set -u
source bench/results/2026-12-03_async_ckpt_1xH200/commands/env.sh
O=${OUT:-/tmp/out}/r2; mkdir -p $O
timeout 200 python3 bench/bench_nemo.py --shared-device --tokens 2048 --warmup 2 --timed 10 \
  --modes dp2_local,gtp2_local --fit-timeout 180 --out $O 2>&1 | tail -6 | cut -c1-400
