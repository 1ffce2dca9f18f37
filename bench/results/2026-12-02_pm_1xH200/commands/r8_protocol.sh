# GTP's protocol path alone on the GPU (bench/protocol_host.py: 96 weights, units of 8, fake
# 2-rank world, no TE), this afternoon's engine change vs the code before it (old_tree/: the
# previous commit's nemo_gtp, carried untracked), interleaved five times.
set -u
export PYTHONUNBUFFERED=1
for i in 1 2 3 4 5; do
  echo "old $(PYTHONPATH=$PWD/old_tree python3 bench/protocol_host.py --device cuda --weights 96 --steps 200 | tail -1)"
  echo "new $(PYTHONPATH=$PWD python3 bench/protocol_host.py --device cuda --weights 96 --steps 200 | tail -1)"
done
