#!/usr/bin/env bash
# Sourced at the start of every command on the GPU machine: install kforge (editable,
# no deps: the image has torch, pybind11, scikit-build-core) and record the machine.
set -eo pipefail
export PYTHONUNBUFFERED=1
: "${OUT:=/tmp/out}"
mkdir -p "$OUT"
# Wheels the image lacks, carried by the device call: .whl/ (openai, pytest-xdist) and, only for
# the Ray item, .whl-ray/ (a slimmed Ray and its dependencies: docs/cluster.md), kept apart so
# the other calls do not carry its 50 MB.
# One path per wheel file name: both folders may hold the same dependency (idna), and pip refuses
# the same version twice.
wheels=$(ls .whl/*.whl .whl-ray/*.whl 2>/dev/null | awk -F/ '!seen[$NF]++' || true)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels
  export PYTHONPATH=/tmp/site
fi
# Logs stay out of $OUT: only 8 files come back from a device call, and they are for results.
# If kforge._dispatch does not build against this torch, install without it (dispatch then
# runs in Python; `kforge doctor` says so) rather than lose the whole run.
python3 -m pip install -q --no-build-isolation --no-deps -e . > /tmp/kforge-install.log 2>&1 || {
  tail -30 /tmp/kforge-install.log; echo "!!! kforge._dispatch did not build: installing without it"
  python3 -m pip install -q --no-build-isolation --no-deps -e . -C cmake.define.KFORGE_TORCH_DISPATCH=OFF \
    > /tmp/kforge-install.log 2>&1 || { tail -50 /tmp/kforge-install.log; exit 1; }
}
python3 -m kforge doctor 2>&1 | grep -i -A1 "dispatch  " || true
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 || true
python3 -c "import torch, kforge; print('torch', torch.__version__, torch.cuda.get_device_name()); print(kforge.cuda_status())"
