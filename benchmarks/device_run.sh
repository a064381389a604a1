#!/usr/bin/env bash
# Everything the GPU machine is for, in one call: build, test, benchmark.
#   bash benchmarks/device_run.sh [STAGE ...]       (no argument: build test sanitize headline)
# Stages:
#   build       pip install -e . (ptxas register/spill report), the backends found
#   test        the test suite (PYTEST_ARGS, PYTEST_FILES, TEST_TIMEOUT; TEST_WORKERS parallel
#               workers on the one GPU when pytest-xdist's wheels are carried in .whl/)
#   sanitize    compute-sanitizer memcheck / racecheck / synccheck on the cuda kernel
#   headline    python -m benchmarks: the headline sweep vs jnp.dot, then each family's key rows
#   mlp         python -m benchmarks --mlp: SGD and AdamW training steps, A/A check (~3-4 min)
#   precision   python -m benchmarks --precision: float32 presets, speed and error
#   ragged      python -m benchmarks --ragged: grouped GEMM
#   fp8         python -m benchmarks --fp8: fp8 GEMMs with scales
#   example     examples/flax_mlp.py --full
#   moe         python -m benchmarks --moe: moe_mlp vs the unfused layer (pallas_gemm, tokamax, lax)
#               and the dense-MLP ceiling (MOE_ARGS)
#   moe_example examples/moe.py --full: the MoE block on jax.lax.ragged_dot, pallas_gemm.ragged_dot
#               and moe_mlp (on several GPUs also --expert-parallel: experts over every GPU vs
#               one GPU); then examples/moe_transformer.py --full: a MoE transformer's AdamW
#               step on moe_mlp vs on the ragged_dot block
#   fp8_mlp     examples/fp8_mlp.py --full: the MLP trained in bf16 and in fp8
#   bench       python -m benchmarks --gpu-default (square, ragged, skinny, batched; ~5 min)
#   full        python -m benchmarks --full (~7-9 min)
#   tune        python -m benchmarks --autotune (TUNE_ARGS, TUNE_TIMEOUT), then a cache lookup
#   pair        2 GPUs: the K-split pair kernels' tests
#   sharded     2+ GPUs: python -m benchmarks --sharded (SHARDED_ARGS; SHARDED_DEVICES: one
#               run per count listed, e.g. "2 4")
#   suite       the whole suite in one call: one-GPU file groups side by side (SUITE_GROUPS,
#               ";"-separated, group i on GPU i mod count; SUITE_WORKERS each), the files with
#               several-device tests over every GPU at the same time (SUITE_TIMEOUT)
#   multi_tests 2+ GPUs: the tests that split work over devices (test_moe_parallel.py,
#               test_ragged_sharding.py, test_fp8_sharding.py,
#               test_sharding.py), in one process over every GPU
#   moe_parallel 2+ GPUs: python -m benchmarks --moe --expert-parallel (MOE_PARALLEL_ARGS)
#   probes (python -m benchmarks.probe, see its --help):
#   configs     mosaic configs vs jnp.dot and hopper_matmul_mgpu (CONFIGS_ARGS)
#   ab          mosaic config variants vs jnp.dot, call by call (AB_ARGS, e.g. "8192 wgmma_wait=1")
#   cuda        compiled cuda configs x transposes (CUDA_SIZES)
#   cuda_ab     builds of cuda_sgemm.cu with different -D switches (CUDA_VARIANTS)
#   kernels     the kernels of one MLP step and of float32_accurate (CUPTI, by name)
#   pad         where a misaligned bf16 GEMM's time goes
#   power       SM clock and power while GEMMs run back to back
#   ncu ncu_mosaic ncu_sass   Nsight Compute reports of the cuda / mosaic kernels vs cuBLAS
# Full logs go to $OUT (default /tmp/pallas_gemm_out); the short table prints last.
set -uo pipefail
export OUT=${OUT:-/tmp/pallas_gemm_out}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.md"
: >"$SUMMARY"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
stages=${*:-build test sanitize headline}
has() { [[ " $stages " == *" $1 "* ]]; }
log() { echo "== $(date +%T) $*"; }
# summary TITLE: stdin goes under "### TITLE" in $SUMMARY, printed at the end.
summary() { { echo "### $1"; cat; echo; } >>"$SUMMARY"; }
# bench SECONDS NAME ARGS...: python3 -m benchmarks ARGS --out $OUT/NAME, logged to $OUT/NAME.log
bench() {
  timeout "$1" python3 -m benchmarks "${@:3}" --out "$OUT/$2" 2>&1 | tee "$OUT/$2.log"
  echo "$2 rc=${PIPESTATUS[0]}" | summary "$2"
}
# probe SECONDS WHAT [ARGS...]: python3 -m benchmarks.probe WHAT ARGS, logged to $OUT/WHAT_probe.log
probe() { timeout "$1" python3 -m benchmarks.probe "${@:2}" 2>&1 | tee -a "$OUT/$2_probe.log"; }

