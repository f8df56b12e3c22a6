// Small-sequence attention kernels: one query token per sequence attending to
// at most 16 keys. Memory bound, so every byte of q, k, v, o (and gradients) is
// read or written once with 16-byte accesses; all arithmetic is fp32 in
// registers. Portable: vendor differences live in vendor.h.
//
// Tensors (row-major, 16-bit elements):
//   q, o, dq, do : [n, 1, h_q, d]      lse : [n, h_q, 1] fp32 (natural log)
//   k, v, dk, dv : padded [n, s_kv, h_kv, d]  or packed [rows, h_kv, d]
//   kv_index     : padded: kv lengths [n] (clamped to [0, s_kv])
//                  packed: kv offsets [n + 1]; sequence b owns rows
//                  [offsets[b], offsets[b+1]).
// A "team" of kLanes lanes owns one d-long row; lane l holds elements
// [(v * kLanes + l) * 8, +8) for v < kVecs, so each load instruction of a team
// covers a contiguous run of the row.
#pragma once

#include <cmath>
#include <cstdint>

#include "vendor.h"

namespace fusedattn::small_seq {

// Blocks per SM the register allocation must allow (a tuning knob, measured in
// benchmarks/bench_small_seq.py; overridable at build time).
#ifndef FUSEDATTN_SMALL_SEQ_FWD_MIN_BLOCKS
#define FUSEDATTN_SMALL_SEQ_FWD_MIN_BLOCKS 2
#endif
#ifndef FUSEDATTN_SMALL_SEQ_BWD_MIN_BLOCKS
#define FUSEDATTN_SMALL_SEQ_BWD_MIN_BLOCKS 2
#endif
// Forward: at most this many 16-byte key (then value) vectors per lane in
// registers at once; more keys are loaded in chunks. 0: the measured default
// (benchmarks/tune/tune_small_seq.sh): 16 with one vector per lane (d <= 256), 8
// with two (d 512, where 16 spill; docs/decisions.md).
#ifndef FUSEDATTN_SMALL_SEQ_FWD_ROW_VECS
#define FUSEDATTN_SMALL_SEQ_FWD_ROW_VECS 0
#endif
// Backward (general kernel): 16-byte key vectors per lane in one step's set of k
// (and as many of v) rows; the next step's set is in flight meanwhile. 0: the
// measured default (benchmarks/tune/tune_small_seq.sh): 4, i.e. four keys a step,
// with one vector per lane (d <= 256); 2, one key a step, at d 512, where 4 spill
// (docs/decisions.md).
#ifndef FUSEDATTN_SMALL_SEQ_BWD_ROW_VECS
#define FUSEDATTN_SMALL_SEQ_BWD_ROW_VECS 0
#endif

constexpr int kMaxKv = 16;
constexpr int kThreads = 256;  // per block; a multiple of both warp widths
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct Bf16 {
  static __device__ __forceinline__ float load(uint16_t b) { return vendor::bf16_bits_to_float(b); }
  static __device__ __forceinline__ uint16_t store(float f) { return vendor::float_to_bf16_bits(f); }
};
struct Fp16 {
  static __device__ __forceinline__ float load(uint16_t b) { return vendor::fp16_bits_to_float(b); }
  static __device__ __forceinline__ uint16_t store(float f) { return vendor::float_to_fp16_bits(f); }
};

template <int D>
struct Tiling {
  static_assert(D % 64 == 0 && D <= 512, "head dim must be 64, 128, 256 or 512");
  static constexpr int kLanes = D / 8 < 32 ? D / 8 : 32;  // divides 32 and 64
  static constexpr int kVecs = D / 8 / kLanes;             // 16-byte vectors per lane
  static constexpr int kElems = kVecs * 8;
};

// One lane's slice of a row, as raw 16-byte vectors.
template <int V>
struct Slice {
  uint4 vec[V];
};

template <int D>
__device__ __forceinline__ Slice<Tiling<D>::kVecs> load_slice(const uint16_t* row, int lane) {
  Slice<Tiling<D>::kVecs> s;
#pragma unroll
  for (int v = 0; v < Tiling<D>::kVecs; ++v)
    s.vec[v] = *reinterpret_cast<const uint4*>(row + (v * Tiling<D>::kLanes + lane) * 8);
  return s;
}

template <class T, int V>
__device__ __forceinline__ void unpack(const Slice<V>& s, float (&out)[V * 8]) {
#pragma unroll
  for (int v = 0; v < V; ++v) {
    const uint32_t w[4] = {s.vec[v].x, s.vec[v].y, s.vec[v].z, s.vec[v].w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      out[v * 8 + 2 * e] = T::load(static_cast<uint16_t>(w[e] & 0xffffu));
      out[v * 8 + 2 * e + 1] = T::load(static_cast<uint16_t>(w[e] >> 16));
    }
  }
}

template <class T, int D>
__device__ __forceinline__ void store_slice(uint16_t* row, int lane, const float (&x)[Tiling<D>::kElems]) {
#pragma unroll
  for (int v = 0; v < Tiling<D>::kVecs; ++v) {
    uint32_t w[4];
#pragma unroll
    for (int e = 0; e < 4; ++e)
      w[e] = static_cast<uint32_t>(T::store(x[v * 8 + 2 * e])) |
             (static_cast<uint32_t>(T::store(x[v * 8 + 2 * e + 1])) << 16);
    *reinterpret_cast<uint4*>(row + (v * Tiling<D>::kLanes + lane) * 8) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

template <class T, int V>
__device__ __forceinline__ float dot(const float (&a)[V * 8], const Slice<V>& b) {
  float bf[V * 8];
  unpack<T>(b, bf);
  float acc = 0.f;
#pragma unroll
  for (int e = 0; e < V * 8; ++e) acc = fmaf(a[e], bf[e], acc);
  return acc;
}

template <class T, int V>
__device__ __forceinline__ void axpy(float a, const Slice<V>& x, float (&y)[V * 8]) {
  float xf[V * 8];
  unpack<T>(x, xf);
#pragma unroll
  for (int e = 0; e < V * 8; ++e) y[e] = fmaf(a, xf[e], y[e]);
}

// Sum over the team's lanes; every lane of the warp must call it.
template <int Lanes>
__device__ __forceinline__ float team_sum(float x) {
#pragma unroll
  for (int m = Lanes / 2; m > 0; m >>= 1) x += vendor::shfl_xor(x, m, Lanes);
  return x;
}

struct Params {
  const uint16_t* __restrict__ q;
  const uint16_t* __restrict__ k;
  const uint16_t* __restrict__ v;
  const uint16_t* __restrict__ o;    // backward only
  const uint16_t* __restrict__ d_o;  // backward only
  const float* __restrict__ lse_in;  // backward only
  const int32_t* __restrict__ kv_index;
  uint16_t* __restrict__ out;  // forward: o; backward: dq
  float* __restrict__ lse_out;  // forward only
  uint16_t* __restrict__ dk;   // backward only
  uint16_t* __restrict__ dv;   // backward only
  int64_t n;
  int h_q, h_kv;
  int s_kv;         // padded: keys per row of k/v; packed: unused
  int64_t kv_rows;  // packed: rows of k/v; padded: n * s_kv
  bool packed;
  float scale;
};

// Where sequence b's keys are. Lengths are read on the device, so padding is
// never touched and no host sync is needed. A packed range that is out of
// bounds or longer than the bound is flagged, and its outputs become NaN.
struct Keys {
  int64_t first;  // row of key 0
  int len;        // keys to use
  bool valid;
};

template <int KVB>
__device__ __forceinline__ Keys locate_keys(const Params& p, int64_t b) {
  if (!p.packed) {
    int len = p.kv_index[b];
    len = len < 0 ? 0 : (len > p.s_kv ? p.s_kv : len);
    return {b * p.s_kv, len, true};
  }
  const int64_t start = p.kv_index[b], end = p.kv_index[b + 1];
  const bool ok = start >= 0 && start <= end && end <= p.kv_rows && end - start <= KVB;
  return {ok ? start : 0, ok ? static_cast<int>(end - start) : 0, ok};
}

// Row `row`, head g of a [rows, h_kv, d] view of k, v, dk or dv.
template <class Ptr>
__device__ __forceinline__ Ptr kv_row(Ptr base, const Params& p, int64_t row, int g, int d) {
  return base + (row * p.h_kv + g) * static_cast<int64_t>(d);
}

// Key row j of this team, or a stand-in row past the length. Loads are then
// unconditional (no branches), so all KVB of them issue back to back; the
// stand-in is the team's own q row (already cached), so padding is never read.
template <int D, class Ptr>
__device__ __forceinline__ const uint16_t* key_or_stand_in(Ptr base, const Params& p, const Keys& keys, int j, int g,
                                                           const uint16_t* stand_in) {
  return j < keys.len ? kv_row(base, p, keys.first + j, g, D) : stand_in;
}

// Forward: one team per (token, query head). Teams of one kv-head group are
// adjacent, so a group's repeated k/v reads hit the cache.
template <class T, int D, int KVB>
__global__ void __launch_bounds__(kThreads, FUSEDATTN_SMALL_SEQ_FWD_MIN_BLOCKS) small_seq_fwd_kernel(Params p) {
  using Tile = Tiling<D>;
  constexpr int L = Tile::kLanes, V = Tile::kVecs, E = Tile::kElems;
  // k (then v) rows all in registers at once while they fit; else in chunks.
  constexpr int kRowVecs = FUSEDATTN_SMALL_SEQ_FWD_ROW_VECS > 0 ? FUSEDATTN_SMALL_SEQ_FWD_ROW_VECS : (V == 1 ? 16 : 8);
  constexpr int kChunk = KVB * V <= kRowVecs ? KVB : kRowVecs / V;
  static_assert(kChunk >= 1 && KVB % kChunk == 0, "FUSEDATTN_SMALL_SEQ_FWD_ROW_VECS: a power of two >= vectors per lane");
  const int lane = threadIdx.x % L;
  const int64_t team = static_cast<int64_t>(blockIdx.x) * (kThreads / L) + threadIdx.x / L;
  const bool active = team < p.n * p.h_q;
  const int64_t row = active ? team : 0;  // (token, head) row of q, o, lse
  const int64_t b = row / p.h_q;
  const int g = static_cast<int>(row % p.h_q) / (p.h_q / p.h_kv);
  const Keys keys = active ? locate_keys<KVB>(p, b) : Keys{0, 0, true};
  const uint16_t* q_row = p.q + row * D;

  float qf[E];
  unpack<T>(load_slice<D>(q_row, lane), qf);
  float s[KVB];
#pragma unroll
  for (int j0 = 0; j0 < KVB; j0 += kChunk) {
    Slice<V> ks[kChunk];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) ks[j] = load_slice<D>(key_or_stand_in<D>(p.k, p, keys, j0 + j, g, q_row), lane);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) s[j0 + j] = dot<T, V>(qf, ks[j]);
  }
#pragma unroll
  for (int j = 0; j < KVB; ++j) s[j] = team_sum<L>(s[j]);

  // Softmax in base 2 on logits pre-scaled by scale * log2(e).
  const float c = p.scale * kLog2e;
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < KVB; ++j)
    if (j < keys.len) m = fmaxf(m, s[j] * c);
  float l = 0.f;
#pragma unroll
  for (int j = 0; j < KVB; ++j) {
    s[j] = j < keys.len ? exp2f(s[j] * c - m) : 0.f;
    l += s[j];
  }
  const float inv_l = keys.len > 0 ? 1.f / l : 0.f;
  float acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = 0.f;
#pragma unroll
  for (int j0 = 0; j0 < KVB; j0 += kChunk) {
    Slice<V> vs[kChunk];
#pragma unroll
    for (int j = 0; j < kChunk; ++j)
      vs[j] = load_slice<D>(key_or_stand_in<D>(p.v, p, keys, j0 + j, g, q_row), lane);
#pragma unroll
    for (int j = 0; j < kChunk; ++j)
      if (j0 + j < keys.len) axpy<T, V>(s[j0 + j] * inv_l, vs[j], acc);
  }
  if (!active) return;
  if (!keys.valid) {
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] = NAN;
  }
  store_slice<T, D>(p.out + row * D, lane, acc);
  if (lane == 0)
    p.lse_out[row] = !keys.valid ? NAN : (keys.len > 0 ? (m + log2f(l)) * kLn2 : -INFINITY);
}

