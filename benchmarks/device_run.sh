#!/usr/bin/env bash
# Everything the GPU machine is for, in one call (see README "On the GPU machine"):
#   bash benchmarks/device_run.sh [build] [test] [sanitize] [pair] [sharded] [mlp] [precision] [example] [cuda] [cuda_sk] [mosaic_sk] [cuda_ab] [ragged] [mosaic] [ab] [power] [triton]
#                                 [ncu] [ncu_mosaic] [ncu_sass] [bench] [full] [tune]
#   [dense] [step_kernels] [step_gemms] [step_tiles] [split_kernels] [gate] [ksplit]
# (no argument = build test sanitize bench). Full logs go to $OUT; a short table prints last.
set -uo pipefail
OUT=${OUT:-/tmp/pallas_gemm_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
stages=${*:-build test sanitize bench}
has() { [[ " $stages " == *" $1 "* ]]; }
log() { echo "== $(date +%T) $*"; }
# probe SECONDS WHAT [ARGS...]: python3 benchmarks/probe.py WHAT ARGS, logged to $OUT/WHAT_probe.log
probe() { timeout "$1" python3 benchmarks/probe.py "${@:2}" 2>&1 | tee "$OUT/$2_probe.log"; }

if has build; then
  log build
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/device.txt"
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/device.txt"
  python3 -m pip install -v --no-build-isolation --no-deps -e . \
      -Ccmake.define.PALLAS_GEMM_PTXAS_VERBOSE=ON -Cbuild.verbose=true >"$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; exit 1; }
  # Registers / spills / stack per kernel instance, sm_90 only.
  grep -A2 "for 'sm_90'" "$OUT/build.log" | grep -E "Compiling|registers|spill" | tail -30 || true
  python3 -c "import pallas_gemm; print(pallas_gemm.backends())"
fi

if has test; then
  log tests
  # eval: PYTEST_ARGS may hold a quoted expression, e.g. PYTEST_ARGS="-k 'mosaic or auto'".
  # PYTEST_FILES splits the suite over calls (the whole one-GPU suite takes longer than one).
  eval "timeout ${TEST_TIMEOUT:-480} python3 -m pytest -q -rs -p no:cacheprovider --timeout 120 ${PYTEST_ARGS:-} ${PYTEST_FILES:-tests}" 2>&1 \
    | tee "$OUT/tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" | cut -c1-220 | tail -60
fi

if has sanitize; then
  log compute-sanitizer
  for tool in memcheck racecheck synccheck; do
    timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 python3 benchmarks/sanitize_cuda.py \
      >"$OUT/sanitize_$tool.log" 2>&1
    echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -1)"
  done
fi

if has pair; then
  log "K split over 2 GPUs: the pair kernels' tests (mosaic.pair_gemm, and the NCCL path's)"
  timeout 300 python3 -m pytest -q -rs -p no:cacheprovider --timeout 240 tests/test_sharding.py \
      -k "exchanges or k_sharded" 2>&1 | tee "$OUT/pair_tests.log" | tail -15
fi

if has sharded; then
  log "gemm vs jnp.dot under jit shardings over $(nvidia-smi -L | wc -l) GPUs"
  timeout 500 python3 -m benchmarks --sharded --out "$OUT/sharded" ${SHARDED_ARGS:-} 2>&1 | tee "$OUT/sharded.log"
fi

if has mlp; then
  log "MLP training step and alpha/beta*C epilogue vs XLA"
  timeout 400 python3 -m benchmarks --mlp --out "$OUT/mlp" 2>&1 | tee "$OUT/mlp.log"
fi

if has precision; then
  log "float32 precisions (presets, float32_accurate): gemm vs jnp.dot, speed and error"
  timeout 500 python3 -m benchmarks --precision --out "$OUT/precision" ${PRECISION_ARGS:-} 2>&1 \
    | tee "$OUT/precision.log"
fi

if has example; then
  log "examples/flax_mlp.py --full: stock Flax vs dot_general vs fused layers"
  timeout 400 python3 examples/flax_mlp.py --full --out "$OUT/example" 2>&1 | tee "$OUT/example.log"
fi

if has dense; then
  log "bf16 MLP step: the bias + GELU epilogue written several ways, and the GEMMs XLA compiled"
  probe 400 dense
fi

if has step_kernels; then
  log "the kernels of one bf16 MLP step per variant (CUPTI)"
  probe 300 step_kernels
fi

if has step_tiles; then
  log "the mlp step's mosaic GEMMs with config variants (CUPTI)"
  probe 500 step_tiles
fi

if has split_kernels; then
  log "float32_accurate: its kernels and the fusions of the split pass (CUPTI, HLO)"
  probe 200 split_kernels
fi

if has gate; then
  log "the step's gated GEMM dz = g @ W2^T: plain / + C / * act'(C) (CUPTI)"
  probe 200 gate
fi

if has step_gemms; then
  log "the bf16 MLP step's GEMMs one by one (CUPTI): jnp.dot expression vs xla vs mosaic"
  probe 300 step_gemms
fi

