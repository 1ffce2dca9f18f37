# GTP2 TE at 2k tokens in the fake 2-rank world: the current host path vs the old one restored
# in the same launch (%general: every protocol consume on the general path; %flatten: the
# replicated grads' flatten all-reduce), DP2 as the twin; interleaved, two repeats.
set -u
source bench/results/2026-12-02_1xH200/commands/env.sh
O=$OUT/r2; mkdir -p $O
timeout 570 python3 bench/host_fake.py --modes dp2_te,gtp2_te,gtp2_te%general%flatten \
  --tokens 2048 --repeat 2 --profile 0 --steps 15 --out $O 2>&1 | grep -v "^{" | tail -12
(cd $OUT && tar czf r2.tgz r2 && rm -rf r2)
