// Host side of the small-seq kernels: picks the template instance (dtype, head
// dim, KV-length bound 4 / 8 / 16) and the launch shape. Returns an empty
// string on success, else a message for the FFI error.
#pragma once

#include <string>

#include "small_seq_kernels.cuh"
#include "vendor.h"

namespace fusedattn::small_seq {

enum class Dtype { kBf16, kFp16 };

constexpr size_t kMaxSharedBytes = 48 * 1024;  // portable without opt-in on both vendors

inline int kv_bound_for(int max_kv) { return max_kv <= 4 ? 4 : (max_kv <= 8 ? 8 : 16); }

inline int lanes_for(int d) { return d / 8 < 32 ? d / 8 : 32; }

// Backward teams per block: as many as kThreads allows and shared memory holds,
// in steps that keep the block a whole number of 64-lane wavefronts. 0 = too big.
inline int bwd_teams_per_block(int d, int group, int kvb) {
  const int lanes = lanes_for(d);
  const int step = 64 / lanes;
  int teams = kThreads / lanes;
  while (teams >= step && teams * bwd_team_shared_bytes(group, kvb) > kMaxSharedBytes) teams -= step;
  return teams >= step ? teams : 0;
}

inline std::string launch_error() {
  const vendor::error_t err = vendor::last_error();
  return err == vendor::kSuccess ? std::string() : std::string("kernel launch failed: ") + vendor::error_string(err);
}

template <class T, int D, int KVB>
std::string launch_one(vendor::stream_t stream, const Params& p, bool backward) {
  constexpr int lanes = Tiling<D>::kLanes;
  if (!backward) {
    const int64_t teams = p.n * p.h_q;
    const int64_t per_block = kThreads / lanes;
    const int64_t blocks = (teams + per_block - 1) / per_block;
    FUSEDATTN_LAUNCH((small_seq_fwd_kernel<T, D, KVB>), dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0,
                     stream, p);
  } else {
    const int group = p.h_q / p.h_kv;
    const int64_t teams = (p.n + (p.packed ? 1 : 0)) * p.h_kv;
    if constexpr (KVB * Tiling<D>::kVecs <= 4) {
      if (group == 1) {  // MHA with few keys: each team pipelines kItems rows
        constexpr int kItems = 4;
        constexpr int64_t rows_per_block = kThreads / lanes * kItems;
        const int64_t blocks = (teams + rows_per_block - 1) / rows_per_block;
        FUSEDATTN_LAUNCH((small_seq_bwd_mha_kernel<T, D, KVB, kItems>), dim3(static_cast<unsigned>(blocks)),
                         dim3(kThreads), 0, stream, p);
        return launch_error();
      }
    }
    const int per_block = bwd_teams_per_block(D, group, KVB);
    if (per_block == 0) return "query heads per kv head (" + std::to_string(group) + ") too many for shared memory";
    const int64_t blocks = (teams + per_block - 1) / per_block;
    const size_t shared = per_block * bwd_team_shared_bytes(group, KVB);
    FUSEDATTN_LAUNCH((small_seq_bwd_kernel<T, D, KVB>), dim3(static_cast<unsigned>(blocks)),
                     dim3(per_block * lanes), shared, stream, p, per_block);
  }
  return launch_error();
}

template <class T, int D>
std::string launch_kv(vendor::stream_t stream, const Params& p, int max_kv, bool backward) {
  switch (kv_bound_for(max_kv)) {
    case 4: return launch_one<T, D, 4>(stream, p, backward);
    case 8: return launch_one<T, D, 8>(stream, p, backward);
    default: return launch_one<T, D, 16>(stream, p, backward);
  }
}

template <class T>
std::string launch_d(vendor::stream_t stream, const Params& p, int d, int max_kv, bool backward) {
  switch (d) {
    case 64: return launch_kv<T, 64>(stream, p, max_kv, backward);
    case 128: return launch_kv<T, 128>(stream, p, max_kv, backward);
    case 256: return launch_kv<T, 256>(stream, p, max_kv, backward);
    case 512: return launch_kv<T, 512>(stream, p, max_kv, backward);
    default: return "head dim " + std::to_string(d) + " not in {64, 128, 256, 512}";
  }
}

// `max_kv`: the static bound on keys per sequence (s_kv padded, <= 16 packed).
inline std::string launch(vendor::stream_t stream, Dtype dtype, int d, int max_kv, const Params& p, bool backward) {
  if (max_kv < 1 || max_kv > kMaxKv) return "kv bound " + std::to_string(max_kv) + " not in [1, 16]";
  if (p.n == 0) return std::string();
  return dtype == Dtype::kBf16 ? launch_d<Bf16>(stream, p, d, max_kv, backward)
                               : launch_d<Fp16>(stream, p, d, max_kv, backward);
}

}  // namespace fusedattn::small_seq
