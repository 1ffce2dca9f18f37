# sourced by every command of this round (1xH200, 2026-12-02): the previous round's environment
# (the NCCL / flight-recorder settings, the wheels from .whl, TE built by r1_build.sh in /tmp/te)
source bench/results/2026-12-01_night_1xH200/commands/env.sh
