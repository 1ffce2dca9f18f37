# Why the one-frame dense consume is not taken in the NeMo TE fit (r2: 192 general-path
# materialize calls per step with it on): the bail reasons counted (%why), one GTP2 run.
set -u
source bench/results/2026-12-02_1xH200/commands/env.sh
O=$OUT/r3; mkdir -p $O
timeout 300 python3 bench/host_fake.py --modes gtp2_te%why --tokens 2048 --profile 0 --steps 15 \
  --out $O 2>&1 | grep -v "^{" | tail -4
grep -h "DENSE_BAILS\|Error" $O/*.log | tail -5