// Bytes of shared memory per backward team: p and ds for every (query head of
// the group, key).
inline size_t bwd_team_shared_bytes(int group, int kvb) { return static_cast<size_t>(group) * kvb * 2 * sizeof(float); }

template <class T, int D>
__device__ void fill_rows(uint16_t* base, const Params& p, int64_t first, int64_t last, int g, int lane, float value) {
  using Tile = Tiling<D>;
  float x[Tile::kElems];
#pragma unroll
  for (int e = 0; e < Tile::kElems; ++e) x[e] = value;
  for (int64_t r = first; r < last; ++r) store_slice<T, D>(kv_row(base, p, r, g, D), lane, x);
}

// Packed mode: zero dK and dV rows (head g) that no sequence owns, before the
// first sequence and after the last one.
template <class T, int D>
__device__ void zero_unowned_rows(const Params& p, int g, int lane) {
  const int64_t first = p.kv_index[0], last = p.kv_index[p.n];
  const int64_t lo = first < 0 ? 0 : (first > p.kv_rows ? p.kv_rows : first);
  const int64_t hi = last < lo ? lo : (last > p.kv_rows ? p.kv_rows : last);
  fill_rows<T, D>(p.dk, p, 0, lo, g, lane, 0.f);
  fill_rows<T, D>(p.dv, p, 0, lo, g, lane, 0.f);
  fill_rows<T, D>(p.dk, p, hi, p.kv_rows, g, lane, 0.f);
  fill_rows<T, D>(p.dv, p, hi, p.kv_rows, g, lane, 0.f);
}

