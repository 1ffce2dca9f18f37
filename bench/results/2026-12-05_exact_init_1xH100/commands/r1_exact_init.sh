# Exact init of linears built as their GTP shards (design §3.1 "Exact init") on real TE, one GPU
# with two ranks sharing it (--shared-device: 4-layer, hidden-1024 cut of configs/gpt_1b_te.yaml,
# bf16, NeMo's default TE layer spec; numerics only). TE's linears are built as their GTP2
# shards (TE's default, preshard_linears="te"); each shard now draws the full weight into a
# scratch and keeps its rows, so GTP2 must start from DP2's weights bit for bit and its first
# loss must be DP2's. Then the FP8 primary pair (per-tensor current scaling, fp8_param): the
# GTP2 shards quantized with the GTP-agreed scale vs DP2 on TE's own Float8Tensor params,
# dequantized start weights bit for bit.
# MODE=cpu: the *_cpu modes on CPU with megatron-local linears built as shards (preshard "all").
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
T0=$(date +%s); PY=python3; D=dp2_te; G=gtp2_te; PRE=""
PAIRS="dp2_te,gtp2_te dp2_fp8param,gtp2_fp8param"
if [ "${MODE:-gpu}" = cpu ]; then
  PY=.venv/bin/python; PAIRS="dp2_cpu,gtp2_cpu@preshard_linears=all"; export PYTHONPATH=$PWD
else  # the wheels and TE, unless already there
  source bench/device_env.sh
fi
echo "setup $(( $(date +%s) - T0 )) s"
O=$OUT/exact; mkdir -p $O
for pair in $PAIRS; do
  base=${pair%%,*}; T=/tmp/exact_$base; rm -rf $T
  timeout 200 $PY bench/bench_nemo.py --shared-device --tokens 2048 --warmup 1 --timed 9 \
    --fit-timeout 90 --dump-weights --modes "$pair" --out $T 2>&1 | grep -E "PARITY|failed" \
    | cut -c1-400 | tee -a $O/parity.txt
  starts=($(ls $T/weights_*_start.pt))
  echo "== $pair: start weights (${starts[*]##*/})" | tee -a $O/compare.txt
  $PY bench/compare_weights.py ${starts[0]} ${starts[1]} 2>&1 | grep -v -i warn | tail -4 \
    | tee -a $O/compare.txt
  mkdir -p $O/$base; cp $T/*.md $T/*.json $O/$base/ 2>/dev/null
  echo "$pair $(( $(date +%s) - T0 )) s"
done
