#!/usr/bin/env bash
# Round 3 on 1xH200 (the 2-GPU kind was not lent for over an hour): TE from .te0 + the extension
# round 2 built (.te_ext), then te_gemm_host.py (no GTP, one process).
export PYTHONUNBUFFERED=1; T0=$(date +%s); bash bench/te_build.sh 2>&1 | tail -2; echo "te $(( $(date +%s) - T0 )) s"
PYTHONPATH=/tmp/te:$PWD timeout 90 python3 bench/te_gemm_host.py --out $OUT/r3_gemm_host 2>&1 | grep -v Warn | tail -5
