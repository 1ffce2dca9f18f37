# ckpt_harness.moe_full_state (one collective per group and dtype since 2026-12-03) on a GPU:
# gpu_grouped_experts.py's checks, both ranks on cuda:0 through the staged backend, real TE
set -u
source bench/results/2026-12-03_harness_1xH200/commands/env.sh
python3 -c "import transformer_engine, nemo, megatron.core; print('stack ok')"
timeout 400 python3 bench/gpu_grouped_experts.py --shared-device --timeout 380 --out $OUT/grouped 2>&1 | grep -v -i warn | tail -30
