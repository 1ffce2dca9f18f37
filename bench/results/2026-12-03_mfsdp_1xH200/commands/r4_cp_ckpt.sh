# A checkpoint of a GTP2·CP2 fit (its CP peers are replicas of its shards: one writes each
# replicated tensor) on real TE, four ranks sharing one GPU (4-layer cut of the 1B TE recipe):
# GTP2·CP2 trains 3 steps and saves a NeMo checkpoint; CP2·DP2 (no GTP, weights only) and
# GTP2·CP2 (full resume) load it; each fit's weights right after the load against what the
# saving fit ended with (bench/compare_weights.py, bit for bit).
set -u
source bench/results/2026-12-03_mfsdp_1xH200/commands/env.sh
O=$OUT/r4; T=/tmp/r4; CK=/tmp/cpck; mkdir -p $O $T
CP="@strategy.context_parallel_size=2"
PS="@strategy.ckpt_parallel_save=false@strategy.ckpt_parallel_load=false"  # numpy 2 here
timeout 240 python3 bench/bench_nemo.py --shared-device --devices 4 --tokens 2048 --warmup 1 \
  --timed 2 --modes "gtp2_te$CP@checkpoint.dir=$CK@checkpoint.every_n_train_steps=3$PS" \
  --dump-weights --fit-timeout 200 --out $T/save 2>&1 | tail -2 | cut -c1-300
ls $CK
timeout 300 python3 bench/bench_nemo.py --shared-device --devices 4 --tokens 2048 --warmup 1 \
  --timed 4 --modes "dp2_te$CP@resume=$CK/step=2@strategy.ckpt_load_optimizer=false$PS,gtp2_te$CP@resume=$CK/step=2$PS" \
  --dump-weights --fit-timeout 200 --out $T/load 2>&1 | tail -3 | cut -c1-300
for f in $T/load/weights_*_start.pt; do
  echo "== $(basename $f) vs the saving fit's end"
  python3 bench/compare_weights.py $T/save/weights_*_end.pt $f | tail -12
done | tee $O/compare.txt
for d in save load; do mkdir -p $O/$d; cp $T/$d/*.md $T/$d/*.json $O/$d/; done
