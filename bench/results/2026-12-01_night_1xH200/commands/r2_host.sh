# GTP's host time inside a NeMo step, TE spec, 2k tokens, fake 2-rank world: the session's start
# (.te_old) vs now, interleaved twice, DP2 once; then the TE spec GTP2 vs DP2 numerics with both
# ranks on the GPU (staged collectives), same initial weights.
set -u
source bench/results/2026-12-01_night_1xH200/commands/env.sh
O=$OUT/r2; mkdir -p $O
timeout 120 python3 bench/host_fake.py --modes dp2_te --tokens 2048 --profile 0 --steps 15 --out $O/dp2 | tail -1
for i in 1 2; do
  timeout 120 python3 bench/host_fake.py --modes gtp2_te --tokens 2048 --profile 0 --steps 15 --out $O/new$i | tail -1
  (cd .te_old && PYTHONPATH=/tmp/te:/tmp/site:$PWD timeout 120 python3 bench/host_fake.py --modes gtp2_te --tokens 2048 --profile 0 --steps 15 --out $O/old$i | tail -1)
done
timeout 200 python3 bench/bench_nemo.py --shared-device --modes dp2_te,gtp2_te@preshard_linears=none \
  --tokens 2048 --warmup 2 --timed 18 --fit-timeout 150 --out $O/sd_te 2>&1 | tail -6
(cd $OUT && tar czf r2.tgz r2 && rm -rf r2)