if has build; then
  log build
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/device.txt"
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/device.txt"
  python3 -m pip install -v --no-build-isolation --no-deps -e . \
      -Ccmake.define.PALLAS_GEMM_PTXAS_VERBOSE=ON -Cbuild.verbose=true >"$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; exit 1; }
  # Registers / spills / stack per kernel instance, sm_90 only.
  grep -A2 "for 'sm_90'" "$OUT/build.log" | grep -E "Compiling|registers|spill" | tail -30 || true
  echo "$(grep -c 'spill stores' "$OUT/build.log") sm_90 kernels, $(grep 'spill stores' "$OUT/build.log" \
    | grep -vc ' 0 bytes spill stores') with spills" | summary build
  python3 -c "import pallas_gemm; print(pallas_gemm.backends())" | tee -a "$OUT/device.txt"
fi

# xdist_flag N: "-n N" when pytest-xdist's wheels were carried in .whl/ (installed once).
xdist_flag() {
  if ls .whl/pytest_xdist-*.whl >/dev/null 2>&1 && { python3 -c 'import xdist' 2>/dev/null ||
      python3 -m pip install -q --no-deps --no-index .whl/pytest_xdist-*.whl .whl/execnet-*.whl \
        >"$OUT/xdist_install.log" 2>&1; }; then
    echo "-n $1"
  fi
}

if has test; then
  log tests
  # eval: PYTEST_ARGS may hold a quoted expression, e.g. PYTEST_ARGS="-k 'mosaic or auto'".
  # PYTEST_FILES splits the suite over calls (the whole one-GPU suite takes longer than one).
  workers=$(xdist_flag "${TEST_WORKERS:-4}")
  # -v: one line per test as it ends, so a run cut off by TEST_TIMEOUT still names every
  # test that failed and counts those that passed.
  eval "timeout ${TEST_TIMEOUT:-480} python3 -m pytest -v -rfEs -p no:cacheprovider --timeout 300 $workers ${PYTEST_ARGS:-} ${PYTEST_FILES:-tests}" 2>&1 \
    | tee "$OUT/tests.log" | grep -E "(FAILED|ERROR) |passed|failed" | cut -c1-220 | tail -60
  { grep -E "(FAILED|ERROR) |passed|failed" "$OUT/tests.log" | tail -12
    echo "per-test lines: $(grep -c ' PASSED' "$OUT/tests.log") passed, $(grep -c ' SKIPPED' "$OUT/tests.log") skipped, $(grep -cE ' (FAILED|ERROR)' "$OUT/tests.log") failed or errors"
  } | summary tests
fi

if has sanitize; then
  log compute-sanitizer
  for tool in memcheck racecheck synccheck; do
    timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 python3 benchmarks/sanitize_cuda.py \
      >"$OUT/sanitize_$tool.log" 2>&1
    echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -1)"
  done | tee /dev/stderr | summary sanitize
fi

if has headline; then
  log "headline sweep: bf16, f32 HIGHEST, float32_accurate, dense bias+gelu vs jnp.dot; ragged_dot, fp8, moe_mlp"
  bench 480 headline --headline
  grep '^|' "$OUT/headline/headline.md" | summary "headline table"
fi

