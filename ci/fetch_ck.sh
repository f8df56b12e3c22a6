#!/usr/bin/env bash
# Prints the path of a Composable Kernel source tree holding the FMHA API
# (include/ + example/ck_tile/01_fmha), fetching it when needed:
# FUSEDATTN_CK_DIR if set, else the CK tree shipped in the amd-aiter wheel
# (pinned by AITER_VERSION), unpacked once into
# ${FUSEDATTN_AMD_CACHE:-~/.cache/fusedattn-amd}. Progress goes to stderr.
set -euo pipefail
if [[ -n ${FUSEDATTN_CK_DIR:-} ]]; then
  echo "$FUSEDATTN_CK_DIR"; exit 0
fi
AITER_VERSION=${AITER_VERSION:-0.1.7.post2.dev18}
cache=${FUSEDATTN_AMD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fusedattn-amd}
ck_dir="$cache/aiter-$AITER_VERSION/composable_kernel"
if [[ ! -f $ck_dir/example/ck_tile/01_fmha/generate.py ]]; then
  echo "fetching CK from the amd-aiter $AITER_VERSION wheel" >&2
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download -q --no-deps "amd-aiter==$AITER_VERSION" -d "$tmp" >&2
  python3 "$(dirname "$0")/unpack_wheel.py" "$tmp"/amd_aiter-*.whl \
    aiter_meta/3rdparty/composable_kernel "$ck_dir" include/ example/ck_tile/01_fmha/ LICENSE
fi
echo "$ck_dir"
