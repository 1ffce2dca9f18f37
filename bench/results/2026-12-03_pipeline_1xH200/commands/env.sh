# sourced by every command of this round (1xH200, 2026-12-03 night): NCCL settings, the wheels
# from .whl, TE from /root/tw + .te0 (set up by r1_te.sh into /tmp/te)
source bench/results/2026-12-01_night_1xH200/commands/env.sh
