// XLA FFI handlers for the small-seq kernels, shared by the CUDA and ROCm
// extensions (each includes this in one source file and registers the two
// handler symbols). Shapes are checked here; errors come back as FFI errors.
//
//   fwd(q, k, v, kv_index) -> (o, lse)          attrs: scale (f32), max_kv (i32)
//   bwd(q, k, v, o, lse, do, kv_index) -> (dq, dk, dv)   same attrs
// q, o, do: [n, 1, h_q, d]; k, v: [n, s_kv, h_kv, d] (padded, kv_index = kv
// lengths [n]) or [rows, h_kv, d] (packed, kv_index = offsets [n + 1]);
// lse: [n, h_q, 1] fp32.
#pragma once

#include <cstdint>
#include <string>

#include "capture_stats.h"
#include "small_seq_launch.cuh"
#include "vendor.h"
#include "xla/ffi/api/ffi.h"

namespace fusedattn::small_seq {

namespace ffi = ::xla::ffi;

struct Geometry {
  int64_t n = 0, kv_rows = 0;
  int h_q = 0, h_kv = 0, d = 0, s_kv = 0;
  bool packed = false;
  Dtype dtype = Dtype::kBf16;
};

inline std::string dims_str(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Reads and checks the shapes of q, k, v and kv_index; "" or the reason.
inline std::string read_geometry(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                 ffi::Buffer<ffi::S32> kv_index, int max_kv, Geometry& g) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (q.element_type() == ffi::DataType::BF16) g.dtype = Dtype::kBf16;
  else if (q.element_type() == ffi::DataType::F16) g.dtype = Dtype::kFp16;
  else return "q must be bfloat16 or float16";
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type())
    return "q, k, v must share one dtype";
  if (qd.size() != 4 || qd[1] != 1) return "q must be [n, 1, h_q, d], got " + dims_str(qd);
  g.n = qd[0];
  g.h_q = static_cast<int>(qd[2]);
  g.d = static_cast<int>(qd[3]);
  if (kd.size() != vd.size() || kd.size() < 3) return "k and v must both be padded or packed";
  for (size_t i = 0; i < kd.size(); ++i)
    if (kd[i] != vd[i]) return "k and v shapes differ: " + dims_str(kd) + " vs " + dims_str(vd);
  g.packed = kd.size() == 3;
  if (g.packed) {
    g.kv_rows = kd[0];
    g.s_kv = max_kv;
  } else {
    if (kd.size() != 4 || kd[0] != g.n) return "padded k must be [n, s_kv, h_kv, d], got " + dims_str(kd);
    g.s_kv = static_cast<int>(kd[1]);
    g.kv_rows = g.n * g.s_kv;
    if (g.s_kv > max_kv) return "s_kv exceeds max_kv";
  }
  g.h_kv = static_cast<int>(kd[kd.size() - 2]);
  if (kd[kd.size() - 1] != g.d) return "k head dim must equal q's";
  if (g.h_kv <= 0 || g.h_q % g.h_kv != 0) return "h_q must be a multiple of h_kv";
  const int64_t want_index = g.packed ? g.n + 1 : g.n;
  if (kv_index.element_count() != static_cast<size_t>(want_index))
    return "kv_index must have " + std::to_string(want_index) + " elements";
  return std::string();
}

inline Params make_params(const Geometry& g, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::Buffer<ffi::S32> kv_index, float scale) {
  Params p{};
  p.q = static_cast<const uint16_t*>(q.untyped_data());
  p.k = static_cast<const uint16_t*>(k.untyped_data());
  p.v = static_cast<const uint16_t*>(v.untyped_data());
  p.kv_index = kv_index.typed_data();
  p.n = g.n;
  p.h_q = g.h_q;
  p.h_kv = g.h_kv;
  p.s_kv = g.s_kv;
  p.kv_rows = g.kv_rows;
  p.packed = g.packed;
  p.scale = scale;
  return p;
}

inline ffi::Error small_seq_fwd(vendor::stream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                ffi::Buffer<ffi::S32> kv_index, ffi::Result<ffi::AnyBuffer> o,
                                ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale, int32_t max_kv) {
  static HandlerCounts& counts = HandlerCountRegistry::instance().counts("fusedattn_small_seq_fwd");
  note_call(counts, vendor::stream_is_capturing(stream));
  Geometry g;
  std::string err = read_geometry(q, k, v, kv_index, max_kv, g);
  if (err.empty() && (o->element_count() != q.element_count() || lse->element_count() != static_cast<size_t>(g.n * g.h_q)))
    err = "outputs o [n, 1, h_q, d] and lse [n, h_q, 1] have the wrong size";
  if (!err.empty()) return ffi::Error::InvalidArgument("fusedattn_small_seq_fwd: " + err);
  Params p = make_params(g, q, k, v, kv_index, scale);
  p.out = static_cast<uint16_t*>(o->untyped_data());
  p.lse_out = lse->typed_data();
  err = launch(stream, g.dtype, g.d, max_kv, p, /*backward=*/false);
  return err.empty() ? ffi::Error::Success() : ffi::Error::Internal("fusedattn_small_seq_fwd: " + err);
}