// Packed mode, malformed range of sequence b: NaN in its dK and dV rows (head
// g), clamped to the rows that exist.
template <class T, int D>
__device__ void nan_malformed_rows(const Params& p, int64_t b, int g, int lane) {
  const int64_t start = p.kv_index[b], end = p.kv_index[b + 1];
  const int64_t lo = start < 0 ? 0 : (start > p.kv_rows ? p.kv_rows : start);
  const int64_t hi = end < lo ? lo : (end > p.kv_rows ? p.kv_rows : end);
  fill_rows<T, D>(p.dk, p, lo, hi, g, lane, NAN);
  fill_rows<T, D>(p.dv, p, lo, hi, g, lane, NAN);
}

// Backward: one team per (token, kv head) loops over the group's query heads,
// so dK and dV are summed on chip and written once (no atomics).
// Phase 1, per query head i, streaming over keys a few at a time with the next
// few in flight (the saved LSE gives P without a first pass over all keys): P = exp(s - lse),
// dS = P (dO.V - rowsum(dO * O)), dQ += scale * dS k. With one query head per
// kv head (MHA), dK_j = scale * dS_j q and dV_j = P_j dO are written right
// there. Otherwise P and dS go to shared memory and phase 2, per key j, sums
// dK_j = scale * sum_i dS_ij q_i and dV_j = sum_i P_ij dO_i.
// In packed mode, teams with b == n zero the rows no sequence owns.
template <class T, int D, int KVB>
__global__ void __launch_bounds__(kThreads, FUSEDATTN_SMALL_SEQ_BWD_MIN_BLOCKS) small_seq_bwd_kernel(Params p, int teams_per_block) {
  using Tile = Tiling<D>;
  constexpr int L = Tile::kLanes, V = Tile::kVecs, E = Tile::kElems;
  // Keys per step (two steps' k and v rows in registers at once).
  constexpr int kStepVecs = FUSEDATTN_SMALL_SEQ_BWD_ROW_VECS > 0 ? FUSEDATTN_SMALL_SEQ_BWD_ROW_VECS : (V == 1 ? 4 : 2);
  constexpr int kChunk = kStepVecs / V < KVB ? kStepVecs / V : KVB;
  static_assert(kChunk >= 1 && KVB % kChunk == 0, "FUSEDATTN_SMALL_SEQ_BWD_ROW_VECS: a power of two >= vectors per lane");
  extern __shared__ float shared[];
  const int group = p.h_q / p.h_kv;
  const bool fused_dkv = group == 1;  // the same for every team of the grid
  const int lane = threadIdx.x % L;
  const int team_in_block = threadIdx.x / L;
  const int64_t team = static_cast<int64_t>(blockIdx.x) * teams_per_block + team_in_block;
  const int64_t n_teams = (p.n + (p.packed ? 1 : 0)) * p.h_kv;
  const bool in_range = team < n_teams;
  const int g = in_range ? static_cast<int>(team % p.h_kv) : 0;
  const bool tail = in_range && p.packed && team / p.h_kv == p.n;  // the unowned-rows team
  const bool active = in_range && !tail;
  const int64_t b = active ? team / p.h_kv : 0;  // idle teams read token 0, write nothing
  const Keys keys = active ? locate_keys<KVB>(p, b) : Keys{0, 0, true};
  // Padded rows own s_kv key slots (zero past the length); packed rows own len.
  const int slots = p.packed ? keys.len : p.s_kv;
  float* p_sh = shared + static_cast<size_t>(team_in_block) * group * KVB * 2;
  float* ds_sh = p_sh + group * KVB;
  const float c = p.scale * kLog2e;

  for (int i = 0; i < group; ++i) {  // trip count is the same for every team
    const int64_t row = b * p.h_q + g * group + i;
    const uint16_t* q_row = p.q + row * D;
    float qf[E], dof[E], dq[E];
    unpack<T>(load_slice<D>(q_row, lane), qf);
    unpack<T>(load_slice<D>(p.d_o + row * D, lane), dof);
    const Slice<V> o_slice = load_slice<D>(p.o + row * D, lane);
    Slice<V> ks[kChunk], vs[kChunk];
    // Loads chunk j0 (past the end: stand-ins, cache hits) into k_dst, v_dst.
    auto load_chunk = [&](int j0, Slice<V>(&k_dst)[kChunk], Slice<V>(&v_dst)[kChunk]) {
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        k_dst[j] = load_slice<D>(key_or_stand_in<D>(p.k, p, keys, j0 + j, g, q_row), lane);
        v_dst[j] = load_slice<D>(key_or_stand_in<D>(p.v, p, keys, j0 + j, g, q_row), lane);
      }
    };
    load_chunk(0, ks, vs);  // in flight with q, dO, O
    const float di = team_sum<L>(dot<T, V>(dof, o_slice));
    const float lse2 = p.lse_in[row] * kLog2e;
#pragma unroll
    for (int e = 0; e < E; ++e) dq[e] = 0.f;
#pragma unroll 1
    for (int j0 = 0; j0 < KVB; j0 += kChunk) {
      Slice<V> next_k[kChunk], next_v[kChunk];  // the next chunk, in flight meanwhile
      load_chunk(j0 + kChunk, next_k, next_v);
      float pj[kChunk], dsj[kChunk];
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        const float sj = team_sum<L>(dot<T, V>(qf, ks[j]));
        const float dpj = team_sum<L>(dot<T, V>(dof, vs[j]));
        const bool valid = j0 + j < keys.len;
        pj[j] = valid ? exp2f(sj * c - lse2) : 0.f;
        dsj[j] = valid ? pj[j] * (dpj - di) : 0.f;
        if (valid) axpy<T, V>(dsj[j] * p.scale, ks[j], dq);
        if (!fused_dkv && lane == 0) {
          p_sh[i * KVB + j0 + j] = pj[j];
          ds_sh[i * KVB + j0 + j] = dsj[j];
        }
      }
      if (fused_dkv && active) {
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
          if (j0 + j >= slots) continue;
          const bool valid = j0 + j < keys.len;  // padding slots get exact zeros
          float dk[E], dv[E];
#pragma unroll
          for (int e = 0; e < E; ++e) {
            dk[e] = valid ? dsj[j] * p.scale * qf[e] : 0.f;
            dv[e] = valid ? pj[j] * dof[e] : 0.f;
          }
          store_slice<T, D>(kv_row(p.dk, p, keys.first + j0 + j, g, D), lane, dk);
          store_slice<T, D>(kv_row(p.dv, p, keys.first + j0 + j, g, D), lane, dv);
        }
      }
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        ks[j] = next_k[j];
        vs[j] = next_v[j];
      }
    }
    if (active) store_slice<T, D>(p.out + row * D, lane, dq);
  }
  if (!fused_dkv) vendor::block_sync();
  if (!in_range) return;
  if (tail) {
    zero_unowned_rows<T, D>(p, g, lane);
    return;
  }
  for (int j = 0; !fused_dkv && j < slots; ++j) {
    float dk[E], dv[E];
#pragma unroll
    for (int e = 0; e < E; ++e) dk[e] = dv[e] = 0.f;
    if (j < keys.len) {
      for (int i = 0; i < group; ++i) {
        const int64_t row = b * p.h_q + g * group + i;
        axpy<T, V>(ds_sh[i * KVB + j] * p.scale, load_slice<D>(p.q + row * D, lane), dk);
        axpy<T, V>(p_sh[i * KVB + j], load_slice<D>(p.d_o + row * D, lane), dv);
      }
    }
    store_slice<T, D>(kv_row(p.dk, p, keys.first + j, g, D), lane, dk);
    store_slice<T, D>(kv_row(p.dv, p, keys.first + j, g, D), lane, dv);
  }
  if (!keys.valid) {  // a malformed packed range: say so with NaN, in bounds only
    nan_malformed_rows<T, D>(p, b, g, lane);
    float nan_row[E];
#pragma unroll
    for (int e = 0; e < E; ++e) nan_row[e] = NAN;
    for (int i = 0; i < group; ++i)
      store_slice<T, D>(p.out + (b * p.h_q + g * group + i) * static_cast<int64_t>(D), lane, nan_row);
  }
}

