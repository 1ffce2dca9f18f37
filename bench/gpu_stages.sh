#!/usr/bin/env bash
# The GPU benchmark runner: every open GPU check is a named stage, each bounded, its output
# packed into $OUT/<stage>.tgz as it finishes (a call cut short keeps the stages before).
#
#   bash bench/gpu_stages.sh --list                 # the stages, how their ranks talk, minutes
#   bash bench/gpu_stages.sh eager layergraph       # these stages, in this order
#   ONE_GPU=1 bash bench/gpu_stages.sh exact peft   # one GPU: ranks share it (numerics only)
#   CHECK=1 bash bench/gpu_stages.sh all            # CPU: every stage's command lines parse
#   MODE=cpu bash bench/gpu_stages.sh exact         # the stages' CPU twins (exact, peft)
#   BUDGET=300 bash bench/gpu_stages.sh fusions     # a one-process stage's seconds (fusions, host)
#
# On the GPU machine, from the repository root (bench/README.md "Running on a GPU machine"):
# the stages source bench/device_env.sh (the wheel set from .whl, TransformerEngine through
# bench/te_build.sh, both on PYTHONPATH) and export NCCL_NVLS_ENABLE=0
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1. How ranks talk, per stage (--list): "NCCL" (one rank per
# GPU), "shared" (ranks sharing one GPU through the staged gloo backend, --shared-device: losses
# and grad norms mean something, step times do not), "fake" (rank 0 of a fake process group:
# host time without communication). Record what ran in bench/results/<date>_<question>.md
# (device, date, the exact command, the numbers, how the ranks talked) and point
# bench/README.md at it.
set -u
OUT=${OUT:-gpu_stages_out}
ONE_GPU=${ONE_GPU:-0}
CHECK=${CHECK:-0}
MODE=${MODE:-gpu}
T0=$(date +%s)

# stage -> "how ranks talk | GPUs | minutes | what it answers"
declare -A INFO=(
  [fusions]="fake | 1 | 8 | the graphed GPU recipes: eager / per-layer / full-iteration graphs, each fusion off, MFU, peak"
  [eager]="NCCL | 2 | 7 | NeMo path GTP2 vs DP2, TE spec, eager, 1k/2k/4k/8k tokens per GPU, host timer"
  [layergraph]="NCCL | 2 | 8 | the same with megatron's per-layer CUDA graphs (and the wgrad ring)"
  [host]="fake | 1 | 9 | host_fake: GTP2 vs DP2 eager and per-layer graphs, 1k-8k, no communication"
  [exact]="shared | 1 | 8 | pre-sharded TE linears start from DP2's weights bit for bit (bf16, FP8 primary)"
  [moe]="NCCL | 2 | 5 | MoE EGTP2 vs EP2 (step time, memory) and vs DP2 (loss); ONE_GPU: shared"
  [fp8]="NCCL | 2 | 12 | FP8 50-step loss bounds (DP2 noise twin, lr warmup) and the 1B FP8 rows"
  [fp8param]="NCCL | 2 | 9 | FP8 primary weights: bits vs TE's quantizer, then the 1B recipe"
  [fp8units]="NCCL | 2 | 4 | FP8 primary coalescing units in the training dtype: step-time price"
  [grouped]="NCCL | 2 | 3 | expert linears built as EGTP shards on TE: init, memory, parity, ckpt"
  [muon]="NCCL | 2 | 5 | Muon GTP2 (owner split) vs DP2, 1B TE recipe, 2k/4k"
  [peft]="shared | 1 | 10 | LoRA on pre-sharded TE linears from a pretrained checkpoint, restarts"
  [mfsdp]="NCCL | 2 | 3 | NeMo's Megatron-FSDP as the second baseline beside DP2 and GTP2"
  [layouts4]="NCCL | 4 | 10 | 4 GPUs: TP2·GTP2, GTP4, CP2·GTP2 (NeMo) and EP2·EGTP2 vs EP4 / EP2·DP2"
  [nccl]="NCCL | 2 | 6 | megatron-level parity oracle and checkpoint TP1·GTP2 -> TP2 / DP2"
  [megatron_graphs]="NCCL | 2 | 3 | per-layer CUDA graphs at megatron level: graphed == eager, replays"
  [strategy]="NCCL | 2 | 9 | NeMo's default TE spec, ~1B compare, strategy checkpoints and resumes"
)
ORDER="fusions eager layergraph host exact moe fp8 fp8param fp8units grouped muon peft mfsdp layouts4 nccl megatron_graphs strategy"
ONE_GPU_STAGES=" fusions host exact moe fp8 fp8param grouped peft "  # these take ONE_GPU=1 (shared / fake)

if [ "${1:-}" = --list ] || [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
  printf '%-16s %-7s %-5s %-4s %s\n' stage ranks GPUs min "question"
  for s in $ORDER; do
    IFS='|' read -r talk gpus mins what <<< "${INFO[$s]}"
    printf '%-16s %-7s %-5s %-4s %s\n' "$s" $talk $gpus $mins "${what# }"
  done
  exit 0
fi
STAGES="$*"
[ -z "$STAGES" ] || [ "$STAGES" = all ] && STAGES=$ORDER
for s in $STAGES; do
  [ -n "${INFO[$s]:-}" ] || { echo "unknown stage $s (bash bench/gpu_stages.sh --list)"; exit 2; }
  if [ "$MODE" = cpu ] && [ "$CHECK" != 1 ] && [[ " exact peft " != *" $s "* ]]; then
    echo "stage $s has no CPU twin (MODE=cpu: exact, peft)"; exit 2
  fi
done

PY=python3
if [ "$MODE" = cpu ] || [ "$CHECK" = 1 ]; then
  PY=.venv/bin/python; export PYTHONPATH=$PWD
else
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
  export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
  source bench/device_env.sh  # the wheels and TE, each unless already there
fi
SHARED=""; [ "$ONE_GPU" = 1 ] && SHARED="--shared-device"
GPUS=$( (nvidia-smi -L 2>/dev/null || true) | wc -l)
mkdir -p "$OUT"
exec 3>&1

# run SECONDS COMMAND...: bounded; CHECK=1 only parses it (bench_nemo / bench_moe / host_fake:
# --dry-run, which also checks every mode's recipe; any other module: --help)
run() {
  local limit=$1; shift
  if [ "$CHECK" != 1 ]; then timeout "$limit" "$@"; return; fi
  local args=() mod="" prev=""
  for a in "$@"; do
    [ "$prev" = -m ] && mod=$a
    prev=$a; args+=("$a")
  done
  case $mod in
    bench.bench_nemo | bench.bench_moe | bench.host_fake)
      "${args[@]}" --dry-run > "$OUT/check.log" 2>&1 ;;
    *) "$PY" -m "$mod" --help > "$OUT/check.log" 2>&1 ;;
  esac
  local rc=$?  # reported on fd 3 (the terminal): the stages pipe and filter stdout / stderr
  echo "  parse $mod: $([ $rc = 0 ] && echo ok || { echo "FAILED"; tail -3 "$OUT/check.log"; })" >&3
}
pack() {
  [ "$CHECK" = 1 ] && return
  (cd "$OUT" && tar czf "$1.tgz" "$1" && rm -rf "$1"); echo "$1 done $(( $(date +%s) - T0 )) s"
}
TORCHRUN="torchrun --nproc-per-node"

