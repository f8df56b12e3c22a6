// The block-sparse attention backward for Hopper in one kernel of five products a
// tile (CuTe, sm90 WGMMA): per 128-key block, its query blocks from the map's
// key-major lists, 64 queries a step. Three warpgroups:
//   - two compute warpgroups, each owning 64 keys:
//       S^T = K Q^T, dP^T = V dO^T               (shared memory operands)
//       P^T = exp2(S^T - lse), dS^T = P^T (dP^T - delta)
//       dV += P^T dO                               (P^T from registers)
//       dQ  = dS K, half of the head dim each      (both halves of dS through shared memory)
//       dK += dS^T Q                               (dS^T from registers)
//     and each stages its f32 half of dQ in shared memory while dK runs;
//   - a producer warpgroup: one thread loads K, V and each step's Q, dO, lse, delta and
//     mask words (ids or a dense mask's bits) with TMA and bulk copies into a ring of
//     stages (mbarriers say full / empty), and two warps reduce-add the staged dQ rows
//     into the f32 dq buffer with bulk copies, so neither loads nor dQ's reduction
//     stall the compute warpgroups.
// Measurement switches: FUSEDATTN_BSB_NO_DQ (neither dS's store nor dQ: the dK / dV
// part alone), FUSEDATTN_BSB_SPLIT_WAIT (S^T and dP^T waited for apart: P^T and its
// dV product run while dP^T is computed), FUSEDATTN_BSB_TURNS (with NO_DQ: the two
// compute warpgroups take turns on the tensor cores). Partial blocks apply the
// element mask, either a documents mask (equal ids, both valid; optionally causal) or
// a dense mask's bits, and hide keys past the real length; full blocks apply nothing.
#pragma once

#include <cstdint>

#include <cuda.h>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

#include "ptx.cuh"

