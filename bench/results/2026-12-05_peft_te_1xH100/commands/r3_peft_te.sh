# LoRA on TransformerEngine linears under GTP, on one GPU with two ranks sharing it
# (--shared-device: 4-layer, hidden-1024 cut of configs/gpt_1b_te.yaml, bf16, NeMo's default TE
# layer spec; numerics only). 1. DP2 pretrains 3 steps and saves (weights). 2. NeMo's LoRA
# from that checkpoint (+restore), 15 steps: GTP2 with TE linears built as their shards (TE's
# default) saving adapter checkpoints every 5 steps asynchronously (NeMo's default), and DP2.
# (GTP2 with TE linears built full and sliced vs DP2, same initial weights, ran in round 1.) 3. Its step-10 adapter checkpoint resumed in fresh launches at GTP2 (must end bit
# for bit where the saving fit ended) and at DP2 (weights only: same first loss).
# MODE=cpu: the *_cpu modes on CPU, no TE (the script's check before GPU time).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
T0=$(date +%s); PY=python3; D=dp2_te; G=gtp2_te; PRE=""  # TE linears: built as shards
if [ "${MODE:-gpu}" = cpu ]; then  # megatron-local linears built as shards too
  PY=.venv/bin/python; D=dp2_cpu; G=gtp2_cpu; PRE="@preshard_linears=all"; export PYTHONPATH=$PWD
else  # the wheels and TE, unless already there
  source bench/device_env.sh
fi
echo "setup $(( $(date +%s) - T0 )) s"
O=$OUT/r1; T=/tmp/r1; rm -rf $T; mkdir -p $O $T
PS="@strategy.ckpt_parallel_save=false@strategy.ckpt_parallel_load=false"  # numpy 2 here
B="--shared-device --tokens 2048"
timeout 120 $PY bench/bench_nemo.py $B --warmup 1 --timed 2 --fit-timeout 110 \
  --modes "$D@checkpoint.dir=$T/pre@checkpoint.every_n_train_steps=3@strategy.ckpt_save_optimizer=false$PS" \
  --out $T/pre_run 2>&1 | tail -1 | cut -c1-300
P=$(ls -d $T/pre/step=* | sort -t= -k2 -n | tail -1); echo "pretrained: $P"
echo "step1 $(( $(date +%s) - T0 )) s"
L="@peft.method=lora@restore=$P$PS"
A="@checkpoint.dir=$T/ad@checkpoint.every_n_train_steps=5@strategy.ckpt_async_save=true"
# One launch: GTP2 saving adapter checkpoints first (NeMo's telemetry failed a checkpointing
# fit after other fits in a process, before configure_nemo_telemetry handled it), then DP2.
timeout 250 $PY bench/bench_nemo.py $B --warmup 2 --timed 13 --fit-timeout 120 --dump-weights \
  --modes "$G$L$PRE$A,$D$L" --out $T/save 2>&1 | grep -E "PARITY|failed" | cut -c1-600 \
  | tee $O/parity.txt
find $T/ad -maxdepth 3 | sort | tee $O/checkpoints.txt
echo "step2 $(( $(date +%s) - T0 )) s"
R="@resume=$T/ad/step=9"
timeout 180 $PY bench/bench_nemo.py $B --warmup 2 --timed 13 --fit-timeout 120 --dump-weights \
  --modes "$G$L$PRE$R,$D$L$R@strategy.ckpt_load_optimizer=false" --out $T/load 2>&1 \
  | tail -1 | cut -c1-300
{
  echo "== GTP2 resumed from its step-10 adapter checkpoint: its end vs the saving fit's end"
  $PY bench/compare_weights.py $T/save/weights_${G}*_end.pt $T/load/weights_${G}*_end.pt | tail -3
  echo "== DP2 resumed from it (weights only): its first batch's weights vs GTP2's"
  $PY bench/compare_weights.py $T/load/weights_${G}*_start.pt $T/load/weights_${D}*_start.pt | tail -3
} 2>&1 | tee $O/compare.txt
$PY - $T <<'PY' | tee $O/losses.txt
import json, sys
root = sys.argv[1]
for part in ("pre_run", "save", "load"):
    try:
        rows = json.load(open(f"{root}/{part}/bench_nemo.json"))
    except Exception as err:
        print(part, "no json", err); continue
    for r in rows:
        mode = r["mode"].replace(root, "")
        print(part, mode, r.get("error", "")[:300], "losses", r.get("losses"), "grad norms", r.get("grad_norms"))
    if part == "save" and all(r.get("losses") for r in rows):  # GTP2 vs its DP2 baseline
        g, d = rows[0]["losses"], rows[1]["losses"]
        rel = max(abs(x - y) / abs(y) for x, y in zip(g, d))
        print(f"GTP2 vs DP2 LoRA: {len(g)} steps, step-0 loss {g[0]} / {d[0]}, max rel loss diff {rel:.2e}")
PY
for d in pre_run save load; do mkdir -p $O/$d; cp $T/$d/*.md $T/$d/*.json $O/$d/ 2>/dev/null; done
echo "done $(( $(date +%s) - T0 )) s"
