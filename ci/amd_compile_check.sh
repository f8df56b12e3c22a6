#!/usr/bin/env bash
# Compile checks of the AMD code on a machine without an AMD GPU (CPU CI, by hand).
# Nothing here runs a kernel; it proves the sources compile for AMD targets:
#   1. hipcc (Debian's, HIP_PLATFORM=amd, --offload-arch=gfx90a): a full build of
#      the ROCm extension's small-seq part (csrc/common kernels + FFI glue +
#      module) into a shared library, which is then imported to list its FFI
#      targets; the gfx90a code object's kernels are counted.
#   2. clang-19 -x hip -fsyntax-only --offload-arch=gfx942 -nogpulib: the
#      small-seq sources, the CK wrappers (csrc/rocm/ck_*.cpp) against CK's
#      headers, and the dispatchers CK's generator writes for our instance set.
# Needs root + apt (Debian bookworm) the first time: installs hipcc and clang-19.
# CK comes from ci/fetch_ck.sh (FUSEDATTN_CK_DIR, or the CK tree inside the
# amd-aiter wheel); CK needs newer HIP headers than Debian's 5.2, taken from a
# ROCm install (ROCM_PATH) or the HIP headers shipped in the triton wheel.
# Downloads are cached in ${FUSEDATTN_AMD_CACHE:-~/.cache/fusedattn-amd}, so
# reruns are quick. Any compile error exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
cache=${FUSEDATTN_AMD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fusedattn-amd}
work=${FUSEDATTN_AMD_BUILD:-build/amd-compile-check}
TRITON_VERSION=${TRITON_VERSION:-3.9.0}
mkdir -p "$cache" "$work"
start=$SECONDS
step() { printf '\n== [%3ds] %s\n' $((SECONDS - start)) "$*"; }
jobs=$(nproc 2>/dev/null || echo 2)

