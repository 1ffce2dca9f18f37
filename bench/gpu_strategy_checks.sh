#!/usr/bin/env bash
# GPU checks of the NeMo-level paths on 2 GPUs (results under $OUT), run on every GPU round
# (0 and 0b need TransformerEngine: bench/te_build.sh; 0c runs without it):
#  1. the ~1B recipe, GTP2 vs DP2 in one launch (run.py --compare-baseline), 20 steps;
#  2. the ~125M recipe through GTPMegatronStrategy checkpoints: 20 steps with a ModelCheckpoint
#     every 10, resume from step 10 at GTP2 (optimizer + data position restored), and the same
#     checkpoint loaded by a DP2 run (no GTP; weights only: without TE/Apex megatron's plain
#     distributed optimizer cannot describe torch Adam's per-param step);
#  3. the inspect CLI on the saved checkpoint.
# Usage (device machine, wheels installed, PYTHONPATH set): bash bench/gpu_strategy_checks.sh
set -u
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
CK=/tmp/gtp_ckpts
# The GPU machine has NumPy 2 (our pyproject pins numpy<2 for megatron-core 0.15, whose parallel
# checkpoint save and load call np.product); keep NeMo's parallel save and load off here.
PS="+strategy.ckpt_parallel_save=false +strategy.ckpt_parallel_load=false"
SKIP_1B=${SKIP_1B:-0}
run() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*" | tee -a "$OUT/commands.txt"
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
  echo "exit $? after $((SECONDS - start)) s" | tee -a "$OUT/commands.txt"
  tail -40 "$OUT/$name.out"
}
# 0. NeMo's default (TransformerEngine) layer spec through nl.Trainer + GTPMegatronStrategy, GTP2
#    vs DP2 (the path most GPU users take; it once crashed in the strategy's setup). Needs TE.
python3 -c "import transformer_engine.pytorch" 2>/dev/null && run te_spec_compare 300 \
  python3 -m nemo_gtp.run configs/gpt_1b_te.yaml trainer.max_steps=10 model.num_layers=4 --compare-baseline
# 0b. The full-iteration CUDA graph under GTP (TE's RNG tracker: needs TE): GTP2 with the graph
#     vs eager GTP2 on the 1B TE recipe at 2k tokens per GPU; bench_nemo's table shows both step
#     times and the loss curves (design §3.5).
python3 -c "import transformer_engine.pytorch" 2>/dev/null && run full_iteration_graph 240 \
  python3 bench/bench_nemo.py --modes gtp2_te@graph,gtp2_te --tokens 2048 --timed 10 --out "$OUT/graph"
# 0c. Per-layer CUDA graphs under GTP (megatron's local CudaGraphManager, fp32): graphed GTP2 vs
#     eager GTP2 (bit for bit) vs DP2, and that every captured layer replays (design §3.5).
run layer_graphs 180 python3 bench/gpu_layer_graphs.py --out "$OUT/layer_graphs"
# 0d. TEGroupedMLP experts built as their EGTP2 shards (TE's GroupedLinear): exact init and build
#     memory on the GPU, GPT parity, checkpoint EGTP2 -> no GTP -> EGTP2 (design §3.1, §3.3);
#     SequentialMLP of TE linears built likewise: exact init, build memory, GPT parity.
python3 -c "import transformer_engine.pytorch" 2>/dev/null && run grouped_experts 150 \
  python3 bench/gpu_grouped_experts.py --out "$OUT/grouped_experts"
[ "$SKIP_1B" = 1 ] || [ "${COMPACT:-0}" = 1 ] || run gpt1b_compare 300 python3 -m nemo_gtp.run configs/gpt_1b.yaml trainer.max_steps=20 --compare-baseline
[ "${COMPACT:-0}" = 1 ] || run gpt125m_full 150 python3 -m nemo_gtp.run configs/gpt_125m.yaml trainer.max_steps=20 \
  +checkpoint.dir=$CK +checkpoint.every_n_train_steps=10 $PS --loss-log "$OUT/full.jsonl"
[ "${COMPACT:-0}" = 1 ] || run gpt125m_resume_gtp2 120 python3 -m nemo_gtp.run configs/gpt_125m.yaml trainer.max_steps=20 \
  +resume=$CK/step=9 $PS --loss-log "$OUT/resume_gtp2.jsonl"
[ "${COMPACT:-0}" = 1 ] || run gpt125m_resume_dp2 120 python3 -m nemo_gtp.run configs/gpt_125m.yaml trainer.max_steps=20 \
  +resume=$CK/step=9 strategy.num_weight_shards=1 +strategy.ckpt_load_optimizer=false $PS \
  --loss-log "$OUT/resume_dp2.jsonl"
[ "${COMPACT:-0}" = 1 ] || run inspect 60 python3 -m nemo_gtp.checkpoint.show $CK/step=9/weights
ls -la $CK $CK/* > "$OUT/ckpt_listing.txt" 2>&1
# Compact variant (COMPACT=1 skips the runs above): both resumes in one launch, weights only.
if [ "${COMPACT:-0}" = 1 ]; then
  run gpt125m_full12 150 python3 -m nemo_gtp.run configs/gpt_125m.yaml trainer.max_steps=12 \
    +checkpoint.dir=$CK +checkpoint.every_n_train_steps=10 $PS --loss-log "$OUT/full12.jsonl"
  run gpt125m_resume_both 200 python3 -m nemo_gtp.run configs/gpt_125m.yaml trainer.max_steps=12 \
    +resume=$CK/step=9 +strategy.ckpt_load_optimizer=false $PS --compare-baseline
fi
