#!/usr/bin/env bash
# The ROCm job: build the ROCm extension (CK attention + small-seq kernels), run
# the GPU tests, run the benchmarks. Meant for an AMD GPU machine with ROCm in a
# ROCm JAX container (ROCm under ROCM_PATH, jax with its ROCm plugin); works the
# same by hand.   ci/rocm.sh [all|build|test|bench] [extra pytest args...]
# NOT YET RUN ON AMD HARDWARE (see docs/ROCM.md).
# GPU targets: FUSEDATTN_HIP_ARCHS (default: what rocm_agent_enumerator reports,
# else gfx90a;gfx942). CK: ci/fetch_ck.sh (FUSEDATTN_CK_DIR or the amd-aiter wheel).
# Logs under ${OUT:-build/ci-rocm}.
set -euo pipefail
cd "$(dirname "$0")/.."
step=${1:-all}; shift || true
log_dir=${OUT:-build/ci-rocm}; mkdir -p "$log_dir"
export PYTHONUNBUFFERED=1
export ROCM_PATH=${ROCM_PATH:-/opt/rocm}
export HIPCXX=${HIPCXX:-$ROCM_PATH/llvm/bin/clang++}
pkg=${FUSEDATTN_PKG_DIR:-/tmp/fusedattn-pkg}

if [[ $step == all || $step == build ]]; then
  archs=${FUSEDATTN_HIP_ARCHS:-}
  if [[ -z $archs ]] && command -v rocm_agent_enumerator >/dev/null; then
    archs=$(rocm_agent_enumerator | grep -v '^gfx000$' | sort -u | paste -sd';' || true)
  fi
  archs=${archs:-gfx90a;gfx942}
  # Build tools the ROCm JAX image may lack (the build runs without isolation).
  python3 -c "import scikit_build_core, pybind11" 2>/dev/null ||
    python3 -m pip install -q scikit-build-core pybind11 cmake ninja
  FUSEDATTN_CK_DIR=$(bash ci/fetch_ck.sh)
  export FUSEDATTN_CK_DIR
  echo "fusedattn: ROCm build for $archs with $HIPCXX; CK from $FUSEDATTN_CK_DIR" | tee "$log_dir/build.log"
  # Hundreds of CK instances: use every core. --no-build-isolation: the build reads
  # XLA's FFI headers from the installed jax.
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
  CMAKE_ARGS="-DCMAKE_HIP_ARCHITECTURES=$archs ${CMAKE_ARGS:-}" \
  FUSEDATTN_GPU=rocm python3 -m pip install --no-build-isolation --no-deps --no-cache-dir \
    --target "$pkg" -v . 2>&1 | tee -a "$log_dir/build.log" | grep -E "fusedattn|error" || true
  test -n "$(ls "$pkg"/fusedattn/_rocm*.so 2>/dev/null)" || {
    echo "ROCm extension not built"; tail -50 "$log_dir/build.log"; exit 1; }
fi
export PYTHONPATH=$pkg:${PYTHONPATH:-}
python3 -m fusedattn info | tee "$log_dir/info.txt"

if [[ $step == all || $step == test ]]; then
  python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider "$@" 2>&1 | tee "$log_dir/gpu-tests.log"
fi
if [[ $step == all || $step == bench ]]; then
  for b in benchmarks/bench_*.py; do
    [[ -e $b && $b != *cpu* ]] || continue
    b=$(basename "$b" .py)
    python3 -m "benchmarks.$b" 2>&1 | tee "$log_dir/$b.log"
  done
  cp benchmarks/results/* "$log_dir/" 2>/dev/null || true
fi
