#!/usr/bin/env bash
# Round 3a (2xH200): TE build; host cost per weight with TE linears (te_plain vs te_gtp, units)
# and local linears after the host-work changes; the NeMo TE path again (DP2, GTP2, GTP2 with
# shard_replicated_params_over_gtp) at 2k/4k twice each, interleaved; 1k with Megatron-FSDP.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
T0=$(date +%s)
mkdir -p .whl && cp /root/tw/whl/* .whl/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl/*.tar.gz .whl/*.zip 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r3a
bash bench/te_build.sh > $OUT/r3a/te_build.log 2>&1; tail -1 $OUT/r3a/te_build.log
echo "te build done $(( $(date +%s) - T0 )) s"
export PYTHONPATH=/tmp/te:/tmp/site:$PWD
timeout 90 torchrun --nproc-per-node 2 bench/host_cost.py --modes plain,gtp_co8,te_plain,te_gtp,te_gtp_co8 \
  --steps 100 --profile $OUT/r3a/host_cost --out $OUT/r3a/host_cost/host_cost.json 2>&1 | grep -v Warning | tail -22
echo "host cost done $(( $(date +%s) - T0 )) s"
LEFT=$(( 570 - ($(date +%s) - T0) ))
timeout $LEFT python3 bench/bench_nemo.py --modes dp2_te,gtp2_te,gtp2_te_sr \
  --tokens 2048,4096 --repeat 2 --warmup 5 --timed 15 --profile-tokens 2048 --out $OUT/r3a/nemo | tail -24
echo "nemo done $(( $(date +%s) - T0 )) s"
LEFT=$(( 575 - ($(date +%s) - T0) ))
[ $LEFT -gt 60 ] && timeout $LEFT python3 bench/bench_nemo.py --modes dp2_te,gtp2_te,mfsdp_te \
  --tokens 1024 --warmup 5 --timed 15 --out $OUT/r3a/nemo1k | tail -6
echo "all done $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf r3a.tgz r3a && rm -rf r3a
