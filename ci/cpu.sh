#!/usr/bin/env bash
# The CPU job: install as pure Python, run the README's test command, then
# compile-check the native code that cannot run here (AMD always; CUDA when its
# check script exists). Works the same on a CI runner and by hand; the AMD
# check wants root + apt (Debian bookworm) the first time, see
# ci/amd_compile_check.sh.   ci/cpu.sh [extra pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

FUSEDATTN_GPU=none python3 -m pip install -q ".[test]"
python3 -m pytest -q -n auto --dist loadfile "$@"

bash ci/amd_compile_check.sh
if [[ -f ci/compile_cuda.sh ]]; then
  bash ci/compile_cuda.sh
fi