if has mlp; then
  log "MLP training steps (SGD, AdamW) and alpha/beta*C: pallas_gemm vs XLA, A/A check"
  bench 400 mlp --mlp ${MLP_ARGS:-}
  grep -E '^\| (bf16|f32)' "$OUT/mlp/mlp.md" | cut -d'|' -f2-10 | summary "mlp steps (dtype | M, D, H | step | variant | ms | x stock | IQR | min-max | verdict)"
fi

if has precision; then
  log "float32 precisions (presets, float32_accurate): gemm vs jnp.dot, speed and error"
  bench 500 precision --precision ${PRECISION_ARGS:-}
fi

# tokamax, the grouped-GEMM peer, when its wheels were carried (never a dependency):
# .wheels-tokamax/ holds them and stubs/ stands in for its profiling-only import.
with_tokamax() {
  if [ -d .wheels-tokamax ]; then
    python3 -m pip install -q --no-deps --no-index .wheels-tokamax/*.whl >"$OUT/tokamax_install.log" 2>&1
    export PYTHONPATH="$PWD/.wheels-tokamax/stubs${PYTHONPATH:+:$PYTHONPATH}"
  fi
}

if has ragged; then
  log "grouped GEMM (ragged_dot) vs jax.lax.ragged_dot"
  with_tokamax
  bench 400 ragged --ragged ${RAGGED_ARGS:-}
  tail -n 20 "$OUT/ragged.log" | summary "ragged (last lines)"
fi

if has fp8; then
  log "fp8 GEMMs with scales vs jnp"
  bench 580 fp8 --fp8 ${FP8_ARGS:-}
  tail -n 20 "$OUT/fp8.log" | summary "fp8 (last lines)"
fi

if has example; then
  log "examples/flax_mlp.py --full: stock Flax vs dot_general vs fused layers"
  timeout 400 python3 examples/flax_mlp.py --full --out "$OUT/example" 2>&1 | tee "$OUT/example.log"
  grep -E "ms/step|loss curve" "$OUT/example.log" | summary example
fi

if has moe; then
  log "the MoE layer: moe_mlp vs the unfused layer and the dense-MLP ceiling"
  with_tokamax
  bench ${MOE_TIMEOUT:-560} moe --moe ${MOE_ARGS:-}
  grep '^|' "$OUT/moe/moe.md" | summary "moe table"
fi

if has moe_example; then
  log "examples/moe.py --full and examples/moe_transformer.py --full"
  ep=$([ "$(nvidia-smi -L | wc -l)" -gt 1 ] && echo --expert-parallel || true)
  timeout 400 python3 examples/moe.py --full $ep --out "$OUT/moe_example" 2>&1 \
    | tee "$OUT/moe_example.log"
  tail -n 12 "$OUT/moe_example.log" | summary moe_example
  timeout 300 python3 examples/moe_transformer.py --full --out "$OUT/moe_transformer" 2>&1 \
    | tee "$OUT/moe_transformer.log"
  tail -n 4 "$OUT/moe_transformer.log" | summary moe_transformer
fi

if has fp8_mlp; then
  log "examples/fp8_mlp.py --full: the MLP in bf16 and in fp8"
  timeout 400 python3 examples/fp8_mlp.py --full --out "$OUT/fp8_mlp" 2>&1 | tee "$OUT/fp8_mlp.log"
  tail -n 12 "$OUT/fp8_mlp.log" | summary fp8_mlp
fi

if has bench; then
  log "benchmark --gpu-default"
  bench 400 bench --gpu-default | tail -60
  sed -n '/^## Summary/,$p' "$OUT/bench/results.md" | grep '^|' | summary "bench summary"
fi

if has full; then
  log "benchmark --full"
  bench 540 full --full | tail -80
  sed -n '/^## Summary/,$p' "$OUT/full/results.md" | grep '^|' | summary "full summary"
fi

if has tune; then
  log autotune
  timeout ${TUNE_TIMEOUT:-300} python3 -m benchmarks --autotune ${TUNE_ARGS:-} --out "$OUT/tune" 2>&1 \
    | tee "$OUT/tune.log" | tail -40
  # A new process: gemm(config=None) now finds the tuned configs in the cache.
  python3 -c "import json, pallas_gemm.matmul.tuning as t; p = t.cache_path(); e = json.loads(p.read_text())
print('cache', p, 'entries:', len(e.get('entries', e)))
for k in list(e.get('entries', e))[:5]: print('  ', k)"
fi

if has pair; then
  log "K split over 2 GPUs: the pair kernels' tests (mosaic.pair_gemm, and the NCCL path's)"
  timeout 300 python3 -m pytest -q -rs -p no:cacheprovider --timeout 240 tests/test_sharding.py \
      -k "exchanges or k_sharded" 2>&1 | tee "$OUT/pair_tests.log" | tail -15
  tail -1 "$OUT/pair_tests.log" | summary pair
fi

if has sharded; then
  for n in ${SHARDED_DEVICES:-$(nvidia-smi -L | wc -l)}; do
    log "gemm vs jnp.dot under jit shardings over $n GPUs"
    timeout ${SHARDED_TIMEOUT:-500} python3 -m benchmarks --sharded --devices "$n" \
        --out "$OUT/sharded_$n" ${SHARDED_ARGS:-} 2>&1 | tee "$OUT/sharded_$n.log"
    grep -E "^(bf16|f32)" "$OUT/sharded_$n.log" | cut -c1-80 | summary "sharded over $n GPUs"
  done
fi

# The whole suite in one call: the one-GPU test files in groups side by side, group i on
# GPU i mod (GPU count), and the files with tests that need several devices (the sharding
# files; examples, benchmarks and dot_general have a few) in one pytest over every GPU at
# the same time. Tests are not timed, so sharing a GPU or the CPUs changes no result; a
# file in no group joins the last one, so a new test file is never left out.
MULTI_FILES="tests/test_moe_parallel.py tests/test_ragged_sharding.py tests/test_sharding.py tests/test_fp8_sharding.py"
ALL_GPU_FILES="$MULTI_FILES tests/test_examples.py tests/test_benchmarks_cli.py tests/test_dot_general.py"
if has suite; then
  log "the whole suite: one-GPU file groups side by side, the several-GPU files over every GPU"
  ngpu=$(nvidia-smi -L | wc -l)
  IFS=';' read -ra groups <<<"${SUITE_GROUPS:-tests/test_gemm.py tests/test_precision.py \
tests/test_errors.py tests/test_auto.py tests/test_unpad.py tests/test_layout.py tests/test_tuning.py \
tests/test_flax.py;tests/test_mosaic.py tests/test_triton.py tests/test_cuda_plumbing.py; \
tests/test_ragged_kernels.py tests/test_ragged_dot.py tests/test_moe.py;tests/test_scaled_kernels.py \
tests/test_scaled_matmul.py}"
  for f in tests/test_*.py; do
    [[ " ${groups[*]} $ALL_GPU_FILES " == *" $f "* ]] || groups[-1]+=" $f"
  done
  workers=$(xdist_flag "${SUITE_WORKERS:-8}")
  run_group() {  # run_group NAME DEVICES FILES...
    CUDA_VISIBLE_DEVICES=$2 timeout "${SUITE_TIMEOUT:-540}" python3 -m pytest -v -rfEs \
      -p no:cacheprovider --timeout 300 $workers "${@:3}" >"$OUT/suite_$1.log" 2>&1
  }
  for i in "${!groups[@]}"; do
    run_group "$i" $((i % ngpu)) ${groups[$i]} &
  done
  all=$(seq -s, 0 $((ngpu - 1)))
  run_group multi "$all" $ALL_GPU_FILES &
  wait
  for log in "$OUT"/suite_*.log; do
    echo "$(basename "$log" .log): $(grep -c ' PASSED' "$log") passed, $(grep -c ' SKIPPED' "$log")" \
      "skipped, $(grep -cE ' (FAILED|ERROR)' "$log") failed or errors; $(tail -n 1 "$log" | cut -c1-160)"
    grep -E "^(FAILED|ERROR) " "$log" | cut -c1-220
  done | tee /dev/stderr | summary suite
fi

if has multi_tests; then
  log "tests over every GPU: expert-parallel moe_mlp, gemm's partitioning"
  timeout ${MULTI_TEST_TIMEOUT:-560} python3 -m pytest -v -rfEs -p no:cacheprovider --timeout 240 \
      $MULTI_FILES 2>&1 | tee "$OUT/multi_tests.log" \
    | grep -E "(FAILED|ERROR) |passed|failed" | cut -c1-220 | tail -30
  grep -E "(FAILED|ERROR) |passed|failed" "$OUT/multi_tests.log" | tail -8 | summary multi_tests
fi

if has moe_parallel; then
  log "expert-parallel moe_mlp: weak and strong scaling over 1, 2, 4, ... GPUs"
  bench ${MOE_PARALLEL_TIMEOUT:-560} moe_parallel --moe --expert-parallel ${MOE_PARALLEL_ARGS:-}
  grep '^|' "$OUT/moe_parallel/moe_parallel.md" | summary "moe_parallel table"
fi

if has configs; then
  log mosaic configs vs jnp.dot and hopper_matmul_mgpu
  probe 400 configs ${CONFIGS_ARGS:-}
fi

if has ab; then
  log mosaic config variants vs jnp.dot, called in turn
  probe 300 ab ${AB_ARGS:-8192 wgmma_wait=1 stream_k=False}
fi

if has cuda; then
  log cuda kernel configs
  for n in ${CUDA_SIZES:-4096}; do probe 200 cuda "$n"; done
fi

if has cuda_ab; then
  log cuda kernel builds with different -D switches, called in turn
  # CUDA_VARIANTS: space-separated variants, each a comma-separated list of -D flags
  # (or "base"); each is built for sm_90 only and registered under its own FFI target.
  inc=$(python3 -c "import jax.ffi; print(jax.ffi.include_dir())")
  mkdir -p /tmp/cuda_ab && rm -f /tmp/cuda_ab/*.so
  for v in ${CUDA_VARIANTS:-base}; do
    name=$(echo "$v" | tr -d ' -' | tr ',=' '_.')
    flags=$([ "$v" = base ] || echo "${v//,/ }")
    # Hidden visibility as in CMakeLists.txt: otherwise each build's cudart and kernel
    # symbols can bind to another loaded copy's.
    nvcc -shared -Xcompiler -fPIC,-fvisibility=hidden -arch=sm_90 -O3 -std=c++17 -diag-suppress=940,2473 -Xptxas=-v \
      -I"$inc" $flags pallas_gemm/cuda_sgemm.cu -o "/tmp/cuda_ab/$name.so" >"/tmp/cuda_ab/$name.log" 2>&1 &
  done
  wait
  for f in /tmp/cuda_ab/*.log; do
    echo "$(basename "$f" .log): $(grep -c 'spill stores' "$f") kernels, $(grep 'spill stores' "$f" | grep -vc ' 0 bytes spill stores') with spills"
  done
  # Runs from the source tree without an install (the first build serves as the package's library).
  libs=(/tmp/cuda_ab/*.so)
  PYTHONPATH=. PALLAS_GEMM_CUDA_LIB=${libs[0]} timeout 400 python3 -m benchmarks.probe cuda_ab "${libs[@]}" 2>&1 \
    | tee "$OUT/cuda_ab.log"
fi

if has kernels; then
  log "the kernels of one MLP step and of float32_accurate (CUPTI)"
  probe 300 kernels step
  probe 200 kernels accurate
fi

if has pad; then
  log where a misaligned mosaic GEMM spends its time
  probe 200 pad 4096
fi

if has power; then
  log clock and power while each GEMM runs back to back
  for n in 4096 8192; do probe 150 power "$n"; done
fi

if has ncu; then
  log ncu of the cuda kernel at 4096^3
  timeout 240 ncu --clock-control none -k regex:Sgemm -c 1 --section SpeedOfLight \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SchedulerStats \
      --section WarpStateStats --section Occupancy --section LaunchStats --section InstructionStats \
      --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
      python3 -c "import jax, jax.numpy as jnp, pallas_gemm as p; a = jax.random.normal(jax.random.key(0), (4096, 4096)); p.gemm(a, a, backend='cuda').block_until_ready()" \
      >"$OUT/ncu_cuda.txt" 2>&1; echo "ncu rc=$?"
  grep -E "Duration|Throughput|Registers|Achieved Occupancy|Issue Slots|Warp Cycles Per Issued|Bank" "$OUT/ncu_cuda.txt" | head -20
  # Stall reasons, in cycles per issued instruction, largest first.
  grep -E "issue_stalled_.*ratio" "$OUT/ncu_cuda.txt" | sort -k3 -g -r | head -10
fi

if has ncu_mosaic; then
  log ncu of cuBLAS and the mosaic kernel, bf16 4096^3
  # XLA's autotuner launches cuBLAS while compiling jnp.dot: those launches (the same kernel
  # as the one it keeps) are the first nvjet captures; the mosaic kernel is captured from
  # its own process.
  for target in "pallas_gemm_mosaic mosaic" "nvjet jnp.dot"; do
    set -- $target
    timeout 150 ncu --clock-control none -k regex:"$1" -c 2 --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section LaunchStats --section Occupancy \
        python3 -c "import jax, jax.numpy as jnp, pallas_gemm as p
a = jax.random.normal(jax.random.key(0), (4096, 4096), jnp.bfloat16)
f = jax.jit(lambda a: p.gemm(a, a, backend='mosaic') if '$2' == 'mosaic' else jnp.dot(a, a))
f(a).block_until_ready()" >>"$OUT/ncu_mosaic.txt" 2>&1; echo "ncu $2 rc=$?"
  done
  grep -E "^  [a-zA-Z_0-9]+.*\(|Duration|SM Frequency|Throughput|Registers Per|Warp Cycles Per Issued|Achieved Occupancy|Stall|Issue Slots|Executed Ipc" \
      "$OUT/ncu_mosaic.txt" | head -80
fi

if has ncu_sass; then
  log ncu: kernel, launch, issue and per-opcode instruction counts of one 4096^3 GEMM each
  # cuBLAS SGEMM vs the cuda kernel (f32), cuBLAS vs the mosaic kernel (bf16). `probe once`
  # brackets one warmed-up call with cuProfilerStart/Stop, so only that call is profiled.
  mkdir -p "$OUT/ncu_sass"
  for what in ${NCU_WHAT:-dot32 cuda dot16 mosaic}; do
    timeout 150 ncu --clock-control none --profile-from-start off -c 4 --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
        --section LaunchStats --section InstructionStats \
        --metrics sass__inst_executed_per_opcode,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
        --print-metric-instances values \
        python3 -m benchmarks.probe once "$what" >"$OUT/ncu_sass/ncu_$what.txt" 2>&1; echo "ncu $what rc=$?"
    grep -E "^  [a-zA-Z_0-9].*\(|Duration|SM Frequency|Registers Per|Block Size|Grid Size|Issue Slots|Executed Ipc A|Executed Instructions  |Dynamic Shared" \
        "$OUT/ncu_sass/ncu_$what.txt" | cut -c1-160 | head -24
    grep -E "sass__inst_executed_per_opcode" "$OUT/ncu_sass/ncu_$what.txt" | cut -c1-1500
    # The SASS with per-instruction execution counts (source page), for reading the main loop.
    timeout 150 ncu --clock-control none --profile-from-start off -c 1 --section SourceCounters \
        --page source --print-source sass --csv python3 -m benchmarks.probe once "$what" \
        >"$OUT/ncu_sass/sass_$what.csv" 2>&1; echo "sass $what rc=$? lines $(wc -l <"$OUT/ncu_sass/sass_$what.csv")"
    gzip -f "$OUT/ncu_sass/sass_$what.csv"
  done
fi

# Few files come back from $OUT: each result folder (JSON, markdown, plots) as one archive.
for d in headline mlp precision ragged fp8 example moe fp8_mlp bench full tune sharded ncu_sass; do
  [ -d "$OUT/$d" ] && tar -C "$OUT" -czf "$OUT/$d.tgz" "$d" && rm -rf "${OUT:?}/$d"
done
log "summary (full logs in $OUT)"
cat "$SUMMARY"
