#!/usr/bin/env bash
# Everything GPU-side in one device call: install, the GPU tests, then the benchmarks, each
# step under its own time limit so one slow step cannot starve the rest. Results go to $OUT.
#   bash bench/gpu_suite.sh            (on the GPU machine, from the repo root)
# KFORGE_COMMIT=<sha> names the commit the results record where the machine's copy of the tree
# carries an older .git (bench/provenance.py).
# Two lanes of items (LANE_A, LANE_B; names in `lane` below). With two GPUs the lanes run at
# the same time, one GPU each; with one GPU, one after the other. Sizing: T_TESTS, T_BUILTIN,
# T_MODEL (per model; T_<name> for one), T_DISPATCH seconds; BUDGET (candidates per built-in card), ITERS
# (search iterations per model card), WALL (search seconds per model), COMPILE=1 (time
# torch.compile too), GPU_TESTS (test paths) and TESTS_K (a pytest -k expression) for item tests,
# GPU_TESTS2 and TESTS_K2 for item tests2, ABLATE_MODEL and T_ABLATE for item ablate. ONLY and
# ONLY2 pick the built-in cases of items builtin and builtin2 ('|' between name parts); item codegen
# (bench_codegen.py: generated kernels alone) takes T_CODEGEN and ONLY_CODEGEN. Items
# compile_tests and ab (or ab_<model>): kforge.compile's GPU tests (compile_overhead: the per-call
# cost of its custom op against an Inductor extern call, T_OVERHEAD), and the eager / package /
# torch.compile / kforge.compile A/B, default and reduce-overhead, per example model (T_AB each):
#   LANE_A="compile_tests ab_sd_vae ab_gemma" LANE_B="ab_resnet50 ab_qwen_moe" bash bench/gpu_suite.sh
# REGIONS=1 searches region cards too in the model and A/B items (bench_model.py --regions; kforge.optimize,
# op by op and from CUDA graphs, is in every A/B): LANE_A="ab_sd_vae" REGIONS=1 bash bench/gpu_suite.sh
source bench/device_setup.sh
set +e  # a step that fails or runs out of time must not stop the steps after it
step() {  # step LOG NAME SECONDS CMD...
  local log=$1 name=$2 limit=$3; shift 3
  echo "=== $name (limit ${limit}s)" | tee -a "$log"
  local t0=$(date +%s)
  timeout --signal=INT --kill-after=10 "$limit" "$@" >> "$log" 2>&1
  echo "=== $name: rc=$? in $(( $(date +%s) - t0 ))s" | tee -a "$log"
}
compile_flag=${COMPILE:+--compile}
regions_flag=${REGIONS:+--regions}
no_compile_flag=--no-compile; [ -z "$COMPILE" ] || no_compile_flag=
model() {  # model LOG NAME FILE [bench_model.py args...]; DTYPE etc. pass through the environment
  local log=$1 name=$2 file=$3; shift 3
  local limit_var="T_$name"  # T_gemma=200 overrides T_MODEL for one model
  step "$log" "model-$name" "${!limit_var:-${T_MODEL:-90}}" python3 bench/bench_model.py "$file" --iterations "${ITERS:-6}" \
    ${WALL:+--wall-time "$WALL"} $compile_flag $regions_flag --out "$OUT/model_${name}_h200.json" "$@"
}
# The A/B of issue 23 on one example model, in one process: eager, the package, torch.compile,
# kforge.compile, and both compiles with mode="reduce-overhead" (T_AB seconds per model; Swin-T's and
# EfficientNet-B0's six compiles need about 200 s with a 40 s search). With
# RUNS_DIR set, each model's run directory is kept there (for the dashboard's screenshots).
ab() {  # ab LOG NAME FILE [bench_model.py args...]; T_AB_<name> (T_AB_unseen_swin=280) overrides T_AB for one model
  local log=$1 name=$2 file=$3; shift 3
  local limit_var="T_AB_$name"
  step "$log" "ab-$name" "${!limit_var:-${T_AB:-300}}" python3 bench/bench_model.py "$file" --iterations "${ITERS:-6}" \
    ${WALL:+--wall-time "$WALL"} --compile $regions_flag ${RUNS_DIR:+--run-dir "$RUNS_DIR/$name"} \
    --out "$OUT/ab_${name}${REGIONS:+_regions}_h200.json" "$@"
}
lane() {  # lane LOG ITEM...: run the items in order
  local log=$1 item; shift
  for item in "$@"; do
    case $item in
      # With pytest-xdist (carried in .whl/), TEST_WORKERS processes share the GPU (default 8; 0: one
      # process); the tests whose verdicts depend on time run alone afterwards: the timing tests
      # of test_core_gpu.py, and the fault injection, whose hang watchdog (5 s) took a trap for a
      # hang with 8 processes on the GPU. 543 tests took 366 s on 8 (H100): the whole directory's
      # limit defaults to 420 s, a GPU_TESTS selection's to 100.
      tests) if [ "${TEST_WORKERS:-8}" != 0 ] && python3 -c "import xdist" 2>/dev/null; then
               alone="tests/gpu/test_core_gpu.py tests/gpu/test_fault_injection.py"
               step "$log" gpu-tests "${T_TESTS:-$([ -n "$GPU_TESTS" ] && echo 100 || echo 420)}" python3 -m pytest -q -p no:cacheprovider -p no:benchmark --timeout 120 \
                 --tb=short -n "${TEST_WORKERS:-8}" ${GPU_TESTS:-tests/gpu ${alone//tests\//--ignore=tests/}} ${TESTS_K:+-k "$TESTS_K"}
               [ -n "$GPU_TESTS" ] || step "$log" gpu-tests-alone 150 python3 -m pytest -q -p no:cacheprovider --timeout 600 \
                 --tb=short $alone ${TESTS_K:+-k "$TESTS_K"}
             else
               step "$log" gpu-tests "${T_TESTS:-100}" python3 -m pytest -q -p no:cacheprovider --timeout 120 --tb=short \
                 ${GPU_TESTS:-tests/gpu} ${TESTS_K:+-k "$TESTS_K"}
             fi ;;
      # The same with its own paths and filter (GPU_TESTS2, TESTS_K2), for splitting tests over both lanes.
      tests2) step "$log" gpu-tests2 "${T_TESTS2:-${T_TESTS:-100}}" python3 -m pytest -q -p no:cacheprovider --timeout 120 \
                ${GPU_TESTS2:-tests/gpu} ${TESTS_K2:+-k "$TESTS_K2"} ;;
      builtin) step "$log" builtin "${T_BUILTIN:-120}" python3 bench/bench_builtin.py --budget "${BUDGET:-12}" \
                 $no_compile_flag ${ONLY:+--only "$ONLY"} --out "$OUT/builtin_h200.json" ;;
      # The same with its own case filter and file, for splitting the cases over both lanes.
      builtin2) step "$log" builtin2 "${T_BUILTIN2:-${T_BUILTIN:-120}}" python3 bench/bench_builtin.py --budget "${BUDGET:-12}" \
                  $no_compile_flag ${ONLY2:+--only "$ONLY2"} --out "$OUT/builtin2_h200.json" ;;
      # Which card helps or hurts a model, and the same forward from CUDA graphs (ABLATE_MODEL, default Gemma).
      ablate) step "$log" ablate "${T_ABLATE:-200}" python3 bench/ablate_model.py "${ABLATE_MODEL:-examples/gemma_decoder.py}" \
                --wall-time "${WALL:-45}" --out "$OUT/ablate_$(basename "${ABLATE_MODEL:-gemma}" .py)_h200.json" ;;
      # Norm cards (template against generated) and the norm regions of the example models (bench_norms.py;
      # ONLY_NORMS picks cases by name part, '|' between them; T_NORMS).
      norms) step "$log" norms "${T_NORMS:-300}" python3 bench/bench_norms.py --budget "${BUDGET:-12}" \
               $no_compile_flag ${ONLY_NORMS:+--only "$ONLY_NORMS"} --out "$OUT/norms_h200.json" ;;
      # Generated kernels (kforge.codegen) alone on pointwise and reduction cards, >= 64 MB ones included.
      codegen) step "$log" codegen "${T_CODEGEN:-240}" python3 bench/bench_codegen.py --budget "${BUDGET:-12}" \
                 $no_compile_flag ${ONLY_CODEGEN:+--only "$ONLY_CODEGEN"} --out "$OUT/codegen_h200.json" ;;
      # KernelBench (a checkout carried as .kb/; bench/README.md): item kb:LEVEL or kb:LEVEL:K/N (shard K of N
      # of the level's default list, e.g. LANE_A=kb:1:0/2 LANE_B=kb:1:1/2). T_KB seconds for the item, of which
      # the problems share T_KB - 30 (--time-budget); KB_PROBLEMS, KB_BYTES, KB_ITERS, KB_WALL (search seconds
      # per problem at most), KB_REGIONS=0 to leave fused regions out.
      kb:*) IFS=: read -r _ kb_level kb_shard <<< "$item"
            step "$log" "kernelbench-l$kb_level${kb_shard:+-${kb_shard/\//of}}" "${T_KB:-420}" python3 bench/kernelbench.py \
              --kernelbench "${KB_ROOT:-.kb}" --level "$kb_level" ${kb_shard:+--shard "$kb_shard"} \
              --time-budget "$(( ${T_KB:-420} - 30 ))" --max-bytes "${KB_BYTES:-2e8}" --iterations "${KB_ITERS:-12}" \
              --wall-time "${KB_WALL:-30}" $([ "${KB_REGIONS:-1}" = 0 ] || echo --regions) \
              ${KB_PROBLEMS:+--problems $KB_PROBLEMS} --out "$OUT/kernelbench_l${kb_level}${kb_shard:+_s${kb_shard/\//of}}_h200.json" ;;
      # The Ray backend on this GPU through a local Ray head vs the local worker: dispatched cards and
      # the overhead per candidate (bench_ray.py; RAY_MODEL, T_RAY). Needs ray's wheels in .whl/ (docs/cluster.md).
      ray) step "$log" ray "${T_RAY:-420}" python3 bench/bench_ray.py "${RAY_MODEL:-examples/sd_vae_decoder.py}" \
             --min-share 0.02 --iterations "${ITERS:-6}" --out "$OUT/ray_h200.json" ;;
      probe) step "$log" probe "${T_PROBE:-60}" python3 bench/probe_long_rows.py --out "$OUT/probe_long_rows_h200.json" ;;
      # Generated kernels over a knob grid against eager at KernelBench's scaled shapes (bench/probe_knobs.py).
      probe_knobs) step "$log" probe-knobs "${T_PROBE:-240}" python3 bench/probe_knobs.py ${PROBE_ONLY:+--only "$PROBE_ONLY"} \
                     --out "$OUT/probe_knobs_h200.json" ;;
      # Ways of streaming bytes (plain loads, L2 prefetch hints, the bulk copy engine) against eager and the copy (bench/probe_stream.py).
      probe_stream) step "$log" probe-stream "${T_PROBE:-90}" python3 bench/probe_stream.py --out "$OUT/probe_stream_h200.json" ;;
      # The host time of one call alone and queued behind GPU work (bench/probe_host.py).
      probe_host) step "$log" probe-host "${T_PROBE:-90}" python3 bench/probe_host.py --out "$OUT/probe_host_h200.json" ;;
      # SDPA's backends against the plain decomposition, per attention shape (bench/probe_attention.py).
      probe_attention) step "$log" probe-attention "${T_PROBE:-90}" python3 bench/probe_attention.py \
                         --out "$OUT/probe_attention_h200.json" ;;
      # Per call, a kforge custom op in an Inductor graph against Inductor's own extern call (issue 23).
      compile_overhead) step "$log" compile-overhead "${T_OVERHEAD:-120}" python3 bench/bench_compile_overhead.py \
                          --out "$OUT/compile_overhead_h200.json" ;;
      dispatch) step "$log" dispatch "${T_DISPATCH:-40}" python3 bench/bench_dispatch.py --iterations 4 \
                  --out "$OUT/dispatch_h200.json" ;;
      sd_vae) model "$log" sd_vae examples/sd_vae_decoder.py --min-share 0.02 ;;
      gemma) model "$log" gemma examples/gemma_decoder.py --min-share 0.02 ;;
      # 0.3 %: keeps the global pool, which reaches the GPU as mean.dim at 0.36 % of runtime.
      resnet50) model "$log" resnet50 examples/resnet50.py --min-share 0.003 ;;
      resnet50_bf16) DTYPE=bfloat16 model "$log" resnet50_bf16 examples/resnet50.py --min-share 0.003 ;;
      # The router softmax is ~0.1 % of this block's runtime: searched by name, not by share
      # ("softmax" takes softmax.int, the router's F.softmax(dtype=float32), and _softmax).
      qwen_moe) model "$log" qwen_moe examples/qwen_moe.py --ops softmax ;;
      # kforge.compile on the GPU (tests/gpu/test_compile_gpu.py), then the A/B on every example model.
      compile_tests) step "$log" compile-tests "${T_TESTS:-100}" python3 -m pytest -q -p no:cacheprovider --timeout 300 \
                       tests/gpu/test_compile_gpu.py tests/gpu/test_compile_regions_gpu.py ;;
      ab) lane "$log" ab_sd_vae ab_gemma ab_resnet50 ab_qwen_moe ;;
      ab_sd_vae) ab "$log" sd_vae examples/sd_vae_decoder.py --min-share 0.02 ;;
      ab_gemma) ab "$log" gemma examples/gemma_decoder.py --min-share 0.02 ;;
      ab_resnet50) ab "$log" resnet50 examples/resnet50.py --min-share 0.003 ;;
      ab_resnet50_bf16) DTYPE=bfloat16 ab "$log" resnet50_bf16 examples/resnet50.py --min-share 0.003 ;;
      ab_qwen_moe) ab "$log" qwen_moe examples/qwen_moe.py --ops softmax ;;
      # The same A/B on a model nobody tuned kforge for (bench/unseen_models.py: vit, swin, convnext, convnextv2,
      # efficientnet, maxvit, densenet, nfnet, llama, bert), at 0.3 % of runtime and up.
      unseen_*) UNSEEN=${item#unseen_} ab "$log" "unseen_${item#unseen_}" bench/unseen_models.py --min-share 0.003 ;;
      *) echo "unknown item $item" | tee -a "$log" ;;
    esac
  done
}
# Neither lane named: the whole default suite. One lane named: the other runs nothing unless named too
# (an unnamed LANE_B used to run the four model items after LANE_A's, minutes nobody asked for).
if [ -z "${LANE_A+x}" ] && [ -z "${LANE_B+x}" ]; then
  LANE_A="tests builtin" LANE_B="sd_vae gemma resnet50 qwen_moe dispatch"
fi
LANE_A=${LANE_A-} LANE_B=${LANE_B-}  # set but empty: the lane runs nothing
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [ "$ngpu" -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=0 lane "$OUT/lane_a.log" $LANE_A & CUDA_VISIBLE_DEVICES=1 lane "$OUT/lane_b.log" $LANE_B & wait
else
  lane "$OUT/lane_a.log" $LANE_A; lane "$OUT/lane_b.log" $LANE_B
fi
tail -n 30 "$OUT"/lane_*.log
