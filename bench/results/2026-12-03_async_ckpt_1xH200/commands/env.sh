# sourced by every command of this round (1xH200, 2026-12-03 late): NCCL settings, the wheels
# from .whl (no TE: local spec only)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0
if [ -d .whl ] && [ ! -d /tmp/site/nemo ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl .whl/*.tar.gz .whl/*.zip
fi
export PYTHONPATH=/tmp/site:$PWD
