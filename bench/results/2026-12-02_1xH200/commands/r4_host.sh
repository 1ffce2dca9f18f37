# After the fix (the one-frame consume asks TE's inert FP8-gather consumer instead of bailing on
# it): GTP2 TE 2k, new path (%why: counts that the fast path is taken) vs the old one restored
# (%general%flatten), DP2 as the twin; interleaved, two repeats, one launch.
set -u
source bench/results/2026-12-02_1xH200/commands/env.sh
O=$OUT/r4; mkdir -p $O
timeout 570 python3 bench/host_fake.py --modes dp2_te,gtp2_te%why,gtp2_te%general%flatten \
  --tokens 2048 --repeat 2 --profile 0 --steps 15 --out $O 2>&1 | grep -v "^{" | tail -12
grep -h "DENSE_BAILS" $O/*.log
(cd $OUT && tar czf r4.tgz r4 && rm -rf r4)