step "toolchain"
need=()
command -v hipcc >/dev/null || need+=(hipcc)
command -v clang++-19 >/dev/null || need+=(clang-19)
if ((${#need[@]})); then
  echo "installing ${need[*]} from Debian"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
python3 -c "import pybind11" 2>/dev/null || python3 -m pip install -q pybind11
python3 -c "import jax.ffi" || { echo "jax is needed for XLA's FFI headers"; exit 1; }
export HIP_PLATFORM=amd
echo "hipcc:     $(hipcc --version 2>/dev/null | grep -m1 -i 'HIP version') ($(hipcc --version 2>/dev/null | grep -m1 -i 'clang version'))"
echo "clang-19:  $(clang++-19 --version | head -1)"
ffi_inc=$(python3 -c "import jax.ffi; print(jax.ffi.include_dir())")
echo "XLA FFI:   $ffi_inc (jax $(python3 -c 'import jax; print(jax.__version__)'))"
py_inc=$(python3 -m pybind11 --includes)
ext_suffix=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
common_flags=(-Icsrc/common -Icsrc/rocm -isystem "$ffi_inc" $py_inc)

step "1. hipcc full build of the small-seq part of fusedattn._rocm (gfx90a)"
small_seq_sources=(csrc/rocm/small_seq_ffi.cpp csrc/rocm/module.cc)
objs=()
for src in "${small_seq_sources[@]}"; do
  obj="$work/$(basename "$src").o"
  echo "hipcc -c $src"
  hipcc --offload-arch=gfx90a -std=c++17 -O2 -fPIC -Wall -Werror=return-type \
    -DFUSEDATTN_HIP_ARCHS='"gfx90a"' "${common_flags[@]}" -c "$src" -o "$obj"
  objs+=("$obj")
done
mkdir -p "$work/pkg/fusedattn"
so="$work/pkg/fusedattn/_rocm$ext_suffix"
hipcc --offload-arch=gfx90a -shared -fPIC "${objs[@]}" -o "$so"
echo "linked $so ($(du -h "$so" | cut -f1))"
# The kernels really were compiled for the GPU: count gfx90a kernel descriptors.
objcopy -O binary --only-section=.hip_fatbin "$work/small_seq_ffi.cpp.o" "$work/fatbin.bin"
bundler=$(ls /usr/lib/llvm-*/bin/clang-offload-bundler 2>/dev/null | head -1)
if [[ -n $bundler ]]; then
  "$bundler" --unbundle --type=o --input="$work/fatbin.bin" \
    --targets=hipv4-amdgcn-amd-amdhsa--gfx90a --output="$work/gfx90a.co"
  kernels=$("$(dirname "$bundler")/llvm-readelf" -s "$work/gfx90a.co" 2>/dev/null | grep -c '\.kd$' || true)
  echo "gfx90a code object: $kernels kernels"
  ((kernels > 0)) || { echo "no gfx90a kernels in the build"; exit 1; }
fi
# The library loads (libamdhip64 without a GPU is fine) and registers its targets.
PYTHONPATH="$work/pkg" python3 - "$so" <<'EOF'
import importlib.util, sys
spec = importlib.util.spec_from_file_location("fusedattn._rocm", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
targets = sorted(module.ffi_targets)
print("fusedattn._rocm loads; FFI targets:", ", ".join(targets),
      "; built for", module.hip_architectures)
missing = {"fusedattn_small_seq_fwd", "fusedattn_small_seq_bwd"} - set(targets)
sys.exit(f"missing targets: {missing}" if missing else
         None if module.hip_architectures == "gfx90a" else "hip_architectures not recorded")
EOF

step "2. CK source tree and HIP headers for clang-19"
ck_dir=$(bash ci/fetch_ck.sh)
echo "CK:        $ck_dir${FUSEDATTN_CK_DIR:+ (FUSEDATTN_CK_DIR)}"
rocm=${ROCM_PATH:-/opt/rocm}
if [[ -f $rocm/include/hip/hip_runtime.h ]]; then
  hip_inc="$rocm/include"; hip_from="ROCm install $rocm"
else
  hip_inc="$cache/triton-$TRITON_VERSION/include"
  if [[ ! -f $hip_inc/hip/hip_runtime.h ]]; then
    wheel_dir="$cache/wheels"; mkdir -p "$wheel_dir"
    python3 -m pip download -q --no-deps "triton==$TRITON_VERSION" -d "$wheel_dir"
    python3 ci/unpack_wheel.py "$wheel_dir"/triton-*.whl triton/backends/amd/include "$hip_inc"
    rm -rf "$wheel_dir"
  fi
  hip_from="HIP $(grep -oE 'HIP_VERSION_(MAJOR|MINOR) [0-9]+' "$hip_inc/hip/hip_version.h" | awk '{print $2}' | paste -sd.) headers of the triton $TRITON_VERSION wheel, Debian's for the rest"
fi
echo "HIP:       $hip_inc ($hip_from)"

step "3. generate CK's instance dispatchers for our configurations"
fmha="$ck_dir/example/ck_tile/01_fmha"
# The same generator settings as cmake/fusedattn_rocm.cmake (read from it, not repeated).
fwd_filter=$(sed -nE 's/^set\(FUSEDATTN_CK_FWD_FILTER "([^"]+)".*/\1/p' cmake/fusedattn_rocm.cmake)
bwd_receipt=$(sed -nE 's/^set\(FUSEDATTN_CK_BWD_RECEIPT "([^"]+)".*/\1/p' cmake/fusedattn_rocm.cmake)
rm -rf "$work/ck_gen"; mkdir -p "$work/ck_gen/fwd" "$work/ck_gen/bwd"
python3 "$fmha/generate.py" --targets gfx90a,gfx942 --api fwd --filter "$fwd_filter" --output_dir "$work/ck_gen/fwd" >/dev/null
python3 "$fmha/generate.py" --targets gfx90a,gfx942 --api bwd --receipt "$bwd_receipt" --output_dir "$work/ck_gen/bwd" >/dev/null
echo "forward:  $(ls "$work/ck_gen/fwd" | wc -l) sources (filter $fwd_filter)"
echo "backward: $(ls "$work/ck_gen/bwd" | wc -l) sources (receipt $bwd_receipt)"

step "4. clang-19 syntax checks (gfx942, -nogpulib), $jobs at a time"
# Each line: <source> <extra flags...>. Small-seq against Debian's HIP headers,
# CK parts against the newer ones CK needs.
ck_flags="-isystem $hip_inc -isystem $ck_dir/include -isystem $fmha -DCK_TILE_FMHA_FWD_SPLITKV_API=0 -DCK_TILE_FMHA_FWD_APPENDKV_API=0 -DCK_TILE_FMHA_FWD_PAGEDKV_API=0"
# One kernel instance of each direction, instantiated in full (masked, with dropout).
one_fwd=$(ls "$work"/ck_gen/fwd/fmha_fwd_d128_bf16_batch_*_qr_async_*_nbias_mask_lse_dropout_* | head -1)
one_bwd=$(ls "$work"/ck_gen/bwd/fmha_bwd_d128_bf16_group_*_bias_dbias_mask_dropout_* | head -1)
checks=(
  "csrc/rocm/small_seq_ffi.cpp"
  "csrc/rocm/module.cc"
  "csrc/rocm/ck_fmha_fwd.cpp $ck_flags -DCK_TILE_FMHA_FWD_FAST_EXP2=1"
  "csrc/rocm/ck_fmha_bwd.cpp $ck_flags -DCK_TILE_FLOAT_TO_BFLOAT16_DEFAULT=3"
  "$work/ck_gen/fwd/fmha_fwd_api.cpp $ck_flags -DCK_TILE_FMHA_FWD_FAST_EXP2=1"
  "$work/ck_gen/bwd/fmha_bwd_api.cpp $ck_flags -DCK_TILE_FLOAT_TO_BFLOAT16_DEFAULT=3"
  "$one_fwd $ck_flags -DCK_TILE_FMHA_FWD_FAST_EXP2=1"
  "$one_bwd $ck_flags -DCK_TILE_FLOAT_TO_BFLOAT16_DEFAULT=3"
)
mkdir -p "$work/logs"
syntax_check() {
  local src=$1; shift
  local log="$work/logs/$(basename "$src").log"
  local t0=$SECONDS
  if clang++-19 -x hip -std=c++20 -fsyntax-only --offload-arch=gfx942 -nogpulib \
      --rocm-path=/usr -D__HIP_PLATFORM_AMD__=1 "${common_flags[@]}" "$@" "$src" >"$log" 2>&1; then
    echo "ok    $(basename "$src") ($((SECONDS - t0))s)"
  else
    echo "FAIL  $src"; grep -m 20 -E "error" "$log"; return 1
  fi
}
export -f syntax_check
export work
printf '%s\n' "${checks[@]}" | common_flags="${common_flags[*]}" xargs -P "$jobs" -I{} \
  bash -c 'read -r -a args <<< "{}"; read -r -a common_flags <<< "$common_flags"; syntax_check "${args[@]}"'

step "done: every AMD compile check passed ($((SECONDS - start))s)"