stage_eager() {  # the 2k eager TE gap and its neighbours, GTP2's host split beside it
  run 420 $PY -m bench.bench_nemo --modes dp2_te@eager,gtp2_te@eager --tokens 1024,2048,4096,8192 \
    --host-timer --warmup 5 --timed 19 --fit-timeout 80 --out "$OUT/eager" | tail -14
}
stage_layergraph() {  # target <= 1.03x graphed DP2; the segment heads (design §3.5) in
  run 500 $PY -m bench.bench_nemo --modes \
    dp2_te@layergraph,gtp2_te@layergraph,gtp2_te@layergraph@graph_wgrad_ring_size=2 \
    --tokens 1024,2048,4096,8192 --warmup 5 --timed 19 --fit-timeout 60 \
    --out "$OUT/layergraph" | tail -14
}
stage_host() {  # one device, rank 0 of a fake 2-rank world: the one-GPU regression check
  # a process per 4 fits (NeMo + TE imported once each); no host timer (it falls on GTP's side);
  # each GTP mode beside its %nocopy twin (its collectives without the fake backend's copies);
  # 8k last, what --budget drops first
  local B=${BUDGET:-510}
  run $((B + 50)) $PY -m bench.host_fake --one-process --fits-per-process 4 --budget $B \
    --fit-timeout 150 --timer none \
    --modes dp2_te@eager,gtp2_te@eager,gtp2_te@eager%nocopy,dp2_te@layergraph,gtp2_te@layergraph \
    --tokens 2048,4096,1024,8192 \
    --profile 0 --steps 20 --out "$OUT/host" | grep "^|\|^Ranks\|median"
}
# the GPU recipes' graphs and fusions on one GPU (fake world): every fit in ONE process (NeMo and
# TE imported once, ~100 s on the device), repeats interleaved; --budget stops starting fits in
# time (what a slow machine drops is the later repeats). Per repeat, most wanted first: DP2 and
# GTP2 eager vs per-layer graphs at 4k, then the full-iteration graph; each fusion off against
# the all-on recipe, and all of them off (the recipes as they were) (DP2, per-layer graphs, 4k:
# the row's "vs recipe"); the FP8 recipe as it now is, graphed (does it capture); then 2k.
# (apply_rope_fusion stays off in the recipes: it acts on RoPE positions only, theirs are learned.)
stage_fusions() {
  local L=dp2_te@layergraph@model F OFF
  F="$L.bias_dropout_fusion=false,$L.cross_entropy_loss_fusion=false"
  F="$F,$L.gradient_accumulation_fusion=false"
  OFF="$L.bias_dropout_fusion=false@model.cross_entropy_loss_fusion=false"
  OFF="$OFF@model.gradient_accumulation_fusion=false"
  local CORE=dp2_te@eager,gtp2_te@eager,dp2_te@layergraph,gtp2_te@layergraph
  local GRAPH=dp2_te@graph,gtp2_te@graph
  local B=${BUDGET:-430}  # seconds from the stage's start; BUDGET=300: a shorter device call
  run 60 $PY -m bench.wgrad_fusion_gemm  # the GEMM gradient_accumulation_fusion gets without apex
  run $((B + 50)) $PY -m bench.host_fake --one-process --budget $B --fit-timeout 150 --repeat 3 \
    --modes $CORE --tokens 4096 --also "4096:$GRAPH" --also "4096:$F,$OFF" \
    --also "4096:dp2_fp8,gtp2_fp8" --also "2048:$CORE,$GRAPH" \
    --warmup 5 --steps 12 --profile 0 --out "$OUT/fusions" | grep -v '^{'
}
stage_exact() {  # design §3.1 "Exact init": GTP2 starts from DP2's weights, first loss DP2's
  # FP8 primary (per-tensor): GTP2's start is the bf16 run's start quantized as one tensor
  # (compare-weights --quantize-second); DP2 on TE's own FP8 params is printed beside it, it is
  # not that quantization (bench/results/2026-12-06_fp8_primary_start_1xH100.md)
  local pairs="dp2_te,gtp2_te dp2_te,dp2_fp8param,gtp2_fp8param" pair base T
  [ "$MODE" = cpu ] && pairs="dp2_cpu,gtp2_cpu@preshard_linears=all"  # local linears as shards
  mkdir -p "$OUT/exact"
  for pair in $pairs; do
    base=${pair%%,*}; T=/tmp/exact_${pair//,/_}; rm -rf "$T"
    run 260 $PY -m bench.bench_nemo --shared-device --tokens 2048 --warmup 1 --timed 9 \
      --fit-timeout 90 --dump-weights --modes "$pair" --out "$T" 2>&1 \
      | grep -E "PARITY|failed" | cut -c1-400 | tee -a "$OUT/exact/parity.txt"
    local modes=(${pair//,/ }) quantize=()
    [[ "$pair" == *fp8param* ]] && quantize=(--quantize-second tensorwise)
    for mode in "${modes[@]:1}"; do
      local first ref  # the dumps' names: bench_nemo's file_stem of "<mode>_<tokens>"
      first="$T/weights_$(sed 's/[^A-Za-z0-9._-]\+/_/g' <<< "${mode}_2048")_start.pt"
      ref="$T/weights_$(sed 's/[^A-Za-z0-9._-]\+/_/g' <<< "${base}_2048")_start.pt"
      [[ "$mode" == *fp8param* ]] || quantize=()
      echo "== start weights: $mode vs $base ${quantize[*]}" | tee -a "$OUT/exact/compare.txt"
      run 120 $PY -m bench.tools compare-weights "$first" "$ref" "${quantize[@]}" 2>&1 \
        | grep -v -i warn | tail -4 | tee -a "$OUT/exact/compare.txt"
    done
    mkdir -p "$OUT/exact/$base"; cp "$T"/*.md "$T"/*.json "$OUT/exact/$base/" 2>/dev/null
  done
}
stage_moe() {  # EGTP2 vs EP2 at 4k (<= 1.05x), memory; EGTP2 vs DP2 loss
  if [ "$ONE_GPU" = 1 ]; then
    run 170 $PY -m bench.bench_moe --shared-device --modes grouped_ep2_dp2,grouped_ep2_egtp2 \
      --timeout 165 --out "$OUT/moe/ep2" | tail -6
  fi
  local modes=grouped_dp2,grouped_egtp2
  [ "$ONE_GPU" = 1 ] || modes=grouped_ep2,grouped_egtp2,grouped_dp2
  run 230 $PY -m bench.bench_moe $SHARED --modes $modes --timeout 225 --out "$OUT/moe/egtp2" \
    | tail -6
}
stage_fp8() {  # the 0.02 loss bound over 50 steps, against DP2's own noise floor (*_dp2_split)
  local steps=50; [ "$ONE_GPU" = 1 ] && steps=12
  run 200 $TORCHRUN 2 -m bench.gpu_fp8_check $SHARED --deadline 190 \
    --modes fp8_dp2,fp8_gtp2,fp8_dp2_split,fp8block_dp2,fp8block_gtp2,fp8block_dp2_split,bf16_gtp2 \
    --lr 1e-4 --steps $steps --out "$OUT/fp8" 2>&1 | grep -v Warn | tail -8
  # with a 10-step linear lr warmup, as NeMo's recipes train
  run 185 $TORCHRUN 2 -m bench.gpu_fp8_check $SHARED --deadline 175 \
    --modes fp8_dp2,fp8_gtp2,fp8_dp2_split,fp8block_dp2,fp8block_gtp2,fp8block_dp2_split \
    --lr 1e-4 --lr-warmup 10 --steps $steps --out "$OUT/fp8/warmup" 2>&1 | grep -v Warn | tail -8
  # the step-time target (GTP2-FP8 <= 1.05x DP2-FP8 at 4k) on the 1B recipe, 2 GPUs
  [ "$ONE_GPU" = 1 ] || run 290 $PY -m bench.bench_nemo \
    --modes dp2_fp8@eager,gtp2_fp8@eager,dp2_fp8block@eager,gtp2_fp8block@eager,dp2_fp8blockparam@eager,gtp2_fp8blockparam@eager \
    --tokens 4096 --warmup 5 --timed 19 --fit-timeout 45 --out "$OUT/fp8/nemo" | tail -10
}
stage_fp8param() {  # FP8 primary weights on real TE: bits, then the 1B FP8 recipe
  local steps=30; [ "$ONE_GPU" = 1 ] && steps=10
  run 250 $TORCHRUN 2 -m bench.gpu_fp8_check $SHARED --deadline 240 \
    --modes fp8param_dp2,fp8param_gtp2,fp8blockparam_dp2,fp8blockparam_gtp2 --lr 1e-4 \
    --lr-warmup 10 --steps $steps --out "$OUT/fp8param" 2>&1 | grep -v Warn | tail -8
  run 290 $PY -m bench.bench_nemo $SHARED \
    --modes dp2_fp8param@eager,gtp2_fp8param@eager,dp2_fp8blockparam@eager,gtp2_fp8blockparam@eager \
    --tokens 2048 --warmup 5 --timed 10 --fit-timeout 120 --out "$OUT/fp8param/nemo" | tail -8
}
stage_fp8units() {  # new units vs the float8-sized ones (coalesce_mb=384), 4k
  run 230 $PY -m bench.bench_nemo \
    --modes dp2_fp8blockparam@eager,gtp2_fp8blockparam@eager,gtp2_fp8blockparam@eager@coalesce_mb=384 \
    --tokens 4096 --warmup 5 --timed 19 --fit-timeout 60 --out "$OUT/fp8units" | tail -8
}
stage_grouped() {  # TF32 off (the script sets NVIDIA_TF32_OVERRIDE=0)
  run 145 $PY -m bench.gpu_grouped_experts $SHARED --timeout 140 --out "$OUT/grouped" 2>&1 \
    | grep -v Warn | tail -6
}
stage_muon() {  # design §1.6: owner split (two all-to-alls per bucket) vs every replica
  local m="@eager@optim.optimizer=muon@optim.use_distributed_optimizer=false"
  m="$m@ddp.use_distributed_optimizer=false"
  run 260 $PY -m bench.bench_nemo --modes "dp2_te$m,gtp2_te$m@preshard_linears=none" \
    --tokens 2048,4096 --warmup 5 --timed 15 --fit-timeout 100 --out "$OUT/muon" | tail -10
}
stage_peft() {  # LoRA (design §1.1 "Frozen weights") on TE linears built as their GTP shards
  local D=dp2_te G=gtp2_te PRE="" O="$OUT/peft" T=/tmp/peft P L A R
  [ "$MODE" = cpu ] && { D=dp2_cpu; G=gtp2_cpu; PRE="@preshard_linears=all"; }
  rm -rf "$T"; mkdir -p "$O" "$T"
  # CHECK=1: the checkpoints the later steps resume from, empty, so their recipes validate
  [ "$CHECK" = 1 ] && mkdir -p "$T/pre/step=2/weights" "$T/ad/step=9/weights"
  local PS="@strategy.ckpt_parallel_save=false@strategy.ckpt_parallel_load=false"  # numpy 2
  local B="--shared-device --tokens 2048"
  # 1. DP2 pretrains 3 steps and saves its weights
  run 120 $PY -m bench.bench_nemo $B --warmup 1 --timed 2 --fit-timeout 110 --modes \
    "$D@checkpoint.dir=$T/pre@checkpoint.every_n_train_steps=3@strategy.ckpt_save_optimizer=false$PS" \
    --out "$T/pre_run" 2>&1 | tail -1 | cut -c1-300
  P=$(ls -d "$T"/pre/step=* 2>/dev/null | sort -t= -k2 -n | tail -1); echo "pretrained: $P"
  # 2. LoRA from it, 15 steps: GTP2 saving adapter checkpoints every 5 steps asynchronously
  #    (NeMo's default), then DP2, in one launch
  L="@peft.method=lora@restore=${P:-$T/pre/step=2}$PS"
  A="@checkpoint.dir=$T/ad@checkpoint.every_n_train_steps=5@strategy.ckpt_async_save=true"
  run 250 $PY -m bench.bench_nemo $B --warmup 2 --timed 13 --fit-timeout 120 --dump-weights \
    --modes "$G$L$PRE$A,$D$L" --out "$T/save" 2>&1 | grep -E "PARITY|failed" | cut -c1-600 \
    | tee "$O/parity.txt"
  # 3. its step-10 adapter checkpoint resumed at GTP2 (end bit for bit) and DP2 (weights only)
  R="@resume=$T/ad/step=9"
  run 180 $PY -m bench.bench_nemo $B --warmup 2 --timed 13 --fit-timeout 120 --dump-weights \
    --modes "$G$L$PRE$R,$D$L$R@strategy.ckpt_load_optimizer=false" --out "$T/load" 2>&1 \
    | tail -1 | cut -c1-300
  {
    echo "== GTP2 resumed from its step-10 adapter checkpoint: its end vs the saving fit's end"
    run 120 $PY -m bench.tools compare-weights $T/save/weights_${G}*_end.pt \
      $T/load/weights_${G}*_end.pt | tail -3
    echo "== DP2 resumed from it (weights only): its first batch's weights vs GTP2's"
    run 120 $PY -m bench.tools compare-weights $T/load/weights_${G}*_start.pt \
      $T/load/weights_${D}*_start.pt | tail -3
  } 2>&1 | tee "$O/compare.txt"
  # the losses of every fit, and GTP2 vs DP2 under LoRA (their modes differ in modifiers the
  # baseline does not share, so bench_nemo prints no PARITY line for the pair)
  [ "$CHECK" = 1 ] || $PY - "$T" <<'PY' | tee "$O/losses.txt"
import json, sys
root = sys.argv[1]
for part in ("pre_run", "save", "load"):
    try:
        rows = json.load(open(f"{root}/{part}/bench_nemo.json"))
    except Exception as err:
        print(part, "no json", err); continue
    for r in rows:
        mode = r["mode"].replace(root, "")
        print(part, mode, r.get("error", "")[:300], "losses", r.get("losses"), "grad norms", r.get("grad_norms"))
    if part == "save" and all(r.get("losses") for r in rows):  # GTP2 vs its DP2 baseline
        g, d = rows[0]["losses"], rows[1]["losses"]
        rel = max(abs(x - y) / abs(y) for x, y in zip(g, d))
        print(f"GTP2 vs DP2 LoRA: {len(g)} steps, step-0 loss {g[0]} / {d[0]}, max rel loss diff {rel:.2e}")
PY
  for d in pre_run save load; do mkdir -p "$O/$d"; cp "$T/$d"/*.md "$T/$d"/*.json "$O/$d/" 2>/dev/null; done
}
stage_mfsdp() {  # eager 1k and 4k beside NeMo's Megatron-FSDP
  run 150 $PY -m bench.bench_nemo --modes dp2_te@eager,gtp2_te@eager,mfsdp_te@eager --tokens 1024,4096 \
    --warmup 5 --timed 19 --fit-timeout 60 --out "$OUT/mfsdp" | tail -10
}
stage_layouts4() {  # the layouts only the CPU suite has run; 4k tokens per GPU
  if [ "$CHECK" != 1 ] && [ "$GPUS" -lt 4 ]; then echo "layouts4 skipped: needs 4 GPUs"; return; fi
  local tp="@eager@strategy.tensor_model_parallel_size=2"
  # TP2·GTP2 vs TP2·DP2 (same global batch: 2 micro-batches; the pair is listed explicitly,
  # TP is not a modifier the baseline shares)
  run 230 $PY -m bench.bench_nemo --devices 4 --modes \
    "dp2_te$tp@strategy.num_weight_shards=2,gtp2_te$tp@strategy.num_weight_shards=4" \
    --tokens 4096 --warmup 5 --timed 19 --fit-timeout 80 --out "$OUT/layouts4/tp2" | tail -8
  # GTP4 vs DP4 (global batch 4 micro-batches, shared with the baseline)
  run 200 $PY -m bench.bench_nemo --devices 4 --modes \
    "dp2_te@eager@data.global_batch_size=8,gtp2_te@eager@strategy.num_weight_shards=4@data.global_batch_size=8" \
    --tokens 4096 --warmup 5 --timed 19 --fit-timeout 80 --out "$OUT/layouts4/gtp4" | tail -8
  # TP1·CP2·GTP2 vs TP1·CP2·DP2
  run 230 $PY -m bench.bench_nemo --devices 4 --modes \
    "dp2_te@eager@strategy.context_parallel_size=2,gtp2_te@eager@strategy.context_parallel_size=2@preshard_linears=none" \
    --tokens 4096 --warmup 5 --timed 19 --fit-timeout 80 --out "$OUT/layouts4/cp2" | tail -8
  # EP2·EGTP2 vs EP4 (speed) and vs EP2·DP2 (loss)
  run 230 $PY -m bench.bench_moe --modes grouped_ep2_egtp2,grouped_ep4,grouped_ep2_dp2 \
    --timeout 225 --out "$OUT/layouts4/ep2_egtp2" | tail -8
}
stage_nccl() {  # the CPU suite's parity cases on NCCL (4-rank cases with 4 GPUs), checkpoints
  local n=2; [ "$GPUS" -ge 4 ] && n=4
  mkdir -p "$OUT/nccl"
  run 300 $TORCHRUN $n -m bench.nccl_checks parity --out "$OUT/nccl/parity_nccl.jsonl" 2>&1 \
    | grep "parity-nccl" | tail -30
  run 120 $TORCHRUN 2 -m bench.nccl_checks ckpt --dir /tmp/gtp_ckpt \
    --out "$OUT/nccl/ckpt_nccl.json" 2>&1 | grep "ckpt-nccl"
}
stage_megatron_graphs() {  # graphed GTP2 == eager GTP2 (fp32), every captured layer replays
  run 180 $PY -m bench.gpu_layer_graphs --out "$OUT/megatron_graphs" 2>&1 | tail -12
}
stage_strategy() {  # GTPMegatronStrategy through nl.Trainer: TE spec, ~1B, checkpoints
  local O="$OUT/strategy" CK=/tmp/gtp_ckpts
  # NumPy 2 on the GPU machine: megatron-core 0.15's parallel save / load call np.product
  local PS="+strategy.ckpt_parallel_save=false +strategy.ckpt_parallel_load=false"
  mkdir -p "$O"; rm -rf "$CK"
  run 300 $PY -m nemo_gtp.run configs/gpt_1b_te.yaml trainer.max_steps=10 model.num_layers=4 \
    --compare-baseline > "$O/te_spec_compare.out" 2>&1; tail -6 "$O/te_spec_compare.out"
  run 240 $PY -m bench.bench_nemo --modes gtp2_te@graph,gtp2_te@eager --tokens 2048 --timed 10 \
    --out "$O/graph" | tail -6
  run 300 $PY -m nemo_gtp.run configs/gpt_1b.yaml trainer.max_steps=20 --compare-baseline \
    > "$O/gpt1b_compare.out" 2>&1; tail -6 "$O/gpt1b_compare.out"
  run 150 $PY -m nemo_gtp.run configs/gpt_125m.yaml trainer.max_steps=12 \
    +checkpoint.dir=$CK +checkpoint.every_n_train_steps=10 $PS --loss-log "$O/full12.jsonl" \
    > "$O/gpt125m_full12.out" 2>&1; tail -3 "$O/gpt125m_full12.out"
  # both resumes in one launch (GTP2, then DP2 from the same checkpoint), weights only
  run 200 $PY -m nemo_gtp.run configs/gpt_125m.yaml trainer.max_steps=12 +resume=$CK/step=9 \
    +strategy.ckpt_load_optimizer=false $PS --compare-baseline > "$O/resume_both.out" 2>&1
  tail -6 "$O/resume_both.out"
  run 60 $PY -m nemo_gtp.checkpoint.show $CK/step=9/weights > "$O/inspect.out" 2>&1
}

for s in $STAGES; do
  IFS='|' read -r talk gpus _ _ <<< "${INFO[$s]}"
  talk=${talk// /}
  if [ "$CHECK" != 1 ] && [ "$MODE" != cpu ]; then
    if [ "$ONE_GPU" = 1 ] && [[ "$ONE_GPU_STAGES" != *" $s "* ]]; then
      echo "$s skipped: ONE_GPU=1 (needs ${gpus// /} GPUs)"; continue
    fi
  fi
  echo "=== $s ($talk$([ "$ONE_GPU" = 1 ] && [ "$talk" = NCCL ] && echo ', ONE_GPU: shared'))"
  "stage_$s"
  pack "$s"
done
