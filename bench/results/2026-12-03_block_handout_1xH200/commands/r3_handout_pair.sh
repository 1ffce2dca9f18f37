# r2's host part ran out of its 400 s before its table, and the logs of the old-path and repeat
# modes did not come back (their names hold '%' and '#'): the new vs old hand-out again, two
# interleaved repeats, no DP2 (r2 has it), 2 profiled steps; names made plain before return.
source bench/results/2026-12-02_fp8_memory_1xH200/commands/env.sh; mkdir -p $OUT/r3
timeout 440 python3 bench/host_fake.py --modes \
  gtp2_fp8blockparam%tecolumnwise,gtp2_fp8blockparam --tokens 4096 --repeat 2 \
  --profile 2 --steps 12 --out $OUT/r3 2>&1 | grep -E "^\||rror" | cut -c1-300
for f in $OUT/r3/*; do n=$(basename "$f" | tr '#%' '__'); [ "$n" = "$(basename "$f")" ] || mv "$f" "$OUT/r3/$n"; done
grep -h RECORD $OUT/r3/*.log | cut -c1-400
