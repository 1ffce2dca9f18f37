# FP8 primary weights (fp8.param_gather=true, per-tensor current scaling) through the strategy on
# real TE, two ranks on one GPU (--shared-device; 4-layer cut of configs/gpt_1b_fp8.yaml):
# GTP2 trains 3 steps and saves a NeMo checkpoint; a DP2 fit on TE's own FP8 params (weights
# only) and a GTP2 fit (full resume) load it; each fit's weights right after the load,
# dequantized, against what the saving fit ended with (bench/compare_weights.py, bit for bit).
set -u
source bench/results/2026-12-02_graph_host_1xH200/commands/env.sh
O=$OUT/r3; T=/tmp/r3; CK=/tmp/fp8ck; mkdir -p $O $T
PS="@strategy.ckpt_parallel_save=false@strategy.ckpt_parallel_load=false"  # numpy 2 here
timeout 240 python3 bench/bench_nemo.py --shared-device --tokens 2048 --warmup 1 --timed 2 \
  --modes "gtp2_fp8param@checkpoint.dir=$CK@checkpoint.every_n_train_steps=3$PS" \
  --dump-weights --fit-timeout 200 --out $T/save 2>&1 | tail -2 | cut -c1-300
ls $CK
timeout 300 python3 bench/bench_nemo.py --shared-device --tokens 2048 --warmup 1 --timed 4 \
  --modes "dp2_fp8param@resume=$CK/step=2@strategy.ckpt_load_optimizer=false$PS,gtp2_fp8param@resume=$CK/step=2$PS" \
  --dump-weights --fit-timeout 200 --out $T/load 2>&1 | tail -3 | cut -c1-300
for f in $T/load/weights_*_start.pt; do
  echo "== $(basename $f) vs the saving fit's end"
  python3 bench/compare_weights.py $T/save/weights_*_end.pt $f | tail -12
done | tee $O/compare.txt
for d in save load; do mkdir -p $O/$d; cp $T/$d/*.md $T/$d/*.json $O/$d/; done
