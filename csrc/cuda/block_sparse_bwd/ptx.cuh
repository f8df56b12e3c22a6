// The PTX the CuTe block-sparse backward (kernel.cuh) uses beside CuTe's wgmma:
// mbarriers, TMA and bulk copies, register reallocation, and the TileLayout's swizzle
// (64 x 128 tiles of 16-bit values, 128-byte swizzled, half the head dim a TMA box).
#pragma once

#include <cstdint>

#include <cuda.h>

namespace fusedattn::block_sparse {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n"
               ::"r"(smem_u32(bar)) : "memory");
}
// Waits for the completion of the barrier's phase of this parity.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n"
      "WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n}\n" ::"r"(smem_u32(bar)), "r"(parity) : "memory");
}
// One arrival that also expects `bytes` of async copies to complete the phase.
__device__ __forceinline__ void mbar_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
               ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory.
__device__ __forceinline__ void bulk_load(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(smem_u32(smem)), "l"(gmem), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}
// Commits this thread's bulk copies as a group and waits until their sources are read.
__device__ __forceinline__ void bulk_commit_wait_read() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
__device__ __forceinline__ float exp2_approx(float x) {   // (-inf -> 0)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
template <int N>
__device__ __forceinline__ void set_max_registers_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void set_max_registers_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Element offset of (row, col) in a 64 x 128 TileLayout tile on a 1024-byte aligned
// base: 8 x 64 atoms of 128-byte rows, down the rows first, each row's 16-byte pieces
// XORed with the row's index mod 8.
__device__ __forceinline__ int swizzled(int r, int c) {
  return (r >> 3) * 512 + (c >> 6) * 4096 + (r & 7) * 64 + ((((c & 63) >> 3) ^ (r & 7)) << 3) + (c & 7);
}
template <typename T>
__device__ __forceinline__ void store_pair(T* smem, float x, float y) {
  T pair[2] = {T(x), T(y)};
  *reinterpret_cast<uint32_t*>(smem) = *reinterpret_cast<const uint32_t*>(pair);
}

// 64 rows from `row` (of all batches' tokens) at head `h` into a TileLayout tile: two
// TMA boxes of 64 d (128-byte rows), the second half of d 4096 elements on.
template <typename T>
__device__ __forceinline__ void load_tile(T* smem, const CUtensorMap* map, int h, int row, uint64_t* bar) {
  for (int half = 0; half < 2; ++half)
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];\n"
        ::"r"(smem_u32(smem + half * 4096)), "l"(reinterpret_cast<uint64_t>(map)),
          "r"(half * 64), "r"(h), "r"(row), "r"(smem_u32(bar)) : "memory");
}

// The reverse: a TileLayout tile out to 64 rows from `row` at head `h` (bulk group).
template <typename T>
__device__ __forceinline__ void store_tile(const CUtensorMap* map, const T* smem, int h, int row) {
  for (int half = 0; half < 2; ++half)
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n"
                 ::"l"(reinterpret_cast<uint64_t>(map)), "r"(half * 64), "r"(h), "r"(row),
                   "r"(smem_u32(smem + half * 4096)) : "memory");
}

}  // namespace fusedattn::block_sparse
