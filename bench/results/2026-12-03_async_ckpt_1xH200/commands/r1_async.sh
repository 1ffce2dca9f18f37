# NeMo's asynchronous checkpointing (ckpt_async_save=true, NeMo's default) through
# GTPMegatronStrategy on a GPU, two ranks sharing it (--shared-device; 4-layer cut of
# configs/gpt_1b.yaml, local spec, bf16, distributed optimizer): GTP2 trains 6 steps and saves
# every 3 asynchronously (megatron's D2H copy, then a forked writer while steps 4..6 train; the
# commit at a later step / the train end). Then, in fresh launches, step=2 resumed at GTP2
# (full resume: must end bit for bit where the saving fit ended, and train the same losses) and
# at DP2 (weights: plain megatron cannot describe torch Adam's per-param step in its
# distributed-optimizer formats, and no TE / Apex Adam is here; must start from the same weights).
# MODE=cpu runs the same flow with the *_cpu modes on CPU (the script's check before GPU time).
set -u
[ "${MODE:-gpu}" = cpu ] || source bench/results/2026-12-03_async_ckpt_1xH200/commands/env.sh
G=gtp2_local; D=dp2_local; [ "${MODE:-gpu}" = cpu ] && { G=gtp2_cpu; D=dp2_cpu; }
O=${OUT:-/tmp/out}/r1; T=/tmp/r1; CK=/tmp/asyncck; rm -rf $T $CK; mkdir -p $O $T
PS="@strategy.ckpt_parallel_save=false@strategy.ckpt_parallel_load=false"  # numpy 2 on the GPU box
A="@strategy.ckpt_async_save=true"
timeout 200 python3 bench/bench_nemo.py --shared-device --tokens 2048 --warmup 1 --timed 5 \
  --modes "$G@checkpoint.dir=$CK@checkpoint.every_n_train_steps=3$PS$A" \
  --dump-weights --fit-timeout 180 --out $T/save 2>&1 | tail -2 | cut -c1-300
find $CK -maxdepth 2 | sort | tee $O/checkpoints.txt
timeout 300 python3 bench/bench_nemo.py --shared-device --tokens 2048 --warmup 1 --timed 5 \
  --modes "$G@resume=$CK/step=2$PS,$D@resume=$CK/step=2@strategy.ckpt_load_optimizer=false$PS" \
  --dump-weights --fit-timeout 200 --out $T/load 2>&1 | tail -3 | cut -c1-300
{
  echo "== GTP2 resumed from step=2, its end vs the saving fit's end (bit for bit expected)"
  python3 bench/compare_weights.py $T/save/weights_${G}_*_end.pt $T/load/weights_${G}_resume*_end.pt | tail -6
  echo "== DP2 resumed from step=2, its start vs GTP2's start from the same checkpoint"
  python3 bench/compare_weights.py $T/load/weights_${G}_resume*_start.pt $T/load/weights_${D}_resume*_start.pt | tail -6
} | tee $O/compare.txt
python3 - $T <<'PY' | tee $O/losses.txt
import json, sys
root = sys.argv[1]
for part in ("save", "load"):
    for r in json.load(open(f"{root}/{part}/bench_nemo.json")):
        print(part, r["mode"][:60], "losses", r.get("losses"), "grad norms", r.get("grad_norms"))
PY
for d in save load; do mkdir -p $O/$d; cp $T/$d/*.md $T/$d/*.json $O/$d/ 2>/dev/null; done
