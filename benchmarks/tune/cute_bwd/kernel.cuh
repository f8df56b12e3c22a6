// The block-sparse attention backward for Hopper in one kernel of five products a
// tile (CuTe, sm90 WGMMA): per 128-key block, its query blocks from the map's
// key-major lists, 64 queries a step. Each of two warpgroups owns 64 keys:
//   S^T = K Q^T, dP^T = V dO^T               (shared memory operands)
//   P^T = exp2(S^T - lse), dS^T = P^T (dP^T - delta)
//   dV += P^T dO, dK += dS^T Q                (P^T, dS^T from registers)
//   dQ  = dS K                                 (dS through shared memory, both halves)
// and dQ is added in f32 to a zeroed buffer with vector reductions (the Mosaic GPU
// kernels take seven products, dq in a kernel of its own: docs/decisions.md).
// Measurement switches: FUSEDATTN_BSB_BULK_DQ (dQ staged in shared memory, a bulk
// reduce-add per row), FUSEDATTN_BSB_NO_RED (no dQ reduction), FUSEDATTN_BSB_NO_DQ
// (neither dS's store nor dQ: the dK / dV kernel alone).
// Partial blocks apply the documents mask (equal ids, both valid; optionally causal)
// and hide keys past the real length; full blocks apply nothing.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

namespace fusedattn::block_sparse {

struct BwdParams {
  const void* q;                 // [B, S, H, D]
  const void* k;                 // [B, S_kv, H_kv, D]
  const void* v;                 // [B, S_kv, H_kv, D]
  const void* dout;              // [B, S, H, D]
  const float* lse_delta;        // [B, H, 2, S]: base-2 lse (+inf: the row sees no key), delta
  const int32_t* q_words;        // [Bw, 2, S]: id, valid (null: no ids)
  const int32_t* kv_words;       // [Bw, 2, S_kv]
  const int32_t* q_num;          // [Lb, Lh, n_kv]        partial query blocks per key block
  const int32_t* q_idx;          // [Lb, Lh, n_kv, n_q]
  const int32_t* full_num;       // [Lb, Lh, n_kv]        full ones
  const int32_t* full_idx;       // [Lb, Lh, n_kv, n_q]
  float* dq_acc;                 // [B, S, H, D], zeroed
  void* dk;                      // [B, S_kv, H, D] per query head
  void* dv;
  int B, S, S_kv, H, H_kv, n_q, n_kv;
  int list_b, list_h, words_b;   // 1: varies along the batch / head axis, 0: broadcast
  int s_kv_real;                 // keys at or past this are padding
  float scale;                   // softmax scale
  bool causal;                   // partial blocks also need key <= query
};

constexpr int kKeys = 128;       // keys a CTA owns (64 per warpgroup)
constexpr int kRows = 64;        // queries a step
constexpr int kDim = 128;
constexpr int kThreads = 256;
constexpr int kDqStride = 72;    // floats a staged dQ row takes (64 and 8 of padding)

using namespace cute;

template <typename T>
struct BwdTypes {
  // Rows of 128 head-dim values, 128-byte swizzled: K / V per warpgroup, Q / dO per stage.
  using TileLayout = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, Shape<_64, _128>{}));
  // The same bytes as (d, row): the MN-major operand of dV, dK (Q, dO) and dQ (K).
  using TileLayoutT = decltype(composition(TileLayout{},
                                           make_layout(Shape<_128, _64>{}, Stride<_64, _1>{})));
  // dS of one key half as (query, key), keys contiguous: dQ's K-major A operand.
  using DsLayout = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, Shape<_64, _64>{}));

  using MmaSdP = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<T, T, float, Shape<_64, _64, _128>, GMMA::Major::K, GMMA::Major::K>()));
  using MmaKV = decltype(make_tiled_mma(
      SM90::GMMA::rs_op_selector<T, T, float, Shape<_64, _128, _64>, GMMA::Major::K, GMMA::Major::MN>()));
  using MmaQ = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<T, T, float, Shape<_64, _64, _64>, GMMA::Major::K, GMMA::Major::MN>()));

  struct alignas(1024) Smem {
    T k[2][kRows * kDim];
    T v[2][kRows * kDim];
    T q[2][kRows * kDim];
    T dout[2][kRows * kDim];
    T ds[2][kRows * kRows];
    float lse[2][kRows];
    float delta[2][kRows];
    int32_t qid[2][kRows];
    int32_t qok[2][kRows];
#ifdef FUSEDATTN_BSB_BULK_DQ
    float dq[2][kRows * kDqStride];   // each warpgroup's dQ, reduce-added by rows
#endif
  };
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}

