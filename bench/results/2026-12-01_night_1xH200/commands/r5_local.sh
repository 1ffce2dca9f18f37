# Local spec, fake world, 2k: the session's start (.te_old: waits timed every step) vs now
# (timed on logged steps only, every 10), alternated.
set -u
source bench/results/2026-12-01_night_1xH200/commands/env.sh
O=$OUT/r5; mkdir -p $O
for i in 1 2; do
  (cd .te_old && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 bench/host_fake.py --modes gtp2_local --tokens 2048 --profile 0 --steps 15 --out $O/old$i | tail -1)
  PYTHONPATH=/tmp/site:$PWD timeout 60 python3 bench/host_fake.py --modes gtp2_local --tokens 2048 --profile 0 --steps 15 --out $O/new$i | tail -1
done
(cd $OUT && tar czf r5.tgz r5 && rm -rf r5)
