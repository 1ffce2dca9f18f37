#!/usr/bin/env bash
# Build TransformerEngine 2.20.2 on the GPU machine from the parts carried in earlier calls
# (/root/tw/part0..4 from .te1..5, see the device notes) and .te0 (carried in this call), into
# /tmp/te; then `export PYTHONPATH=/tmp/te:$PYTHONPATH`. About 2 minutes on 16+ cores; seconds
# when the call also carries .te_ext/ (the extension an earlier build wrote, 5.5 MB).
#   Usage (device, repo root): bash bench/te_build.sh
set -euo pipefail
WHL=/root/tw/transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
cat /root/tw/part0 /root/tw/part1 /root/tw/part2 /root/tw/part3 /root/tw/part4 > "$WHL"
python3 -m pip install -q --no-index --no-deps --target /tmp/te "$WHL" .te0/*.whl
if compgen -G ".te_ext/transformer_engine_torch*.so" > /dev/null; then
  # the torch extension built by an earlier round on this image (carried as .te_ext): no build
  cp .te_ext/transformer_engine_torch*.so /tmp/te/transformer_engine/wheel_lib/
  PYTHONPATH=/tmp/te python3 -c "import transformer_engine as t, transformer_engine.pytorch; print('TE', getattr(t, '__version__', '?'), '(prebuilt extension)')"
  exit 0
fi
SP=$(python3 -c "import site; print(site.getsitepackages()[0])")
PYTHONPATH=/tmp/te CUDA_HOME=/usr/local/cuda \
  CPLUS_INCLUDE_PATH=$SP/nvidia/nccl/include:$SP/nvidia/cudnn/include:$SP/nvidia/cu13/include:/tmp/te/include \
  NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_CUDA_ARCHS=90 MAX_JOBS=$(nproc) \
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/te2 \
  .te0/transformer_engine_torch-2.20.2.tar.gz
# pip's --target does not merge into an existing transformer_engine/ folder: copy the .so in.
cp /tmp/te2/transformer_engine/wheel_lib/*.so /tmp/te/transformer_engine/wheel_lib/
PYTHONPATH=/tmp/te python3 -c "import transformer_engine as t, transformer_engine.pytorch; print('TE', getattr(t, '__version__', '?'))"
