# Gathered bytes per step, FP8 gathers (configs/gpt_1b_fp8.yaml) vs bf16 gathers
# (configs/gpt_1b_te.yaml), the full 1B recipe through the strategy, two ranks on one GPU
# (--shared-device --full-size): the runtimes' CommStats of the last step (counts, not times).
set -u
source bench/results/2026-12-02_graph_host_1xH200/commands/env.sh
O=$OUT/r4; mkdir -p $O
timeout 560 python3 bench/bench_nemo.py --shared-device --full-size --tokens 2048 --warmup 1 \
  --timed 1 --modes gtp2_te,gtp2_fp8 --fit-timeout 270 --out $O 2>&1 | tail -6 | cut -c1-400
