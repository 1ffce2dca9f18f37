# TE from the parts carried before (/root/tw, five calls `mkdir -p /root/tw && cp .teN/* /root/tw/`)
# and .te0 + the prebuilt extension .te_ext (no build).
set -u
source bench/results/2026-12-02_pm_1xH200/commands/env.sh
bash bench/te_build.sh 2>&1 | tail -2
