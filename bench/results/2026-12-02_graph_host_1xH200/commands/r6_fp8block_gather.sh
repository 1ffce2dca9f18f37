# Blockwise FP8 gathers (this session: TE gets a Float8BlockwiseQTensor over gathered rows and
# tile scales): GTP2 vs DP2 on TE's own blockwise path, 10 steps at lr 1e-4, two ranks on one
# GPU; the bit checks of every gathered weight vs TE's Float8BlockQuantizer on the full weight.
source bench/results/2026-12-02_graph_host_1xH200/commands/env.sh; mkdir -p $OUT/r6
timeout 170 torchrun --nproc-per-node 2 bench/gpu_fp8_check.py --shared-device --deadline 155 \
  --modes fp8block_gtp2,fp8block_dp2 --lr 1e-4 --steps 10 \
  --out $OUT/r6 2>&1 | grep -v Warn | grep -E "fp8block|PASS|FAIL|Error|error" | head -30