namespace fusedattn::block_sparse {

// TMA descriptors of q, k, v, dout, dk and dv as (d, head, token) over tokens of all batches,
// each load a box of 64 d x 64 tokens with 128-byte swizzle: one half of a TileLayout
// tile (made on the host, ffi.cu).
struct BwdMaps {
  CUtensorMap q, k, v, dout, dk, dv;
};

struct BwdParams {
  const void* q;                 // [B, S, H, D]
  const void* k;                 // [B, S_kv, H_kv, D]
  const void* v;                 // [B, S_kv, H_kv, D]
  const void* dout;              // [B, S, H, D]
  const float* lse_delta;        // [B, H, 2, S]: base-2 lse (+inf: the row sees no key), delta
  const int32_t* q_words;        // [Bw, 2, S]: id, valid (null: no ids)
  const int32_t* kv_words;       // [Bw, 2, S_kv]
  const int32_t* bits;           // [Bd, Hd, S_kv / 32, S]: bit j % 32 of word j / 32 says
                                 // query i sees key j (null: no dense mask)
  const int32_t* q_num;          // [Lb, Lh, n_kv]        partial query blocks per key block
  const int32_t* q_idx;          // [Lb, Lh, n_kv, n_q]
  const int32_t* full_num;       // [Lb, Lh, n_kv]        full ones
  const int32_t* full_idx;       // [Lb, Lh, n_kv, n_q]
  const float* dv_add;           // [B, H, D], added to every key's dV (null: none): the
                                 // gradient of a mean of v given to rows that see no key
  const int32_t* order;          // [B * H * n_kv]: CTA i runs tile order[i], a permutation
                                 // of (b * H + h) * n_kv + kb
  float* dq_acc;                 // [B, S, H, D], zeroed
  void* dk;                      // [B, S_kv, H, D] per query head
  void* dv;
  int B, S, S_kv, H, H_kv, n_q, n_kv;
  int list_b, list_h, words_b;   // 1: varies along the batch / head axis, 0: broadcast
  int bits_b, bits_h;            // (the same, for the bits)
  int s_kv_real;                 // keys at or past this are padding
  float scale;                   // softmax scale
  bool causal;                   // partial blocks also need key <= query
};

#if defined(FUSEDATTN_BSB_TURNS) && (!defined(FUSEDATTN_BSB_NO_DQ) || defined(FUSEDATTN_BSB_SPLIT_WAIT))
#error "FUSEDATTN_BSB_TURNS is built with FUSEDATTN_BSB_NO_DQ and without FUSEDATTN_BSB_SPLIT_WAIT"
#endif
constexpr int kKeys = 128;       // keys a CTA owns (64 per compute warpgroup)
constexpr int kRows = 64;        // queries a step
constexpr int kDim = 128;
constexpr int kStages = 2;       // Q / dO stages in flight
constexpr int kCompute = 256;    // threads of the two compute warpgroups
constexpr int kThreads = 384;    // and the producer warpgroup
constexpr int kReducers = 64;    // producer threads reducing dQ, one row each (warps 0, 1)
constexpr int kLoader = 64;      // the producer thread issuing the loads (warp 2's first)
constexpr int kDqRow = 132;      // floats a staged dQ row takes (128 and 4 of padding)

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
    T q[kStages][kRows * kDim];
    T dout[kStages][kRows * kDim];
    T ds[2][2][kRows * kRows];        // [step parity][warpgroup]
    float dq[kRows * kDqRow];         // a step's dQ, both halves, for the reducers
    float lse[kStages][kRows];
    float delta[kStages][kRows];
    int32_t qid[kStages][kRows];
    int32_t qok[kStages][kRows];
    int32_t bits[kStages][kKeys / 32][kRows];   // partial steps' dense mask words
    uint64_t full[kStages];           // a stage loaded (its bytes counted in)
    uint64_t empty[kStages];          // a stage read by both compute warpgroups
    uint64_t kv_full;                 // K and V loaded (bytes counted in)
    uint64_t dq_full;                 // a step's dQ staged
    uint64_t dq_empty;                // ... and read by the bulk reductions
  };
};

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
__global__ void __launch_bounds__(kThreads, 1)
block_sparse_bwd_kernel(BwdParams p, const __grid_constant__ BwdMaps maps) {
  using Ty = BwdTypes<T>;
  using Smem = typename Ty::Smem;
  // The tiles need a 1024-byte aligned base (128-byte swizzle): the launch gives room.
  extern __shared__ __align__(1024) char smem_raw[];
  Smem& s = *reinterpret_cast<Smem*>(smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023));

  const int tid = threadIdx.x, wg = tid / 128, wt = tid % 128;
  // The GPU starts CTAs in index order and `order` lists the longest walks first, so
  // the last CTAs to start are short ones and few SMs idle while the rest finish.
  const int tile = p.order[blockIdx.x];
  const int kb = tile % p.n_kv, h = (tile / p.n_kv) % p.H, b = tile / (p.n_kv * p.H);
  const int h_kv = h / (p.H / p.H_kv);

  // This key block's query blocks: the partial ones, then the full ones.
  const int64_t list = (int64_t(p.list_b ? b : 0) * (p.list_h ? p.H : 1) + (p.list_h ? h : 0)) * p.n_kv + kb;
  const int n_partial = p.q_num[list], n_full = p.full_num[list];
  const int32_t* partial_idx = p.q_idx + list * p.n_q;
  const int32_t* full_idx = p.full_idx + list * p.n_q;
  const int steps = 2 * (n_partial + n_full);
  const int64_t words = int64_t(p.words_b ? b : 0) * 2;
  const bool ids = p.q_words != nullptr, dense = p.bits != nullptr;
  const int k0 = kb * kKeys;
  auto q_start = [&](int step) {
    int e = step >> 1;
    int blk = e < n_partial ? partial_idx[e] : full_idx[e - n_partial];
    return blk * kKeys + (step & 1) * kRows;
  };

  if (tid == 0) {
    for (int st = 0; st < kStages; ++st) {
      mbar_init(&s.full[st], 1);
      mbar_init(&s.empty[st], kCompute);
    }
    mbar_init(&s.kv_full, 1);
    mbar_init(&s.dq_full, kCompute);
    mbar_init(&s.dq_empty, kReducers);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (wg == 2) {   // ---- the producer warpgroup ----
    set_max_registers_dec<24>();
    if (wt == kLoader) {
      constexpr uint32_t tile = kRows * kDim * sizeof(T), side = kRows * 4;
      if (steps > 0) {
        mbar_expect(&s.kv_full, 4 * tile);
        for (int w = 0; w < 2; ++w) {
          const int row = b * p.S_kv + k0 + w * kRows;
          load_tile<T>(s.k[w], &maps.k, h_kv, row, &s.kv_full);
          load_tile<T>(s.v[w], &maps.v, h_kv, row, &s.kv_full);
        }
      }
      const float* ld = p.lse_delta + (int64_t(b) * p.H + h) * 2 * p.S;
      const int32_t* qw = ids ? p.q_words + words * p.S : nullptr;
      // This key block's four words of each query, for this (batch, head).
      const int32_t* bw = dense ? p.bits + ((int64_t(p.bits_b ? b : 0) * (p.bits_h ? p.H : 1) +
                                             (p.bits_h ? h : 0)) * (p.S_kv / 32) + kb * (kKeys / 32)) * p.S
                                : nullptr;
      // The list is read a step ahead, so its latency hides behind the wait for a stage.
      int q0 = steps > 0 ? q_start(0) : 0;
      for (int step = 0; step < steps; ++step) {
        const int st = step % kStages;
        const int next = step + 1 < steps ? q_start(step + 1) : 0;
        // (full blocks read no mask)
        const bool bits = dense && (step >> 1) < n_partial;
        if (step >= kStages) mbar_wait(&s.empty[st], ((step / kStages) - 1) & 1);
        mbar_expect(&s.full[st], 2 * tile + (ids ? 4 : 2) * side + (bits ? kKeys / 32 * side : 0));
        load_tile<T>(s.q[st], &maps.q, h, b * p.S + q0, &s.full[st]);
        load_tile<T>(s.dout[st], &maps.dout, h, b * p.S + q0, &s.full[st]);
        bulk_load(s.lse[st], ld + q0, side, &s.full[st]);
        bulk_load(s.delta[st], ld + p.S + q0, side, &s.full[st]);
        if (ids) {
          bulk_load(s.qid[st], qw + q0, side, &s.full[st]);
          bulk_load(s.qok[st], qw + p.S + q0, side, &s.full[st]);
        }
        if (bits)
          for (int w = 0; w < kKeys / 32; ++w)
            bulk_load(s.bits[st][w], bw + int64_t(w) * p.S + q0, side, &s.full[st]);
        q0 = next;
      }
    } else if (wt < kReducers) {   // reducers: row wt of each step's dQ
#ifndef FUSEDATTN_BSB_NO_DQ
      const uint32_t src = smem_u32(s.dq + wt * kDqRow);
      const int64_t q_row = int64_t(p.H) * kDim;
      for (int step = 0; step < steps; ++step) {
        float* dst = p.dq_acc + (int64_t(b) * p.S + q_start(step) + wt) * q_row + h * kDim;
        mbar_wait(&s.dq_full, step & 1);
        asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                     ::"l"(dst), "r"(src), "n"(kDim * 4) : "memory");
        bulk_commit_wait_read();
        mbar_arrive(&s.dq_empty);
      }
      asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
    }
    return;
  }

  // ---- the compute warpgroups ----
  set_max_registers_inc<240>();
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
  // Each thread holds two key rows of its warpgroup's 64: r0 and r0 + 8, for the
  // accumulator's values i with (i >> 1) & 1 equal to 0 and 1 (scalars, not arrays
  // indexed at run time, which went to local memory).
  const int key_r0 = k0 + wg * kRows + get<0>(coord_s(0)), key_r1 = key_r0 + 8;
  // Both rows lie in one 32-key word of a dense mask: this one, at these bits.
  const int bits_word = (key_r0 - k0) / 32, bit0 = (key_r0 - k0) % 32;
  bool key_ok0 = key_r0 < p.s_kv_real, key_ok1 = key_r1 < p.s_kv_real;
  int32_t key_id0 = 0, key_id1 = 0;
  if (ids) {
    const int32_t* kw = p.kv_words + words * p.S_kv;
    key_id0 = kw[key_r0];
    key_id1 = kw[key_r1];
    key_ok0 = key_ok0 && kw[p.S_kv + key_r0] != 0;
    key_ok1 = key_ok1 && kw[p.S_kv + key_r1] != 0;
  }
  // dS goes into its (query, key) tile, 128-byte swizzled (16-byte pieces of a 128-byte
  // row XORed with the row's index mod 8), by stmatrix.trans, four 8 x 8 pieces of the
  // fragment a store (value by value the stores were slower): lane 8m + jj gives the
  // address of piece m's query row jj, 16 bytes of keys from 16 (warp) + 8 (m & 1).
  const uint32_t ds_lane = [&] {
    const int lane = wt & 31, m = lane >> 3, jj = lane & 7;
    return uint32_t(sizeof(T)) * ((8 * (m >> 1) + jj) * kRows + ((((wt >> 5) * 2 + (m & 1)) ^ jj) << 3));
  }();
  const float scale_log2 = p.scale * 1.44269504088896340736f;
  if (steps > 0) mbar_wait(&s.kv_full, 0);