inline ffi::Error small_seq_bwd(vendor::stream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer d_o,
                                ffi::Buffer<ffi::S32> kv_index, ffi::Result<ffi::AnyBuffer> dq,
                                ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv, float scale,
                                int32_t max_kv) {
  static HandlerCounts& counts = HandlerCountRegistry::instance().counts("fusedattn_small_seq_bwd");
  note_call(counts, vendor::stream_is_capturing(stream));
  Geometry g;
  std::string err = read_geometry(q, k, v, kv_index, max_kv, g);
  if (err.empty() && (o.element_count() != q.element_count() || d_o.element_count() != q.element_count() ||
                      lse.element_count() != static_cast<size_t>(g.n * g.h_q)))
    err = "o, do must match q and lse must be [n, h_q, 1]";
  if (err.empty() && (o.element_type() != q.element_type() || d_o.element_type() != q.element_type()))
    err = "o and do must have q's dtype";
  if (err.empty() && (dq->element_count() != q.element_count() || dk->element_count() != k.element_count() ||
                      dv->element_count() != v.element_count()))
    err = "gradients must have the shapes of q, k, v";
  if (!err.empty()) return ffi::Error::InvalidArgument("fusedattn_small_seq_bwd: " + err);
  Params p = make_params(g, q, k, v, kv_index, scale);
  p.o = static_cast<const uint16_t*>(o.untyped_data());
  p.d_o = static_cast<const uint16_t*>(d_o.untyped_data());
  p.lse_in = lse.typed_data();
  p.out = static_cast<uint16_t*>(dq->untyped_data());
  p.dk = static_cast<uint16_t*>(dk->untyped_data());
  p.dv = static_cast<uint16_t*>(dv->untyped_data());
  err = launch(stream, g.dtype, g.d, max_kv, p, /*backward=*/true);
  return err.empty() ? ffi::Error::Success() : ffi::Error::Internal("fusedattn_small_seq_bwd: " + err);
}

}  // namespace fusedattn::small_seq

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnSmallSeqFwd, ::fusedattn::small_seq::small_seq_fwd,
                              ::xla::ffi::Ffi::Bind()
                                  .Ctx<::xla::ffi::PlatformStream<::fusedattn::vendor::stream_t>>()
                                  .Arg<::xla::ffi::AnyBuffer>()                     // q
                                  .Arg<::xla::ffi::AnyBuffer>()                     // k
                                  .Arg<::xla::ffi::AnyBuffer>()                     // v
                                  .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>()       // kv_index
                                  .Ret<::xla::ffi::AnyBuffer>()                     // o
                                  .Ret<::xla::ffi::Buffer<::xla::ffi::F32>>()       // lse
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("max_kv"),
                              // Kernel launches only: XLA may capture it in CUDA graphs.
                              {::xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnSmallSeqBwd, ::fusedattn::small_seq::small_seq_bwd,
                              ::xla::ffi::Ffi::Bind()
                                  .Ctx<::xla::ffi::PlatformStream<::fusedattn::vendor::stream_t>>()
                                  .Arg<::xla::ffi::AnyBuffer>()                     // q
                                  .Arg<::xla::ffi::AnyBuffer>()                     // k
                                  .Arg<::xla::ffi::AnyBuffer>()                     // v
                                  .Arg<::xla::ffi::AnyBuffer>()                     // o
                                  .Arg<::xla::ffi::Buffer<::xla::ffi::F32>>()       // lse
                                  .Arg<::xla::ffi::AnyBuffer>()                     // do
                                  .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>()       // kv_index
                                  .Ret<::xla::ffi::AnyBuffer>()                     // dq
                                  .Ret<::xla::ffi::AnyBuffer>()                     // dk
                                  .Ret<::xla::ffi::AnyBuffer>()                     // dv
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("max_kv"),
                              // Kernel launches only: XLA may capture it in CUDA graphs.
                              {::xla::ffi::Traits::kCmdBufferCompatible});
