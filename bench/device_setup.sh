#!/usr/bin/env bash
# Sourced at the start of every command on the GPU machine: install kforge (editable,
# no deps: the image has torch, pybind11, scikit-build-core) and record the machine.
set -eo pipefail
export PYTHONUNBUFFERED=1
: "${OUT:=/tmp/out}"
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
# Logs stay out of $OUT: only 8 files come back from a device call, and they are for results.
python3 -m pip install -q --no-build-isolation --no-deps -e . > /tmp/kforge-install.log 2>&1 || { tail -50 /tmp/kforge-install.log; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 || true
python3 -c "import torch, kforge; print('torch', torch.__version__, torch.cuda.get_device_name()); print(kforge.cuda_status())"