#ifdef FUSEDATTN_BSB_TURNS
  // The two warpgroups take turns on the tensor cores: between two meetings one issues
  // (and waits for) a step's dV and dK and the next step's S^T and dP^T while the other
  // computes P^T and dS^T. Warpgroup 1 starts a turn late.
  auto turn = [] { asm volatile("bar.sync 2, 256;\n" ::: "memory"); };
  if (wg == 1) turn();
#endif

  for (int step = 0; step < steps; ++step) {
    const int st = step % kStages, par = step & 1;
    mbar_wait(&s.full[st], (step / kStages) & 1);
    const bool partial = (step >> 1) < n_partial;
    const int q0 = partial && p.causal ? q_start(step) : 0;

    Tensor sQ = make_tensor(make_smem_ptr(s.q[st]), typename Ty::TileLayout{});
    Tensor sdO = make_tensor(make_smem_ptr(s.dout[st]), typename Ty::TileLayout{});
    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<_64, _64>{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<_64, _64>{});
    // P^T and dS^T, in the A-operand registers of dV and dK (the accumulator's value
    // order is the operand's: pairs of columns, rows r and r + 8, columns c and c + 8).
    Tensor r_p = make_tensor<T>(partition_shape_A(mma_kv, Shape<_64, _64>{}));
    Tensor r_ds = make_tensor<T>(partition_shape_A(mma_kv, Shape<_64, _64>{}));
    static_assert(decltype(size(r_p))::value == decltype(size(acc_s))::value);
    T* ds_tile = s.ds[par][wg];

    // P^T into r_p (and, f32, over S^T in acc_s). Partial blocks (the element mask) and
    // full ones (none) run separate loops, so neither branches per value.
    auto probabilities = [&](auto masked) {
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i) {
        const int qc = get<1>(coord_s(i));
        float x = acc_s(i) * scale_log2;
        if constexpr (decltype(masked)::value) {
          const bool upper = (i >> 1) & 1;   // row r0 + 8
          bool see = upper ? key_ok1 : key_ok0;
          // (&&: these loads only where needed; & without branches spilled registers)
          if (ids) see = see && s.qok[st][qc] != 0 && s.qid[st][qc] == (upper ? key_id1 : key_id0);
          if (dense) see = see && ((uint32_t(s.bits[st][bits_word][qc]) >> (bit0 + 8 * upper)) & 1u);
          if (p.causal) see = see && (upper ? key_r1 : key_r0) <= q0 + qc;
          if (!see) x = -INFINITY;
        }
        acc_s(i) = exp2_approx(x - s.lse[st][qc]);
        r_p(i) = T(acc_s(i));
      }
    };
    // dS^T into r_ds, and then dS into this warpgroup's shared tile for dQ: a second
    // loop, so no delta load waits behind a store it might alias (in one loop each did,
    // and their latency showed).
    auto score_grads = [&]() {
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i) {
        const int qc = get<1>(coord_s(i));
        r_ds(i) = T(acc_s(i) * (acc_dp(i) - s.delta[st][qc]));
      }
