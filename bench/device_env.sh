# Sourced by bench/gpu_stages.sh on the device machine (repository root): installs the wheel set
# (.whl carried in this call, or staged in /root/whl by an earlier one) into /tmp/site and builds
# TransformerEngine into /tmp/te (bench/te_build.sh), each unless already there, then puts both
# and the repository on PYTHONPATH. The device notes say how the parts are staged.
W=/root/whl; [ -d .whl ] && W=.whl
[ -d /tmp/site/nemo ] || python3 -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target /tmp/site $W/*.whl $W/*.tar.gz $W/*.zip
[ -d /tmp/te/transformer_engine ] || bash bench/te_build.sh 2>&1 | tail -1
export PYTHONPATH=/tmp/te:/tmp/site:$PWD
