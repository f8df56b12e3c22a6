// The dense boolean mask of the block-sparse path, packed into the int32 words its
// Mosaic GPU kernels read (fusedattn/block_sparse/kernel_mask.py: `pack_bits` is the
// same packing in XLA, and the reference this kernel is tested against).
//
//   fusedattn_mask_bits(mask) -> words
// mask: PRED [B, H, s_q, s_kv] (XLA's bool: one byte, 0 or 1), s_kv a multiple of 16;
// words: S32 [B, H, kv_words, q_rows], q_rows >= s_q, 32 kv_words >= s_kv. Bit k of
// words[b, h, w, q] is mask[b, h, q, 32 w + k]; keys past s_kv and rows past s_q are 0.
//
// One pass over the mask, written word-major through shared memory: XLA's form
// reduces bytes row-major and transposes the words after, two passes.
#include <cstdint>
#include <string>

#include "capture_stats.h"
#include "module_registry.h"
#include "vendor.h"
#include "xla/ffi/api/ffi.h"

namespace fusedattn::mask_bits {

namespace ffi = ::xla::ffi;

constexpr int kRows = 64;     // query rows of a CTA
constexpr int kWords = 8;     // words of a CTA (256 keys)
constexpr int kThreads = 256;
constexpr int kItems = kRows * kWords / kThreads;  // (row, word) pairs a thread packs

// Eight bytes of 0 / 1 (the first the low one) -> eight bits, byte k to bit k. Byte k
// times the term 2^(56 - 7j) lands at bit 56 + 8k - 7j, a distinct place for each
// (k, j), so no carry reaches the top byte, which holds exactly the k == j terms.
__device__ __forceinline__ uint32_t octet(uint32_t lo, uint32_t hi) {
  const uint64_t x = (static_cast<uint64_t>(hi) << 32) | lo;
  return static_cast<uint32_t>((x * 0x0102040810204080ull) >> 56);
}

__device__ __forceinline__ uint32_t word_of(uint4 a, uint4 b) {  // 32 bytes -> 32 bits
  return octet(a.x, a.y) | octet(a.z, a.w) << 8 | octet(b.x, b.y) << 16 | octet(b.z, b.w) << 24;
}

__global__ void __launch_bounds__(kThreads)
pack_kernel(const uint8_t* __restrict__ mask, int32_t* __restrict__ words, int s_q, int s_kv,
            int q_rows, int kv_words, int word_tiles) {
  // Rows of kRows + 4: a warp's stores (8 words of 4 rows) fall in 32 distinct banks.
  __shared__ uint32_t tile[kWords][kRows + 4];
  const int64_t bh = blockIdx.x / word_tiles;
  const int w0 = (blockIdx.x % word_tiles) * kWords, q0 = blockIdx.y * kRows;
  const uint8_t* m = mask + bh * static_cast<int64_t>(s_q) * s_kv;
  // Eight neighbouring threads read one row's 256 bytes; each loads its pairs first.
  uint4 lo[kItems], hi[kItems];
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int item = threadIdx.x + i * kThreads;
    const int r = item / kWords, key = (w0 + item % kWords) * 32;
    lo[i] = hi[i] = make_uint4(0, 0, 0, 0);
    if (q0 + r < s_q) {  // s_kv % 16 == 0: each 16-byte half is all keys or none
      const uint4* row = reinterpret_cast<const uint4*>(m + static_cast<int64_t>(q0 + r) * s_kv + key);
      if (key < s_kv) lo[i] = row[0];
      if (key + 16 < s_kv) hi[i] = row[1];
    }
  }
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int item = threadIdx.x + i * kThreads;
    tile[item % kWords][item / kWords] = word_of(lo[i], hi[i]);
  }
  vendor::block_sync();
  for (int i = threadIdx.x; i < kWords * kRows; i += kThreads) {
    const int w = w0 + i / kRows, q = q0 + i % kRows;  // a warp writes 32 rows of one word
    if (w < kv_words && q < q_rows)
      words[(bh * kv_words + w) * q_rows + q] = static_cast<int32_t>(tile[i / kRows][i % kRows]);
  }
}

std::string dims_str(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

ffi::Error pack(vendor::stream_t stream, ffi::Buffer<ffi::PRED> mask, ffi::Result<ffi::Buffer<ffi::S32>> out) {
  static HandlerCounts& counts = HandlerCountRegistry::instance().counts("fusedattn_mask_bits");
  note_call(counts, vendor::stream_is_capturing(stream));
  const auto md = mask.dimensions(), wd = out->dimensions();
  std::string err;
  if (md.size() != 4 || wd.size() != 4)
    err = "mask and words must be [B, H, s_q, s_kv] and [B, H, kv_words, q_rows], got " +
          dims_str(md) + " and " + dims_str(wd);
  else if (md[0] != wd[0] || md[1] != wd[1])
    err = "words must have the mask's B and H: " + dims_str(md) + " vs " + dims_str(wd);
  else if (md[3] % 16 != 0)
    err = "s_kv must be a multiple of 16, got " + std::to_string(md[3]);
  else if (wd[2] * 32 < md[3] || wd[3] < md[2])
    err = "words " + dims_str(wd) + " do not cover the mask " + dims_str(md);
  else if (md[2] > INT32_MAX || md[3] > INT32_MAX || wd[2] > INT32_MAX || wd[3] > INT32_MAX)
    err = "mask too large: " + dims_str(md);
  if (!err.empty()) return ffi::Error::InvalidArgument("fusedattn_mask_bits: " + err);
  const int64_t bh = md[0] * md[1];
  const int s_q = static_cast<int>(md[2]), s_kv = static_cast<int>(md[3]);
  const int kv_words = static_cast<int>(wd[2]), q_rows = static_cast<int>(wd[3]);
  const int word_tiles = (kv_words + kWords - 1) / kWords;
  const int64_t row_tiles = (q_rows + kRows - 1) / kRows;
  if (bh == 0 || word_tiles == 0 || row_tiles == 0) return ffi::Error::Success();
  if (row_tiles > 65535) return ffi::Error::InvalidArgument("fusedattn_mask_bits: s_q too large");
  const dim3 grid(static_cast<unsigned>(bh * word_tiles), static_cast<unsigned>(row_tiles));
  pack_kernel<<<grid, kThreads, 0, stream>>>(reinterpret_cast<const uint8_t*>(mask.typed_data()),
                                              out->typed_data(), s_q, s_kv, q_rows, kv_words, word_tiles);
  const vendor::error_t e = vendor::last_error();
  if (e != vendor::error_t{}) return ffi::Error::Internal(std::string("fusedattn_mask_bits: ") + vendor::error_string(e));
  return ffi::Error::Success();
}

}  // namespace fusedattn::mask_bits

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnMaskBits, ::fusedattn::mask_bits::pack,
                              ::xla::ffi::Ffi::Bind()
                                  .Ctx<::xla::ffi::PlatformStream<::fusedattn::vendor::stream_t>>()
                                  .Arg<::xla::ffi::Buffer<::xla::ffi::PRED>>()  // mask
                                  .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>(),  // words
                              // Kernel launches only: XLA may capture it in CUDA graphs.
                              {::xla::ffi::Traits::kCmdBufferCompatible});

FUSEDATTN_MODULE_INIT(mask_bits) {
  pybind11::dict targets = m.attr("ffi_targets");
  targets["fusedattn_mask_bits"] = ::fusedattn::ffi_capsule(FusedattnMaskBits);
}
