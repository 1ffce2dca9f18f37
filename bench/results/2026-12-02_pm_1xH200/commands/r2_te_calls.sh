# Which TE calls run slower in a GTP2 fit than in a DP2 fit (the non-GTP host time of earlier
# rounds): TE's Python entry points and every transformer_engine_torch C++ function timed in
# the process (%te), TE's GEMMs per variant; DP2 and GTP2 TE at 2k, fake 2-rank world,
# interleaved, two repeats.
set -u
source bench/results/2026-12-02_pm_1xH200/commands/env.sh
O=$OUT/r2; mkdir -p $O
timeout 560 python3 bench/host_fake.py --modes dp2_te%te,gtp2_te%te --tokens 2048 --repeat 2 \
  --profile 0 --steps 15 --out $O 2>&1 | grep -v "^{" | tail -10
(cd $OUT && tar czf r2.tgz r2 && rm -rf r2)