// Backward with one query head per kv head (MHA), at most 4 keys and one
// 16-byte vector per lane (d <= 256). There a team's whole key set is one
// burst of loads followed by compute with nothing in flight, which leaves the
// memory system idle too often (docs/decisions.md). So each team walks Items
// (token, head) rows kPerBlock apart (a block still covers contiguous rows at
// every step) and loads the next row's k and v while it computes this one, as
// the chunk loop of the general kernel does.
// The math, stores and error handling are those of small_seq_bwd_kernel with
// group == 1.
template <class T, int D, int KVB, int Items>
__global__ void __launch_bounds__(kThreads, FUSEDATTN_SMALL_SEQ_BWD_MIN_BLOCKS) small_seq_bwd_mha_kernel(Params p) {
  using Tile = Tiling<D>;
  constexpr int L = Tile::kLanes, V = Tile::kVecs, E = Tile::kElems;
  constexpr int kPerBlock = kThreads / L;
  static_assert(KVB * V <= 4, "two sets of k and v rows must fit in registers");
  const int lane = threadIdx.x % L;
  const int64_t n_teams = (p.n + (p.packed ? 1 : 0)) * p.h_kv;
  const float c = p.scale * kLog2e;
  // Team t (one (token, head) row, since h_q == h_kv) computes when in range
  // and not the packed unowned-rows team; others read row 0 and write nothing.
  auto is_active = [&](int64_t t) { return t < n_teams && !(p.packed && t / p.h_kv == p.n); };
  auto keys_of = [&](int64_t t, bool needed) {
    return needed && is_active(t) ? locate_keys<KVB>(p, t / p.h_kv) : Keys{0, 0, true};
  };
  // Stand-ins past the length are q row 0: one row, cached, for every team.
  auto load_keys = [&](int64_t t, const Keys& keys, Slice<V>(&k)[KVB], Slice<V>(&v)[KVB]) {
    const int g = static_cast<int>(t % p.h_kv);
#pragma unroll
    for (int j = 0; j < KVB; ++j) {
      k[j] = load_slice<D>(key_or_stand_in<D>(p.k, p, keys, j, g, p.q), lane);
      v[j] = load_slice<D>(key_or_stand_in<D>(p.v, p, keys, j, g, p.q), lane);
    }
  };

  int64_t team = static_cast<int64_t>(blockIdx.x) * kPerBlock * Items + threadIdx.x / L;
  Keys keys = keys_of(team, true);
  Slice<V> ks[KVB], vs[KVB];
  load_keys(team, keys, ks, vs);
  Keys next_keys = keys_of(team + kPerBlock, Items > 1);
#pragma unroll 1
  for (int it = 0; it < Items; ++it, team += kPerBlock) {
    const bool in_range = team < n_teams;
    const bool tail = in_range && !is_active(team);
    const bool active = is_active(team);
    const int64_t row = active ? team : 0;
    const int g = static_cast<int>(row % p.h_kv);
    float qf[E], dof[E], dq[E];
    unpack<T>(load_slice<D>(p.q + row * D, lane), qf);
    unpack<T>(load_slice<D>(p.d_o + row * D, lane), dof);
    const Slice<V> o_slice = load_slice<D>(p.o + row * D, lane);
    const float lse2 = p.lse_in[row] * kLog2e;
    // The next row's keys (past the last item: stand-ins, cache hits) and
    // where the one after starts: in flight while this row computes.
    Slice<V> next_k[KVB], next_v[KVB];
    load_keys(team + kPerBlock, next_keys, next_k, next_v);
    const Keys after_keys = keys_of(team + 2 * kPerBlock, it + 2 < Items);

    const float di = team_sum<L>(dot<T, V>(dof, o_slice));
#pragma unroll
    for (int e = 0; e < E; ++e) dq[e] = 0.f;
    float pj[KVB], dsj[KVB];
#pragma unroll
    for (int j = 0; j < KVB; ++j) {
      const float sj = team_sum<L>(dot<T, V>(qf, ks[j]));
      const float dpj = team_sum<L>(dot<T, V>(dof, vs[j]));
      const bool valid = j < keys.len;
      pj[j] = valid ? exp2f(sj * c - lse2) : 0.f;
      dsj[j] = valid ? pj[j] * (dpj - di) : 0.f;
      if (valid) axpy<T, V>(dsj[j] * p.scale, ks[j], dq);
    }
    if (active) {
      const int slots = p.packed ? keys.len : p.s_kv;  // padded slots get exact zeros
#pragma unroll
      for (int j = 0; j < KVB; ++j) {
        if (j >= slots) continue;
        const bool valid = j < keys.len;
        float dk[E], dv[E];
#pragma unroll
        for (int e = 0; e < E; ++e) {
          dk[e] = valid ? dsj[j] * p.scale * qf[e] : 0.f;
          dv[e] = valid ? pj[j] * dof[e] : 0.f;
        }
        store_slice<T, D>(kv_row(p.dk, p, keys.first + j, g, D), lane, dk);
        store_slice<T, D>(kv_row(p.dv, p, keys.first + j, g, D), lane, dv);
      }
      if (!keys.valid) {
#pragma unroll
        for (int e = 0; e < E; ++e) dq[e] = NAN;
      }
      store_slice<T, D>(p.out + row * D, lane, dq);
      if (!keys.valid) nan_malformed_rows<T, D>(p, row / p.h_kv, g, lane);  // in bounds only
    }
    if (tail) zero_unowned_rows<T, D>(p, static_cast<int>(team % p.h_kv), lane);
#pragma unroll
    for (int j = 0; j < KVB; ++j) {
      ks[j] = next_k[j];
      vs[j] = next_v[j];
    }
    keys = next_keys;
    next_keys = after_keys;
  }
}

}  // namespace fusedattn::small_seq
