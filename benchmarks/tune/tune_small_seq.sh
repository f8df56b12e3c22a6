#!/usr/bin/env bash
# Times the small-seq kernels under several settings of their compile-time
# knobs (blocks per SM the register budget must allow; key vectors per lane the
# forward keeps in registers), one standalone binary per setting, and prints
# the tables side by side in one log. Needs nvcc and a CUDA GPU; no JAX.
#   benchmarks/tune/tune_small_seq.sh [OUT_DIR] [SETTING...]
# A SETTING is FWD_MIN_BLOCKS:FWD_ROW_VECS:BWD_MIN_BLOCKS[:BWD_ROW_VECS], e.g. 2:0:2:0
# (the defaults; a ROW_VECS of 0 picks per head dim, see csrc/common/small_seq_kernels.cuh).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-build/tune}; shift || true
settings=("$@")
(( ${#settings[@]} )) || settings=(2:0:2 2:16:2 2:0:1 2:0:3)
mkdir -p "$out"
for s in "${settings[@]}"; do
  IFS=: read -r fb rv bb bv <<<"$s"
  nvcc -O3 -std=c++17 -arch=${CUDA_ARCH:-sm_90} -Icsrc/common -Xptxas -warn-spills \
    -DFUSEDATTN_SMALL_SEQ_FWD_MIN_BLOCKS="$fb" -DFUSEDATTN_SMALL_SEQ_FWD_ROW_VECS="$rv" \
    -DFUSEDATTN_SMALL_SEQ_BWD_MIN_BLOCKS="$bb" -DFUSEDATTN_SMALL_SEQ_BWD_ROW_VECS="${bv:-0}" \
    -o "$out/tune_$fb-$rv-$bb-${bv:-0}" benchmarks/tune/small_seq_timing.cu &
done
wait
for s in "${settings[@]}"; do
  IFS=: read -r fb rv bb bv <<<"$s"
  "$out/tune_$fb-$rv-$bb-${bv:-0}" "$fb-$rv-$bb-${bv:-0}"
done | tee "$out/tune_small_seq.log"
