# TE 2.20.2 from the parts carried before (/root/tw, five calls `mkdir -p /root/tw && cp .teN/* /root/tw/`),
# .te0 and the extension an earlier round built (.te_ext): no compile
set -u
source bench/results/2026-12-03_pipeline_1xH200/commands/env.sh
bash bench/te_build.sh 2>&1 | tail -2
