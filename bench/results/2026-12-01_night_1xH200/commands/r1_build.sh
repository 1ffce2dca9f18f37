# TE from the parts carried before (/root/tw) and .te0; the built extension back in $OUT; then the
# protocol path alone on the GPU, the session's start (.te_old) vs now, interleaved.
set -u
source bench/results/2026-12-01_night_1xH200/commands/env.sh
bash bench/te_build.sh 2>&1 | tail -2
cp /tmp/te2/transformer_engine/wheel_lib/transformer_engine_torch*.so $OUT/ 2>/dev/null
for i in 1 2 3; do
  for tree in .te_old .; do
    (cd $tree && PYTHONPATH=$PWD python3 bench/protocol_host.py --device cuda --steps 100 | sed "s|^|$tree |")
  done
done 2>&1 | grep us_per | tee $OUT/protocol_host.txt
