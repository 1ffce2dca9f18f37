# Per-layer CUDA graphs without communication (fake 2-rank world, rank 0 on the GPU, TE spec,
# 2k tokens): GTP2 vs DP2 graphed, with the segment heads of 2026-12-02, twice interleaved;
# cProfile of 3 steps per mode (host_profiles.tgz) for bench/pstats_diff.py.
set -u
source bench/results/2026-12-02_graph_host_1xH200/commands/env.sh
O=$OUT/r2; mkdir -p $O
timeout 560 python3 bench/host_fake.py --modes dp2_te@layergraph,gtp2_te@layergraph --tokens 2048 \
  --repeat 2 --profile 3 --steps 15 --out $O 2>&1 | grep -v "^{" | tail -12
