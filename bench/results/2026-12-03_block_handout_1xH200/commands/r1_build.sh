# TE 2.20.2 from the parts carried before (/root/tw, five calls `mkdir -p /root/tw && cp .teN/* /root/tw/`)
# and .te0; full build of the torch extension (a fresh image: no .te_ext this session); the
# built .so comes back as $OUT/te_ext (carried later as .te_ext).
set -u
source bench/results/2026-12-02_fp8_memory_1xH200/commands/env.sh
bash bench/te_build.sh 2>&1 | tail -2
mkdir -p $OUT/te_ext && cp /tmp/te/transformer_engine/wheel_lib/transformer_engine_torch*.so $OUT/te_ext/