#ifndef FUSEDATTN_BSB_NO_DQ
      // Piece m of the nth store, keys 8 (m & 1) on and queries 8 (2n + (m >> 1)) on of
      // this warp's, is the pairs of values in register 4n + m (value i at key
      // r0 + 8 ((i >> 1) & 1), query c0 + (i & 1) + 8 (i >> 2)), 16 query rows a store.
      const uint32_t* pairs = reinterpret_cast<const uint32_t*>(r_ds.data());
      const uint32_t row = smem_u32(ds_tile) + ds_lane;
      CUTE_UNROLL
      for (int n = 0; n < 4; ++n)
        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                     ::"r"(row + uint32_t(n * 16 * kRows * sizeof(T))), "r"(pairs[4 * n]), "r"(pairs[4 * n + 1]),
                       "r"(pairs[4 * n + 2]), "r"(pairs[4 * n + 3]) : "memory");
#endif
    };
    // acc += a @ b_tile (dV: P^T with dO, dK: dS^T with Q) as one wgmma group. (The B
    // operand's descriptors are made here: kept across the loops above they took
    // registers and spilled.)
    auto accumulate = [&](auto& acc, auto& a, T* b_tile) {
      Tensor b = thr_kv.partition_fragment_B(
          make_tensor(make_smem_ptr(b_tile), typename Ty::TileLayoutT{}));
      warpgroup_fence_operand(acc);
      warpgroup_fence_operand(a);
      warpgroup_arrive();
      mma_blocks(mma_kv, a, b, acc, false);
      warpgroup_commit_batch();
    };

    {
      Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);
      Tensor tSrdO = thr_sdp.partition_fragment_B(sdO);
      warpgroup_fence_operand(acc_s);
      warpgroup_fence_operand(acc_dp);
      warpgroup_arrive();
      mma_blocks(mma_sdp, tSrK, tSrQ, acc_s, true);
