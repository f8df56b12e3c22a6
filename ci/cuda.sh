#!/usr/bin/env bash
# The CUDA job: build the CUDA extension, run the GPU tests, run the benchmarks.
# Works the same on a CUDA CI runner and by hand (and through the device tool).
# With two or more GPUs the sharding tests (tests/gpu/test_sharding_gpu.py) and
# benchmarks/bench_sharding.py run too; with one they skip and say so.
#   ci/cuda.sh [all|build|test|parallel|bench|sharding] [extra pytest args...]
# "parallel": the GPU tests but the sharding ones as PER_GPU (default 4) processes on
# each GPU, each a FUSEDATTN_GPU_SHARD with its own plan cache and a share of GPU
# memory; most of a GPU test's time is compiling on the host, which this spreads over
# its cores. SHARD_TIMEOUT (seconds) ends a shard with pytest's own summary.
# "sharding" (2 or more GPUs): the sharding tests on all GPUs, then on the first two
# where there are more (SHARDING_ON_TWO=0 skips that), then bench_sharding; it goes on
# past failures and exits non-zero after. Its time on a 4-GPU machine is in
# benchmarks/results/SUMMARY.md (it can pass the device tool's per-command limit).
# FUSEDATTN_GPU_SHARD=i/n runs every n-th GPU test from the i-th (tests/gpu/conftest.py):
# the whole suite in n calls of a machine that limits each command's time.
# Results: benchmarks/results/*.json|png, logs under ${OUT:-build/ci-cuda}.
set -euo pipefail
cd "$(dirname "$0")/.."
step=${1:-all}; shift || true
log_dir=${OUT:-build/ci-cuda}; mkdir -p "$log_dir"
export PYTHONUNBUFFERED=1
# Never NVLink multicast on shared multi-GPU hosts (it can take the host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# Wheels the machine lacks (cudnn-frontend headers, flash-attn3-jax, nvidia-cutlass for the
# block-sparse backward kernel: without it the extension builds without that kernel) may
# travel in .whl/.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/fusedattn-site .whl/*.whl
  export PYTHONPATH=/tmp/fusedattn-site${PYTHONPATH:+:$PYTHONPATH}
fi

if [[ $step == all || $step == build || ! -d /tmp/fusedattn-pkg/fusedattn ]]; then
  # A C++ toolchain that links libstdc++ statically into shared objects (no
  # libstdc++.so beside it; seen with /opt/gcc on the GPU image) breaks iostreams
  # inside the extension (cudnn-frontend crashes formatting a number): prefer the
  # system compiler then.
  cxx=${CXX:-c++}
  if [[ $("$cxx" -print-file-name=libstdc++.so 2>/dev/null) == libstdc++.so && -x /usr/bin/g++ ]]; then
    echo "ci/cuda.sh: $cxx has no shared libstdc++; building with /usr/bin/g++"
    export CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
  fi
  # --no-build-isolation: the build reads XLA's FFI headers from the installed jax.
  rm -rf /tmp/fusedattn-pkg  # a fresh install: pip --target never replaces an older one
  FUSEDATTN_GPU=cuda python3 -m pip install --no-build-isolation --no-deps --no-cache-dir \
    --target /tmp/fusedattn-pkg -v . 2>&1 | tee "$log_dir/build.log" | grep -E "fusedattn|error|warning: .*fusedattn" || true
  test -n "$(ls /tmp/fusedattn-pkg/fusedattn/_cuda*.so 2>/dev/null)" || { echo "CUDA extension not built"; tail -50 "$log_dir/build.log"; exit 1; }
fi
export PYTHONPATH=/tmp/fusedattn-pkg:${PYTHONPATH:-}
# A persistent plan cache of this run's own (tests fill it; nothing from earlier runs).
export FUSEDATTN_CACHE_DIR=${FUSEDATTN_CACHE_DIR:-$(mktemp -d /tmp/fusedattn-cache.XXXX)}
python3 -m fusedattn info | tee "$log_dir/info.txt"

if [[ $step == all || $step == test ]]; then
  python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider "$@" 2>&1 | tee "$log_dir/gpu-tests.log"
fi
if [[ $step == parallel ]]; then
  ngpu=$(nvidia-smi -L 2>/dev/null | wc -l); per=${PER_GPU:-4}; n=$(( ngpu * per )); rc=0
  (( n > 0 )) || { echo "ci/cuda.sh parallel: no NVIDIA GPU listed, nothing run"; exit 1; }
  rm -f "$log_dir"/gpu-shard-*.log   # (only this run's shards are summed below)
  for (( i = 0; i < n; i++ )); do
    CUDA_VISIBLE_DEVICES=$(( i % ngpu )) FUSEDATTN_GPU_SHARD=$i/$n \
      FUSEDATTN_CACHE_DIR=$(mktemp -d /tmp/fusedattn-cache.XXXX) \
      XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.9 / $per, 3))") \
      timeout -s INT "${SHARD_TIMEOUT:-3600}" python3 -m pytest -v -rfEs -m gpu tests/gpu \
      --ignore=tests/gpu/test_sharding_gpu.py -p no:cacheprovider "$@" \
      > "$log_dir/gpu-shard-$i.log" 2>&1 &
  done
  for (( i = 0; i < n; i++ )); do wait -n || rc=1; done
  grep -h -E "^(FAILED|ERROR)|^=+ .* in [0-9.]+s" "$log_dir"/gpu-shard-*.log || true
  exit $rc
fi
if [[ $step == sharding ]]; then
  rc=0
  python3 -m pytest -q -m gpu tests/gpu/test_sharding_gpu.py -p no:cacheprovider -rs "$@" 2>&1 \
    | tee "$log_dir/sharding-tests.log" || rc=1
  n=$(python3 -c "import jax; print(len(jax.devices()))")
  if (( n > 2 )) && [[ ${SHARDING_ON_TWO:-1} != 0 ]]; then
    CUDA_VISIBLE_DEVICES=0,1 python3 -m pytest -q -m gpu tests/gpu/test_sharding_gpu.py \
      -p no:cacheprovider -rs "$@" 2>&1 | tee "$log_dir/sharding-tests-x2.log" || rc=1
  fi
  python3 -m benchmarks.bench_sharding 2>&1 | tee "$log_dir/bench_sharding.log" || rc=1
  exit $rc
fi
if [[ $step == all || $step == bench ]]; then
  for b in benchmarks/bench_*.py; do
    [[ $b == *cpu* ]] && continue
    b=$(basename "$b" .py)
    python3 -m "benchmarks.$b" 2>&1 | tee "$log_dir/$b.log"
  done
  # Only this run's result files, in one archive (the logs sit beside it).
  find benchmarks/results -type f -newer "$log_dir/info.txt" -print0 \
    | tar -czf "$log_dir/results.tgz" --null -T -
fi
