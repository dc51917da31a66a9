#!/usr/bin/env bash
# Everything GPU-side in one device call: install, the GPU tests, then the benchmarks, each
# step under its own time limit so one slow step cannot starve the rest. Results go to $OUT.
#   bash bench/gpu_suite.sh            (on the GPU machine, from the repo root)
source bench/device_setup.sh
set +e  # a step that fails or runs out of time must not stop the steps after it
step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s)"
  local t0=$(date +%s)
  timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$OUT/suite.log" | tail -40
  echo "=== $name: rc=${PIPESTATUS[0]} in $(( $(date +%s) - t0 ))s" | tee -a "$OUT/suite.log"
}
[ -n "$SKIP_TESTS" ] || step gpu-tests "${T_TESTS:-100}" python3 -m pytest -q -p no:cacheprovider --timeout 60 \
  ${GPU_TESTS:-tests/gpu/test_run_gpu.py tests/gpu/test_dispatch_gpu.py tests/gpu/test_builtin_gpu.py}
step builtin "${T_BUILTIN:-120}" python3 bench/bench_builtin.py --budget "${BUDGET:-12}" --no-compile --out "$OUT/builtin_h200.json"
step model-vae "${T_MODEL:-90}" python3 bench/bench_model.py examples/sd_vae_decoder.py --iterations "${ITERS:-6}" \
  --min-share 0.02 --out "$OUT/model_sd_vae_h200.json"
step model-gemma "${T_MODEL:-90}" python3 bench/bench_model.py examples/gemma_decoder.py --iterations "${ITERS:-6}" \
  --min-share 0.02 --out "$OUT/model_gemma_h200.json"
step model-resnet50 "${T_MODEL:-90}" python3 bench/bench_model.py examples/resnet50.py --iterations "${ITERS:-6}" \
  --min-share 0.01 --out "$OUT/model_resnet50_h200.json"
step model-qwen-moe "${T_MODEL:-90}" python3 bench/bench_model.py examples/qwen_moe.py --iterations "${ITERS:-6}" \
  --min-share 0.02 --out "$OUT/model_qwen_moe_h200.json"
step dispatch "${T_DISPATCH:-40}" python3 bench/bench_dispatch.py --iterations 4 --out "$OUT/dispatch_h200.json"
