# Blockwise FP8 primary weights through GTPMegatronStrategy (configs/gpt_1b_fp8.yaml
# fp8.recipe=blockwise fp8.param_gather=true, 4-layer cut, two ranks on one GPU): GTP2 vs DP2
# parity; then GTP2 saves a NeMo checkpoint after 3 steps, DP2 on TE's own blockwise FP8 params
# (weights only) and GTP2 (full resume) load it: each fit's weights right after the load,
# dequantized, against what the saving fit ended with (bench/compare_weights.py).
set -u
source bench/results/2026-12-02_fp8_block_primary_1xH200/commands/env.sh
O=$OUT/r4; T=/tmp/r4; CK=/tmp/fp8bck; mkdir -p $O $T
PS="@strategy.ckpt_parallel_save=false@strategy.ckpt_parallel_load=false"  # numpy 2 here
timeout 200 python3 bench/bench_nemo.py --shared-device --tokens 2048 --warmup 2 --timed 8 \
  --modes dp2_fp8blockparam,gtp2_fp8blockparam --fit-timeout 90 --out $T/pair 2>&1 \
  | grep -E "PARITY|GATHER|Error|error" | cut -c1-300
timeout 170 python3 bench/bench_nemo.py --shared-device --tokens 2048 --warmup 1 --timed 2 \
  --modes "gtp2_fp8blockparam@checkpoint.dir=$CK@checkpoint.every_n_train_steps=3$PS" \
  --dump-weights --fit-timeout 150 --out $T/save 2>&1 | tail -2 | cut -c1-300
ls $CK
timeout 220 python3 bench/bench_nemo.py --shared-device --tokens 2048 --warmup 1 --timed 4 \
  --modes "dp2_fp8blockparam@resume=$CK/step=2@strategy.ckpt_load_optimizer=false$PS,gtp2_fp8blockparam@resume=$CK/step=2$PS" \
  --dump-weights --fit-timeout 100 --out $T/load 2>&1 | tail -3 | cut -c1-300
for f in $T/load/weights_*_start.pt; do
  echo "== $(basename $f) vs the saving fit's end"
  python3 bench/compare_weights.py $T/save/weights_*_end.pt $f | tail -12
done | tee $O/compare.txt
for d in pair save load; do mkdir -p $O/$d; cp $T/$d/*.md $T/$d/*.json $O/$d/ 2>/dev/null; done
