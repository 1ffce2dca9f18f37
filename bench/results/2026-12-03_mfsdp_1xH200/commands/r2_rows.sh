# (a) Does NeMo's Megatron-FSDP (MegatronStrategy fsdp="megatron" + megatron-core 0.15's FSDP)
#     set up and train on this stack? One GPU: a one-rank world (DP1), the 1B TE recipe at 4k
#     tokens, beside plain DP1 in the same launch. (b) The CLI on a GPU after the metrics
#     callback's direct logging: the TE recipe on one GPU without GTP, every step logged, read
#     back by the report.
set -u
source bench/results/2026-12-03_mfsdp_1xH200/commands/env.sh
mkdir -p $OUT/r2
timeout 330 python3 bench/bench_nemo.py --devices 1 --modes dp2_te,mfsdp_te --tokens 4096 \
  --warmup 5 --timed 15 --fit-timeout 150 --out $OUT/r2/mfsdp 2>&1 | tail -25
timeout 200 python3 -m nemo_gtp.run configs/gpt_1b_te.yaml trainer.devices=1 \
  strategy.num_weight_shards=1 trainer.max_steps=12 trainer.log_every_n_steps=1 \
  data.seq_length=2048 data.micro_batch_size=2 data.global_batch_size=2 \
  --log-dir $OUT/r2/cli > $OUT/r2/cli.txt 2>&1; echo "cli exit $?"; tail -6 $OUT/r2/cli.txt
python3 -m nemo_gtp.report $OUT/r2/cli -o $OUT/r2/cli.png 2>&1 | tail -2
python3 - <<'PY'
import os
from nemo_gtp.report import read_run
run = read_run(os.environ["OUT"] + "/r2/cli")
for tag in ("reduced_train_loss", "train/step_s", "train/peak_memory_gib", "train/model_state_gib"):
    print(tag, [(s, round(v, 4)) for s, v in run.scalars.get(tag, [])][:13])
PY
