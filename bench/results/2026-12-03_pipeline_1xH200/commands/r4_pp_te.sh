# r3 again, with TransformerEngine: r3's machine was a fresh one (the previous one had gone idle
# between calls), so TE was not built there and NeMo silently built megatron's local spec for
# the "te" modes (now refused before launch). 4 microbatches per step: NeMo's 1F1B with stage 0
# running two forwards before its first backward, and the interleaved schedule with two model
# chunks per rank; tied embeddings (NeMo's default), the TE spec, 4 ranks sharing one GPU.
set -u
source bench/results/2026-12-03_pipeline_1xH200/commands/env.sh
python3 -c "import transformer_engine.pytorch; print('TE imports')" || exit 3
mkdir -p $OUT/r4
PP="@strategy.pipeline_model_parallel_size=2@data.global_batch_size=8"
timeout 280 python3 bench/bench_nemo.py --shared-device --devices 4 \
  --modes "dp2_te$PP,gtp2_te$PP@preshard_linears=none" \
  --tokens 2048 --warmup 2 --timed 8 --fit-timeout 130 --out $OUT/r4/pp 2>&1 | tail -9
VP="$PP@strategy.virtual_pipeline_model_parallel_size=2"
timeout 280 python3 bench/bench_nemo.py --shared-device --devices 4 \
  --modes "dp2_te$VP,gtp2_te$VP@preshard_linears=none" \
  --tokens 2048 --warmup 2 --timed 8 --fit-timeout 130 --out $OUT/r4/vpp 2>&1 | tail -9