__device__ __forceinline__ void red_add_v2(float* gmem, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(gmem), "f"(a), "f"(b) : "memory");
}

// Rows [row0, row0 + 64) of a [.., S, H, D] tensor at (b, h) into a swizzled tile;
// every thread takes 16-byte pieces.
template <typename T, typename Layout>
__device__ __forceinline__ void load_tile(T* smem, const T* g, int64_t row_stride, int tid) {
  Tensor s = make_tensor(make_smem_ptr(smem), Layout{});
  CUTE_UNROLL
  for (int i = 0; i < kRows * kDim / 8 / kThreads; ++i) {
    int piece = tid + i * kThreads;
    int r = piece / (kDim / 8), c = (piece % (kDim / 8)) * 8;
    cp_async16(&s(r, c), g + r * row_stride + c);
  }
}

template <class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void mma_blocks(Mma& mma, TA const& a, TB const& b, TC& c, bool zero) {
  mma.accumulate_ = zero ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(a); ++kb) {
    cute::gemm(mma, a(_, _, kb), b(_, _, kb), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) block_sparse_bwd_kernel(BwdParams p) {
  using Ty = BwdTypes<T>;
  using Smem = typename Ty::Smem;
  extern __shared__ __align__(1024) char smem_raw[];
  Smem& s = *reinterpret_cast<Smem*>(smem_raw);

  const int tid = threadIdx.x, wg = tid / 128, wt = tid % 128;
  const int kb = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int h_kv = h / (p.H / p.H_kv);
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const T* dout = static_cast<const T*>(p.dout);
  const int64_t q_row = int64_t(p.H) * kDim, kv_row = int64_t(p.H_kv) * kDim;

  // This key block's query blocks: the partial ones, then the full ones.
  const int64_t list = (int64_t(p.list_b ? b : 0) * (p.list_h ? p.H : 1) + (p.list_h ? h : 0)) * p.n_kv + kb;
  const int n_partial = p.q_num[list], n_full = p.full_num[list];
  const int32_t* partial_idx = p.q_idx + list * p.n_q;
  const int32_t* full_idx = p.full_idx + list * p.n_q;
  const int steps = 2 * (n_partial + n_full);
  const float* ld = p.lse_delta + (int64_t(b) * p.H + h) * 2 * p.S;
  const int64_t words = int64_t(p.words_b ? b : 0) * 2;
  const bool ids = p.q_words != nullptr;

  auto q_start = [&](int step) {
    int e = step >> 1;
    int blk = e < n_partial ? partial_idx[e] : full_idx[e - n_partial];
    return blk * kKeys + (step & 1) * kRows;
  };
  auto load_step = [&](int step, int stage) {
    int q0 = q_start(step);
    load_tile<T, typename Ty::TileLayout>(s.q[stage], q + (int64_t(b) * p.S + q0) * q_row + h * kDim, q_row, tid);
    load_tile<T, typename Ty::TileLayout>(s.dout[stage], dout + (int64_t(b) * p.S + q0) * q_row + h * kDim, q_row, tid);
    if (tid < 64) {   // lse, delta, ids, valid: 16 pieces of 16 bytes each
      int which = tid / 16, piece = (tid % 16) * 4;
      if (which == 0) cp_async16(&s.lse[stage][piece], ld + q0 + piece);
      if (which == 1) cp_async16(&s.delta[stage][piece], ld + p.S + q0 + piece);
      if (ids && which == 2) cp_async16(&s.qid[stage][piece], p.q_words + words * p.S + q0 + piece);
      if (ids && which == 3) cp_async16(&s.qok[stage][piece], p.q_words + (words + 1) * p.S + q0 + piece);
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };

  // K and V of both warpgroups, with the first step.
  const int k0 = kb * kKeys;
  for (int w = 0; w < 2; ++w) {
    const int64_t at = (int64_t(b) * p.S_kv + k0 + w * kRows) * kv_row + h_kv * kDim;
    load_tile<T, typename Ty::TileLayout>(s.k[w], k + at, kv_row, tid);
    load_tile<T, typename Ty::TileLayout>(s.v[w], v + at, kv_row, tid);
  }
  if (steps > 0) load_step(0, 0);
  else asm volatile("cp.async.commit_group;\n" ::);

  typename Ty::MmaSdP mma_sdp;
  typename Ty::MmaKV mma_kv;
  typename Ty::MmaQ mma_q;
  auto thr_sdp = mma_sdp.get_thread_slice(wt);
  auto thr_kv = mma_kv.get_thread_slice(wt);
  auto thr_q = mma_q.get_thread_slice(wt);

  Tensor sKw = make_tensor(make_smem_ptr(s.k[wg]), typename Ty::TileLayout{});
  Tensor sVw = make_tensor(make_smem_ptr(s.v[wg]), typename Ty::TileLayout{});
  Tensor tSrK = thr_sdp.partition_fragment_A(sKw);
  Tensor tSrV = thr_sdp.partition_fragment_A(sVw);

  Tensor acc_dv = partition_fragment_C(mma_kv, Shape<_64, _128>{});
  Tensor acc_dk = partition_fragment_C(mma_kv, Shape<_64, _128>{});
  clear(acc_dv);
  clear(acc_dk);

  // This thread's (key, query) coordinates in a score tile, and (query, d) in dQ's.
  Tensor coord_s = thr_sdp.partition_C(make_identity_tensor(Shape<_64, _64>{}));
  Tensor coord_q = thr_q.partition_C(make_identity_tensor(Shape<_64, _64>{}));
  // Each thread holds two key rows of its warpgroup's 64.
  int key_r[2];
  int32_t key_id[2] = {0, 0};
  bool key_ok[2];
  {
    int r0 = get<0>(coord_s(0));
    key_r[0] = k0 + wg * kRows + r0;
    key_r[1] = key_r[0] + 8;
    for (int j = 0; j < 2; ++j) {
      key_ok[j] = key_r[j] < p.s_kv_real;
      if (ids) {
        const int32_t* kw = p.kv_words + words * p.S_kv;
        key_id[j] = kw[key_r[j]];
        key_ok[j] = key_ok[j] && kw[p.S_kv + key_r[j]] != 0;
      }
    }
  }
  const float scale_log2 = p.scale * 1.44269504088896340736f;

  for (int step = 0; step < steps; ++step) {
    const int stage = step & 1;
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    cutlass::arch::fence_view_async_shared();
    __syncthreads();   // this stage loaded; the last step's products all done
    if (step + 1 < steps) load_step(step + 1, stage ^ 1);
    const int q0 = q_start(step);
    const bool partial = (step >> 1) < n_partial;

    Tensor sQ = make_tensor(make_smem_ptr(s.q[stage]), typename Ty::TileLayout{});
    Tensor sdO = make_tensor(make_smem_ptr(s.dout[stage]), typename Ty::TileLayout{});
    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<_64, _64>{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<_64, _64>{});
    {
      Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);
      Tensor tSrdO = thr_sdp.partition_fragment_B(sdO);
      warpgroup_fence_operand(acc_s);
      warpgroup_fence_operand(acc_dp);
      warpgroup_arrive();
      mma_blocks(mma_sdp, tSrK, tSrQ, acc_s, true);
      mma_blocks(mma_sdp, tSrV, tSrdO, acc_dp, true);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_s);
      warpgroup_fence_operand(acc_dp);
    }

    // P^T and dS^T, in the A-operand registers of dV and dK (the accumulator's value
    // order is the operand's: pairs of columns, rows r and r + 8, columns c and c + 8).
    Tensor r_p = make_tensor<T>(partition_shape_A(mma_kv, Shape<_64, _64>{}));
    Tensor r_ds = make_tensor<T>(partition_shape_A(mma_kv, Shape<_64, _64>{}));
    static_assert(decltype(size(r_p))::value == decltype(size(acc_s))::value);
    T* ds_tile = s.ds[wg];
    CUTE_UNROLL
    for (int i = 0; i < size(acc_s); ++i) {
      const int kr = get<0>(coord_s(i)), qc = get<1>(coord_s(i));
      float x = acc_s(i) * scale_log2;
      if (partial) {
        const int j = (kr >> 3) & 1;   // rows r and r + 8
        const int key = key_r[j], query = q0 + qc;
        bool see = key_ok[j];
        if (ids) see = see && s.qok[stage][qc] != 0 && s.qid[stage][qc] == key_id[j];
        if (p.causal) see = see && key <= query;
        if (!see) x = -INFINITY;
      }
      const float pr = exp2f(x - s.lse[stage][qc]);
      const float ds = pr * (acc_dp(i) - s.delta[stage][qc]);
      r_p(i) = T(pr);
      r_ds(i) = T(ds);
      // dS[query][key] in the swizzled tile (16-byte pieces of a 128-byte row XORed
      // with the row's index mod 8); written by hand: CuTe's view of the transpose
      // kept 32 addresses live and spilled registers.
      ds_tile[qc * kRows + (kr ^ ((qc & 7) << 3))] = T(ds);
    }

    {
      Tensor sQt = make_tensor(make_smem_ptr(s.q[stage]), typename Ty::TileLayoutT{});
      Tensor sdOt = make_tensor(make_smem_ptr(s.dout[stage]), typename Ty::TileLayoutT{});
      Tensor tKVrdO = thr_kv.partition_fragment_B(sdOt);
      Tensor tKVrQ = thr_kv.partition_fragment_B(sQt);
      warpgroup_fence_operand(acc_dv);
      warpgroup_fence_operand(acc_dk);
      warpgroup_fence_operand(r_p);
      warpgroup_fence_operand(r_ds);
      warpgroup_arrive();
      mma_blocks(mma_kv, r_p, tKVrdO, acc_dv, false);
      mma_blocks(mma_kv, r_ds, tKVrQ, acc_dk, false);
      warpgroup_commit_batch();
    }

#ifdef FUSEDATTN_BSB_NO_DQ
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_dv);
    warpgroup_fence_operand(acc_dk);
    warpgroup_fence_operand(r_p);
    warpgroup_fence_operand(r_ds);
    continue;
#endif
    // Both halves of dS in shared memory, seen by the tensor cores.
    cutlass::arch::fence_view_async_shared();
    asm volatile("bar.sync 1, 256;\n" ::: "memory");

    Tensor acc_dq = partition_fragment_C(mma_q, Shape<_64, _64>{});
    warpgroup_fence_operand(acc_dq);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int u = 0; u < 2; ++u) {
      Tensor sdS = make_tensor(make_smem_ptr(s.ds[u]), typename Ty::DsLayout{});
      Tensor sKt = local_tile(make_tensor(make_smem_ptr(s.k[u]), typename Ty::TileLayoutT{}),
                              Shape<_64, _64>{}, make_coord(wg, 0));
      Tensor tQrdS = thr_q.partition_fragment_A(sdS);
      Tensor tQrKt = thr_q.partition_fragment_B(sKt);
      mma_blocks(mma_q, tQrdS, tQrKt, acc_dq, u == 0);
    }
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_dv);
    warpgroup_fence_operand(acc_dk);
    warpgroup_fence_operand(r_p);
    warpgroup_fence_operand(r_ds);
    warpgroup_fence_operand(acc_dq);

    float* dq_rows = p.dq_acc + (int64_t(b) * p.S + q0) * q_row + h * kDim + wg * 64;