if has ksplit; then
  log "K-sharded bf16 16384^3: row chunks, fewer CTAs, psum vs reduce-scatter (default XLA flags, then without command buffers)"
  probe 280 ksplit
  echo "-- without command buffers (CUDA graphs)"
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" OUT= timeout 280 \
    python3 benchmarks/probe.py ksplit 2>&1 | tee "$OUT/ksplit_nocb_probe.log"
fi

if has cuda; then
  log cuda kernel probe
  for n in ${CUDA_SIZES:-4096}; do
    timeout 200 python3 benchmarks/probe.py cuda "$n" 2>&1 | tee -a "$OUT/cuda_probe.log"
  done
fi

if has cuda_sk; then
  log cuda kernel with stream-K on and off, called in turn with jnp.dot
  probe 400 cuda_sk
fi

if has mosaic_sk; then
  log mosaic default config with stream-K on and off, called in turn with jnp.dot
  probe 400 mosaic_sk
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
  PYTHONPATH=. PALLAS_GEMM_CUDA_LIB=${libs[0]} timeout 400 python3 benchmarks/probe.py cuda_ab "${libs[@]}" 2>&1 \
    | tee "$OUT/cuda_ab.log"
fi

if has ragged; then
  log where a ragged mosaic GEMM spends its time
  probe 200 ragged 4096
fi

if has mosaic; then
  log mosaic configs vs jnp.dot and hopper_matmul_mgpu
  probe 400 mosaic
fi

if has ab; then
  log mosaic variants vs jnp.dot, called in turn
  probe 300 ab ${AB_ARGS:-}
fi

if has power; then
  log clock and power while each GEMM runs back to back
  for n in 4096 8192; do
    timeout 150 python3 benchmarks/probe.py power "$n" 2>&1 | tee -a "$OUT/power_probe.log"
  done
fi

if has triton; then
  log triton variants at bf16 4096^3
  probe 200 triton
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
  # XLA's autotuner launches cuBLAS while compiling jnp.dot: those launches (same kernel as
  # the one it keeps, nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT, on the H200) are the
  # first two nvjet captures; the mosaic kernel is captured from its own process.
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
  # cuBLAS SGEMM vs the cuda kernel (f32), cuBLAS vs the mosaic kernel (bf16). probe.py once
  # brackets one warmed-up call with cuProfilerStart/Stop, so only that call is profiled.
  mkdir -p "$OUT/ncu_sass"
  for what in ${NCU_WHAT:-dot32 cuda dot16 mosaic}; do
    timeout 150 ncu --clock-control none --profile-from-start off -c 4 --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
        --section LaunchStats --section InstructionStats \
        --metrics sass__inst_executed_per_opcode,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
        --print-metric-instances values \
        python3 benchmarks/probe.py once "$what" >"$OUT/ncu_sass/ncu_$what.txt" 2>&1; echo "ncu $what rc=$?"
    grep -E "^  [a-zA-Z_0-9].*\(|Duration|SM Frequency|Registers Per|Block Size|Grid Size|Issue Slots|Executed Ipc A|Executed Instructions  |Dynamic Shared" \
        "$OUT/ncu_sass/ncu_$what.txt" | cut -c1-160 | head -24
    grep -E "sass__inst_executed_per_opcode" "$OUT/ncu_sass/ncu_$what.txt" | cut -c1-1500
    # The SASS with per-instruction execution counts (source page), for reading the main loop.
    timeout 150 ncu --clock-control none --profile-from-start off -c 1 --section SourceCounters \
        --page source --print-source sass --csv python3 benchmarks/probe.py once "$what" \
        >"$OUT/ncu_sass/sass_$what.csv" 2>&1; echo "sass $what rc=$? lines $(wc -l <"$OUT/ncu_sass/sass_$what.csv")"
    gzip -f "$OUT/ncu_sass/sass_$what.csv"
  done
fi

if has bench; then
  log benchmark
  timeout 400 python3 -m benchmarks --gpu-default --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -60
fi
if has full; then
  log full benchmark
  timeout 540 python3 -m benchmarks --full --out "$OUT/full" 2>&1 | tee "$OUT/full.log" | tail -80
fi
if has tune; then
  log autotune
  timeout ${TUNE_TIMEOUT:-300} python3 -m benchmarks --autotune ${TUNE_ARGS:-} --out "$OUT/tune" 2>&1 \
    | tee "$OUT/tune.log" | tail -40
  # A new process (a "restart"): gemm(config=None) now finds the tuned configs in the cache.
  python3 -c "import json, pallas_gemm.tuning as t; p = t.cache_path(); e = json.loads(p.read_text())
print('cache', p, 'entries:', len(e.get('entries', e)))
for k in list(e.get('entries', e))[:5]: print('  ', k)
import jax.numpy as jnp, pallas_gemm.triton as tr
print('lookup 16x8192x8192 bf16 triton ->', t.lookup_config('triton', tr.Config, 16, 8192, 8192, jnp.bfloat16, None))"
fi
# At most 8 files come back from $OUT: pack the result folders (plots, JSON, markdown).
for d in bench full tune ncu_sass; do
  [ -d "$OUT/$d" ] && tar -C "$OUT" -czf "$OUT/$d.tgz" "$d" && rm -rf "${OUT:?}/$d"
done
