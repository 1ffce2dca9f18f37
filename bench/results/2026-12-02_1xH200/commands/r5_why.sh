# r4 ran on a fresh machine without TE (the local spec: nothing to count); with TE again, the
# fixed one-frame consume's bail reasons (%why), one GTP2 run.
set -u
source bench/results/2026-12-02_1xH200/commands/env.sh
O=$OUT/r5; mkdir -p $O
ls /tmp/te/transformer_engine >/dev/null || echo "NO TE"
timeout 200 python3 bench/host_fake.py --modes gtp2_te%why --tokens 2048 --profile 0 --steps 10 \
  --out $O 2>&1 | grep -v "^{" | tail -4
grep -h "DENSE_BAILS" $O/*.log
