# After the fix of the one-frame consume: GTP2 TE 2k host time in the fake world, the session's
# start (.te_old) vs now, alternated three times starting with the old tree (order bias).
set -u
source bench/results/2026-12-01_night_1xH200/commands/env.sh
O=$OUT/r4; mkdir -p $O
for i in 1 2 3; do
  (cd .te_old && PYTHONPATH=/tmp/te:/tmp/site:$PWD timeout 110 python3 bench/host_fake.py --modes gtp2_te --tokens 2048 --profile 0 --steps 15 --out $O/old$i | tail -1)
  timeout 110 python3 bench/host_fake.py --modes gtp2_te --tokens 2048 --profile 0 --steps 15 --out $O/new$i | tail -1
done
(cd $OUT && tar czf r4.tgz r4 && rm -rf r4)
