// The XLA FFI handler of the CuTe block-sparse backward (kernel.cuh): checks the
// buffers, makes the TMA descriptors, zeroes the f32 dq buffer and launches on XLA's
// stream. Built for sm_90a into the CUDA extension as `fusedattn_block_sparse_bwd`
// (cmake/fusedattn_cuda.cmake, where the CUTLASS headers are found), and on its own,
// with the kernel's -D measurement switches, by benchmarks/tune/cute_bsa_bwd.py.
#include <cuda_runtime.h>

#include <string>
#include <tuple>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

#include "kernel.cuh"
#include "module_registry.h"

namespace ffi = xla::ffi;

namespace fusedattn::block_sparse {
namespace {

// A TMA descriptor of a [B, S, H, 128] tensor as (d, head, token): boxes of 64 d x 64
// tokens, 128-byte swizzle (kernel.cuh's TileLayout, half a tile a box).
std::string tensor_map(CUtensorMap* map, const void* base, int tokens, int heads, bool bf16) {
  using Encode = decltype(&cuTensorMapEncodeTiled);
  static Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<Encode>(fn);
  }();
  if (!encode) return "the driver has no cuTensorMapEncodeTiled";
  const cuuint64_t dims[3] = {kDim, cuuint64_t(heads), cuuint64_t(tokens)};
  const cuuint64_t strides[2] = {kDim * 2, cuuint64_t(heads) * kDim * 2};   // bytes
  const cuuint32_t box[3] = {64, 1, kRows}, unit[3] = {1, 1, 1};
  CUresult r = encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                      3, const_cast<void*>(base), dims, strides, box, unit,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? std::string() : "cuTensorMapEncodeTiled failed: " + std::to_string(r);
}

template <typename T>
std::string launch(cudaStream_t stream, const BwdParams& p) {
  constexpr int smem = bwd_smem_bytes<T>() + 1024;   // (room to align the base)
  auto kernel = block_sparse_bwd_kernel<T>;
  // (every call: the attribute is the current device's)
  const cudaError_t attr = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (attr != cudaSuccess) return std::string("smem attribute: ") + cudaGetErrorString(attr);
  BwdMaps maps;
  constexpr bool bf16 = std::is_same_v<T, cutlass::bfloat16_t>;
  for (auto [map, base, tokens, heads] :
       {std::tuple{&maps.q, p.q, p.B * p.S, p.H}, std::tuple{&maps.dout, p.dout, p.B * p.S, p.H},
        std::tuple{&maps.k, p.k, p.B * p.S_kv, p.H_kv}, std::tuple{&maps.v, p.v, p.B * p.S_kv, p.H_kv},
        std::tuple{&maps.dk, static_cast<const void*>(p.dk), p.B * p.S_kv, p.H},
        std::tuple{&maps.dv, static_cast<const void*>(p.dv), p.B * p.S_kv, p.H}}) {
    std::string e = tensor_map(map, base, tokens, heads, bf16);
    if (!e.empty()) return e;
  }
  dim3 grid(p.n_kv * p.H * p.B);
  kernel<<<grid, kThreads, smem, stream>>>(p, maps);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? std::string() : std::string("launch: ") + cudaGetErrorString(e);
}

// Every buffer's shape and dtype, and the attributes' ranges, checked before anything
// runs; p gets the sizes and broadcast flags.
std::string check(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                  const ffi::AnyBuffer& d_o, const ffi::Buffer<ffi::F32>& lse_delta,
                  const ffi::Buffer<ffi::S32>& q_num, const ffi::Buffer<ffi::S32>& q_idx,
                  const ffi::Buffer<ffi::S32>& full_num, const ffi::Buffer<ffi::S32>& full_idx,
                  const ffi::AnyBuffer& q_words, const ffi::AnyBuffer& kv_words,
                  const ffi::AnyBuffer& bits, const ffi::Buffer<ffi::F32>& dv_add,
                  const ffi::Buffer<ffi::S32>& order, const ffi::Buffer<ffi::F32>& dq_acc,
                  const ffi::AnyBuffer& dk, const ffi::AnyBuffer& dv, int32_t s_kv_real,
                  BwdParams& p) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4) return "q, k must be [B, S, H, D]";
  p.B = int(qd[0]); p.S = int(qd[1]); p.H = int(qd[2]);
  p.S_kv = int(kd[1]); p.H_kv = int(kd[2]);
  if (p.B < 1 || p.S < 1 || p.H < 1 || p.S_kv < 1 || p.H_kv < 1)
    return "q, k must have a batch row, a token and a head";
  if (qd[3] != kDim || kd[3] != kDim) return "the head dim must be 128";
  if (q.element_type() != ffi::DataType::BF16 && q.element_type() != ffi::DataType::F16)
    return "q must be bfloat16 or float16";
  if (kd[0] != p.B || p.H % p.H_kv || p.S % kKeys || p.S_kv % kKeys)
    return "k must be [B, S_kv, H_kv, 128] with H % H_kv == 0 and S, S_kv multiples of 128";
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type() ||
      d_o.element_type() != q.element_type())
    return "q, k, v and do must share one dtype";
  if (v.element_count() != k.element_count() || d_o.element_count() != q.element_count())
    return "v must match k, do must match q";
  if (lse_delta.element_count() != size_t(p.B) * p.H * 2 * p.S) return "lse_delta must be [B, H, 2, S]";
  auto ld = q_num.dimensions(), li = q_idx.dimensions();
  if (ld.size() != 3 || li.size() != 4) return "the key-major lists must be [Lb, Lh, n_kv(, n_q)]";
  p.n_kv = p.S_kv / kKeys; p.n_q = p.S / kKeys;
  if (ld[2] != p.n_kv || li[3] != p.n_q) return "the lists do not fit the sequence lengths";
  if ((ld[0] != 1 && ld[0] != p.B) || (ld[1] != 1 && ld[1] != p.H)) return "lists' batch / head axes";
  p.list_b = ld[0] != 1; p.list_h = ld[1] != 1;
  if (full_num.element_count() != q_num.element_count() ||
      full_idx.element_count() != q_idx.element_count())
    return "the full lists must match the partial ones";
  if (s_kv_real < 1 || s_kv_real > p.S_kv) return "s_kv_real must be in [1, S_kv]";
  if (q_words.element_count() > 0) {
    auto wq = q_words.dimensions(), wk = kv_words.dimensions();
    if (wq.size() != 3 || wk.size() != 3 || wq[1] != 2 || wk[1] != 2 || wq[2] != p.S ||
        wk[2] != p.S_kv || wq[0] != wk[0] || (wq[0] != 1 && wq[0] != p.B))
      return "q_words / kv_words must be [B|1, 2, S] / [B|1, 2, S_kv]";
    if (q_words.element_type() != ffi::DataType::S32 || kv_words.element_type() != ffi::DataType::S32)
      return "q_words / kv_words must be int32";
    p.words_b = wq[0] != 1;
  }
  if (bits.element_count() > 0) {
    auto bd = bits.dimensions();
    if (bd.size() != 4 || bd[2] != p.S_kv / 32 || bd[3] != p.S || (bd[0] != 1 && bd[0] != p.B) ||
        (bd[1] != 1 && bd[1] != p.H))
      return "bits must be [B|1, H|1, S_kv / 32, S]";
    if (bits.element_type() != ffi::DataType::S32) return "bits must be int32";
    if (q_words.element_count() > 0) return "ids and bits are one mask or the other";
    p.bits_b = bd[0] != 1; p.bits_h = bd[1] != 1;
  }
  if (dv_add.element_count() > 0) {
    auto ad = dv_add.dimensions();
    if (ad.size() != 3 || ad[0] != p.B || ad[1] != p.H || ad[2] != kDim)
      return "dv_add must be [B, H, 128]";
  }
  if (order.element_count() != size_t(p.B) * p.H * p.n_kv)
    return "order must list the B * H * n_kv tiles";
  if (dq_acc.element_count() != q.element_count() ||
      dk.element_count() != q.element_count() / p.S * p.S_kv ||
      dv.element_count() != dk.element_count())
    return "dq_acc must be [B, S, H, D]; dk, dv [B, S_kv, H, D]";
  if (dk.element_type() != q.element_type() || dv.element_type() != q.element_type())
    return "dk and dv must have q's dtype";
  return {};
}

