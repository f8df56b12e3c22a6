#!/usr/bin/env bash
# Compile-check the CUDA extension (fusedattn._cuda) with this machine's nvcc; no GPU
# needed. Headers and the library to link come from the wheels jaxlib loads on a
# CUDA machine (nvidia-cudnn-cu13, nvidia-cudnn-frontend; nvrtc.h from
# nvidia-cuda-nvrtc when the toolkit lacks it) and the CUTLASS headers of the
# block-sparse backward kernel (nvidia-cutlass), installed under build/ when missing
# (about 0.5 GB, once). Skips (exit 0) when there is no nvcc.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nvcc >/dev/null || { echo "compile_cuda: no nvcc on PATH, skipped"; exit 0; }
py=$(command -v python3)
deps=$PWD/build/cuda-deps
have_deps() {
  "$py" - <<'PY' 2>/dev/null
import importlib.util as u, os
import nvidia.cudnn as c
assert os.path.exists(os.path.join(list(c.__path__)[0], "include", "cudnn.h"))
spec = u.find_spec("cudnn")
assert spec and os.path.exists(os.path.join(os.path.dirname(os.path.dirname(spec.origin)), "include", "cudnn_frontend.h"))
assert u.find_spec("cutlass_library")
PY
}
if ! have_deps; then
  export PYTHONPATH=$deps${PYTHONPATH:+:$PYTHONPATH}
  if ! have_deps; then
    "$py" -m pip install -q --no-deps --upgrade --target "$deps" \
      "nvidia-cudnn-cu13==9.19.*" "nvidia-cudnn-frontend==1.32.0" "nvidia-cuda-nvrtc" \
      "nvidia-cutlass==4.2.0.0"
  fi
fi
build=build/compile-cuda
mkdir -p build  # for the configure log, in a fresh clone that needed no deps
cmake -S . -B "$build" -G Ninja -DFUSEDATTN_GPU=cuda -DPython_EXECUTABLE="$py" \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90}" >"$build.configure.log" 2>&1 \
  || { cat "$build.configure.log"; exit 1; }
grep "fusedattn:" "$build.configure.log" || true
grep -q "block-sparse backward kernel built" "$build.configure.log" \
  || { echo "compile_cuda: the block-sparse backward kernel was not configured"; exit 1; }
cmake --build "$build" -j "$(nproc)"
ls -la "$build"/_cuda*.so
# No GPU needed either: cudnn-frontend's own validation of the graphs the handlers
# build (built-in score_mods included), for sm90 and sm100, through the module just
# built (tests/test_cudnn_frontend_validate.py).
FUSEDATTN_CUDA_EXTENSION=$(ls "$build"/_cuda*.so | head -n 1) PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} \
  "$py" -m pytest -q -rs -p no:cacheprovider tests/test_cudnn_frontend_validate.py