#ifdef FUSEDATTN_BSB_SPLIT_WAIT
      // S^T and dP^T as two groups: P^T and its dV product go ahead while dP^T runs.
      warpgroup_commit_batch();
      mma_blocks(mma_sdp, tSrV, tSrdO, acc_dp, true);
      warpgroup_commit_batch();
      warpgroup_wait<1>();   // S^T
      warpgroup_fence_operand(acc_s);
#else
      mma_blocks(mma_sdp, tSrV, tSrdO, acc_dp, true);
      warpgroup_commit_batch();
#ifdef FUSEDATTN_BSB_TURNS
      turn();
#endif
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_s);
      warpgroup_fence_operand(acc_dp);
#endif
    }
    if (partial) probabilities(cute::true_type{});
    else probabilities(cute::false_type{});
#ifdef FUSEDATTN_BSB_SPLIT_WAIT
    accumulate(acc_dv, r_p, s.dout[st]);
    warpgroup_wait<1>();     // dP^T (dV may still run)
    warpgroup_fence_operand(acc_dp);
    score_grads();
#else
    score_grads();
#ifdef FUSEDATTN_BSB_TURNS
    turn();
#endif
    accumulate(acc_dv, r_p, s.dout[st]);
#endif
    // Once dV and dK are done this step's Q, dO, lse, delta and mask words are read (dQ
    // reads only dS and K) and the stage goes back to the producer.
    auto release_stage = [&] {
      warpgroup_fence_operand(acc_dv);
      warpgroup_fence_operand(acc_dk);
      warpgroup_fence_operand(r_p);
      warpgroup_fence_operand(r_ds);
      mbar_arrive(&s.empty[st]);
    };