ffi::Error bwd(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
               ffi::AnyBuffer d_o, ffi::Buffer<ffi::F32> lse_delta, ffi::Buffer<ffi::S32> q_num,
               ffi::Buffer<ffi::S32> q_idx, ffi::Buffer<ffi::S32> full_num,
               ffi::Buffer<ffi::S32> full_idx, ffi::AnyBuffer q_words, ffi::AnyBuffer kv_words,
               ffi::AnyBuffer bits, ffi::Buffer<ffi::F32> dv_add, ffi::Buffer<ffi::S32> order,
               ffi::Result<ffi::Buffer<ffi::F32>> dq_acc, ffi::Result<ffi::AnyBuffer> dk,
               ffi::Result<ffi::AnyBuffer> dv, float scale, bool causal, int32_t s_kv_real) {
  BwdParams p{};
  std::string err = check(q, k, v, d_o, lse_delta, q_num, q_idx, full_num, full_idx, q_words,
                          kv_words, bits, dv_add, order, *dq_acc, *dk, *dv, s_kv_real, p);
  if (!err.empty()) return ffi::Error::InvalidArgument("fusedattn_block_sparse_bwd: " + err);
  p.q = q.untyped_data(); p.k = k.untyped_data(); p.v = v.untyped_data(); p.dout = d_o.untyped_data();
  p.lse_delta = lse_delta.typed_data();
  p.q_num = q_num.typed_data(); p.q_idx = q_idx.typed_data();
  p.full_num = full_num.typed_data(); p.full_idx = full_idx.typed_data();
  const bool ids = q_words.element_count() > 0;
  p.q_words = ids ? static_cast<const int32_t*>(q_words.untyped_data()) : nullptr;
  p.kv_words = ids ? static_cast<const int32_t*>(kv_words.untyped_data()) : nullptr;
  p.bits = bits.element_count() > 0 ? static_cast<const int32_t*>(bits.untyped_data()) : nullptr;
  p.dv_add = dv_add.element_count() > 0 ? dv_add.typed_data() : nullptr;
  p.order = order.typed_data();
  p.dq_acc = dq_acc->typed_data(); p.dk = dk->untyped_data(); p.dv = dv->untyped_data();
  p.scale = scale; p.causal = causal; p.s_kv_real = s_kv_real;
  cudaError_t z = cudaMemsetAsync(p.dq_acc, 0, dq_acc->size_bytes(), stream);
  if (z != cudaSuccess)
    return ffi::Error::Internal(std::string("fusedattn_block_sparse_bwd: ") + cudaGetErrorString(z));
  switch (q.element_type()) {
    case ffi::DataType::BF16: err = launch<cutlass::bfloat16_t>(stream, p); break;
    case ffi::DataType::F16: err = launch<cutlass::half_t>(stream, p); break;
    default: err = "q must be bfloat16 or float16";   // (check() refused it already)
  }
  return err.empty() ? ffi::Error::Success() : ffi::Error::Internal("fusedattn_block_sparse_bwd: " + err);
}

}  // namespace
}  // namespace fusedattn::block_sparse

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnBlockSparseBwd, ::fusedattn::block_sparse::bwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()              // q
                                  .Arg<ffi::AnyBuffer>()              // k
                                  .Arg<ffi::AnyBuffer>()              // v
                                  .Arg<ffi::AnyBuffer>()              // do
                                  .Arg<ffi::Buffer<ffi::F32>>()       // lse_delta
                                  .Arg<ffi::Buffer<ffi::S32>>()       // q_num_blocks
                                  .Arg<ffi::Buffer<ffi::S32>>()       // q_indices
                                  .Arg<ffi::Buffer<ffi::S32>>()       // full_q_num_blocks
                                  .Arg<ffi::Buffer<ffi::S32>>()       // full_q_indices
                                  .Arg<ffi::AnyBuffer>()              // q_words (empty: no ids)
                                  .Arg<ffi::AnyBuffer>()              // kv_words
                                  .Arg<ffi::AnyBuffer>()              // bits (empty: no dense mask)
                                  .Arg<ffi::Buffer<ffi::F32>>()       // dv_add (empty: none)
                                  .Arg<ffi::Buffer<ffi::S32>>()       // order
                                  .Ret<ffi::Buffer<ffi::F32>>()       // dq_acc
                                  .Ret<ffi::AnyBuffer>()              // dk
                                  .Ret<ffi::AnyBuffer>()              // dv
                                  .Attr<float>("scale")
                                  .Attr<bool>("causal")
                                  .Attr<int32_t>("s_kv_real"),
                              {ffi::Traits::kCmdBufferCompatible});

FUSEDATTN_MODULE_INIT(block_sparse_bwd) {
  pybind11::dict targets = m.attr("ffi_targets");
  targets["fusedattn_block_sparse_bwd"] = ::fusedattn::ffi_capsule(FusedattnBlockSparseBwd);
}