#if defined(FUSEDATTN_BSB_BULK_DQ)
    // Staged in shared memory, then a bulk reduce-add per row.
    float* staged = s.dq[wg];
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); i += 2) {
      const int r = get<0>(coord_q(i)), c = get<1>(coord_q(i));
      *reinterpret_cast<float2*>(staged + r * kDqStride + c) = make_float2(acc_dq(i), acc_dq(i + 1));
    }
    cutlass::arch::fence_view_async_shared();
    asm volatile("bar.sync %0, 128;\n" ::"r"(2 + wg) : "memory");
    if (wt < kRows) {
      uint32_t src = static_cast<uint32_t>(__cvta_generic_to_shared(staged + wt * kDqStride));
      asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], 256;\n"
                   ::"l"(dq_rows + wt * q_row), "r"(src) : "memory");
      asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
      asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    }
#elif !defined(FUSEDATTN_BSB_NO_RED)
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); i += 2) {
      const int r = get<0>(coord_q(i)), c = get<1>(coord_q(i));
      red_add_v2(dq_rows + r * q_row + c, acc_dq(i), acc_dq(i + 1));
    }
#endif
  }
#if defined(FUSEDATTN_BSB_BULK_DQ)
  if (wt < kRows) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif

  // dK (scaled) and dV of this warpgroup's 64 keys, per query head.
  Tensor coord_kv = thr_kv.partition_C(make_identity_tensor(Shape<_64, _128>{}));
  T* dk = static_cast<T*>(p.dk);
  T* dv = static_cast<T*>(p.dv);
  const int64_t out_row = int64_t(p.H) * kDim;
  const int64_t base = (int64_t(b) * p.S_kv + k0 + wg * kRows) * out_row + h * kDim;
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); i += 2) {
    const int r = get<0>(coord_kv(i)), c = get<1>(coord_kv(i));
    T* a = dk + base + r * out_row + c;
    T* d = dv + base + r * out_row + c;
    a[0] = T(acc_dk(i) * p.scale);
    a[1] = T(acc_dk(i + 1) * p.scale);
    d[0] = T(acc_dv(i));
    d[1] = T(acc_dv(i + 1));
  }
}

template <typename T>
constexpr int bwd_smem_bytes() {
  return int(sizeof(typename BwdTypes<T>::Smem));
}

}  // namespace fusedattn::block_sparse