#ifdef FUSEDATTN_BSB_NO_DQ
    accumulate(acc_dk, r_ds, s.q[st]);
    warpgroup_wait<0>();
    release_stage();
#else
    // Both halves of dS in shared memory, seen by the tensor cores (the other
    // warpgroup's dQ of two steps back, which read this parity's tiles, has completed
    // before it reached the last step's barrier).
    cutlass::arch::fence_view_async_shared();
    asm volatile("bar.sync 1, 256;\n" ::: "memory");

    Tensor acc_dq = partition_fragment_C(mma_q, Shape<_64, _64>{});
    warpgroup_fence_operand(acc_dq);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int u = 0; u < 2; ++u) {
      Tensor sdS = make_tensor(make_smem_ptr(s.ds[par][u]), typename Ty::DsLayout{});
      Tensor sKt = local_tile(make_tensor(make_smem_ptr(s.k[u]), typename Ty::TileLayoutT{}),
                              Shape<_64, _64>{}, make_coord(wg, 0));
      Tensor tQrdS = thr_q.partition_fragment_A(sdS);
      Tensor tQrKt = thr_q.partition_fragment_B(sKt);
      mma_blocks(mma_q, tQrdS, tQrKt, acc_dq, u == 0);
    }
    warpgroup_commit_batch();
    accumulate(acc_dk, r_ds, s.q[st]);   // (dQ staged while dK runs)
    warpgroup_wait<1>();   // dV and dQ
    warpgroup_fence_operand(acc_dq);

    // This warpgroup's half of dQ into the staging rows, once the reducers have read
    // the last step's.
    if (step > 0) mbar_wait(&s.dq_empty, (step - 1) & 1);
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); i += 2) {
      const int r = get<0>(coord_q(i)), c = get<1>(coord_q(i));
      *reinterpret_cast<float2*>(s.dq + r * kDqRow + wg * 64 + c) = make_float2(acc_dq(i), acc_dq(i + 1));
    }
    cutlass::arch::fence_view_async_shared();
    mbar_arrive(&s.dq_full);
    warpgroup_wait<0>();   // dK
    release_stage();
#endif
  }

#ifdef FUSEDATTN_BSB_TURNS
  if (wg == 0) turn();
#endif
  // dK (scaled) and dV of this warpgroup's 64 keys, per query head: into its K and V
  // tiles (once no product reads them: in the whole kernel the other warpgroup's dQ
  // reads this K) and out by TMA, whole rows at once (the fragments' scalar stores were
  // slow: docs/decisions.md).
#ifndef FUSEDATTN_BSB_NO_DQ
  asm volatile("bar.sync 1, 256;\n" ::: "memory");
#endif
  Tensor coord_kv = thr_kv.partition_C(make_identity_tensor(Shape<_64, _128>{}));
  T* sk = s.k[wg];
  T* sv = s.v[wg];
  if (p.dv_add) {
    const float* add = p.dv_add + (int64_t(b) * p.H + h) * kDim;
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dv); ++i) acc_dv(i) += add[get<1>(coord_kv(i))];
  }
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); i += 2) {
    const int at = swizzled(get<0>(coord_kv(i)), get<1>(coord_kv(i)));
    store_pair(sk + at, acc_dk(i) * p.scale, acc_dk(i + 1) * p.scale);
    store_pair(sv + at, acc_dv(i), acc_dv(i + 1));
  }
  cutlass::arch::fence_view_async_shared();
  asm volatile("bar.sync %0, 128;\n" ::"r"(3 + wg) : "memory");
  if (wt == 0) {
    const int row = b * p.S_kv + k0 + wg * kRows;
    store_tile(&maps.dk, sk, h, row);
    store_tile(&maps.dv, sv, h, row);
    bulk_commit_wait_read();
  }
}

template <typename T>
constexpr int bwd_smem_bytes() {
  return int(sizeof(typename BwdTypes<T>::Smem));
}

}  // namespace fusedattn::block_sparse
