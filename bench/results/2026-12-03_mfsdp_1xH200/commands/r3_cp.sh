# Context parallelism under GTP on real TE (TE's CP attention, p2p ring over the CP group): four
# ranks sharing one GPU through the staged backend (numerics only), the 4-layer cut of the 1B TE
# recipe at 2k tokens per GPU: TP1·CP2·GTP2 (TE linears built full and sliced: the baseline's
# initial weights) vs TP1·CP2·DP2, same global batch.
set -u
source bench/results/2026-12-03_mfsdp_1xH200/commands/env.sh
mkdir -p $OUT/r3
timeout 400 python3 bench/bench_nemo.py --shared-device --devices 4 \
  --modes "dp2_te@strategy.context_parallel_size=2,gtp2_te@strategy.context_parallel_size=2@preshard_linears=none" \
  --tokens 2048 --warmup 2 --timed 10 --fit-timeout 190 --out $OUT/r3/cp 2>&1 | tail -16
