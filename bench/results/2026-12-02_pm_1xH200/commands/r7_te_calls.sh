# r2 again with TE's entry points really timed (r2's %te found no TE: transformer_engine_torch
# imported before TE's core library), one repeat; then the 4-rank MoE pair after the staged
# backend's numpy split-size fix (r3: it failed on megatron's numpy split sizes).
set -u
source bench/results/2026-12-02_pm_1xH200/commands/env.sh
O=$OUT/r7; mkdir -p $O
timeout 300 python3 bench/host_fake.py --modes dp2_te%te,gtp2_te%te --tokens 2048 \
  --profile 0 --steps 15 --out $O 2>&1 | grep -v "^{" | tail -6
grep -h "TE_ENTRIES" $O/*.log
timeout 200 python3 bench/bench_moe.py --shared-device \
  --modes grouped_ep2_dp2,grouped_ep2_egtp2 --timeout 190 --out $O/moe_ep2 | tail -4
(cd $OUT && tar czf r7.tgz r7 && rm -rf r7)
