// The FFI handlers of FP8 cuDNN attention (graphs: cudnn_fp8_graph.cc).
//
//   forward  args: q, k, v (E4M3), [seq_q, seq_kv], scales [13, 4] fp32
//            rets: o (E4M3), [stats fp32 when training], amax [2, 4] (S, O), workspace
//   backward args: q, k, v, o (E4M3), dO, stats, [seq_q, seq_kv], scales
//            rets: dq, dk, dv, amax [4, 4] (dQ, dK, dV, dP), workspace
//
// Scales and amaxes are rows of one fp32 buffer each (kFp8Scales,
// kFp8ForwardAmaxes, kFp8BackwardAmaxes), read and written on the device: new
// scale values never rebuild a graph and never sync the host. FP8 graphs copy
// nothing from host memory, so both targets declare XLA's command-buffer trait.
#include <pybind11/pybind11.h>

#include "capture_stats.h"
#include "cudnn_ffi_common.h"
#include "cudnn_handles.h"
#include "module_registry.h"

namespace fusedattn::cudnn_attn {
namespace {

ffi::Error bind_scales(Cursor<ffi::RemainingArgs>& args, Bindings& b) {
  auto scales = args.next<ffi::AnyBuffer>();
  if (scales.has_error()) return scales.error();
  return bind_slots(scales->untyped_data(), scales->size_bytes(), kFp8Scales.data(),
                    kFp8Scales.size(), b);
}

template <size_t N>
ffi::Error bind_amaxes(Cursor<ffi::RemainingRets>& rets, const std::array<Uid, N>& uids,
                       Bindings& b) {
  auto amax = rets.next<ffi::AnyBuffer>();
  if (amax.has_error()) return amax.error();
  return bind_slots((*amax)->untyped_data(), (*amax)->size_bytes(), uids.data(), N, b);
}

ffi::Error check_fp8(const AttnParams& p) {
  if (!p.fp8) return ffi_error("an FP8 target got a key without fp8=1");
  if (p.packing != Packing::kSeparate || p.packed() || p.has_bias() || p.has_dropout() ||
      p.has_sink())
    return ffi_error("FP8 attention takes separate q, k, v with no bias, THD, dropout or sink");
  return ffi::Error::Success();
}

// Both directions: the common inputs, the scales, the outputs `bind_outputs` binds
// (everything but the workspace), then the graph.
template <typename BindOutputs>
ffi::Error fp8_call(cudaStream_t stream, int32_t device, std::string_view key, GraphKind kind,
                    ffi::RemainingArgs args, ffi::RemainingRets rets, BindOutputs bind_outputs) {
  AttnParams p;
  if (auto e = parse_key(key, p); e.failure()) return e;
  if (auto e = check_fp8(p); e.failure()) return e;
  Bindings b;
  Cursor<ffi::RemainingArgs> in(args);
  if (auto e = bind_inputs(p, kind, in, b); e.failure()) return e;
  if (auto e = bind_scales(in, b); e.failure()) return e;
  Cursor<ffi::RemainingRets> out(rets);
  if (auto e = bind_outputs(p, out, b); e.failure()) return e;
  return run_bound(stream, device, kind, key, b, in, out, Target::kCommandBuffer);
}

ffi::Error fp8_forward(cudaStream_t stream, int32_t device, std::string_view key,
                       int64_t training, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  static HandlerCounts& counts = HandlerCountRegistry::instance().counts("fusedattn_cudnn_fp8_fwd");
  note_call(counts, stream_is_capturing(stream));
  const GraphKind kind = training ? GraphKind::kForwardTraining : GraphKind::kForwardInference;
  return fp8_call(stream, device, key, kind, args, rets,
                  [training](const AttnParams& p, Cursor<ffi::RemainingRets>& out, Bindings& b) {
                    if (auto e = bind_output(p, out, b, kO); e.failure()) return e;
                    if (training)
                      if (auto e = bind_stats(out, b); e.failure()) return e;
                    return bind_amaxes(out, kFp8ForwardAmaxes, b);
                  });
}

ffi::Error fp8_backward(cudaStream_t stream, int32_t device, std::string_view key,
                        ffi::RemainingArgs args, ffi::RemainingRets rets) {
  static HandlerCounts& counts = HandlerCountRegistry::instance().counts("fusedattn_cudnn_fp8_bwd");
  note_call(counts, stream_is_capturing(stream));
  return fp8_call(stream, device, key, GraphKind::kBackward, args, rets,
                  [](const AttnParams& p, Cursor<ffi::RemainingRets>& out, Bindings& b) {
                    for (Uid u : {kdQ, kdK, kdV})
                      if (auto e = bind_output(p, out, b, u); e.failure()) return e;
                    return bind_amaxes(out, kFp8BackwardAmaxes, b);
                  });
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnFp8AttentionForward, fp8_forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<std::string_view>("key")
                                  .Attr<int64_t>("training")
                                  .RemainingArgs()
                                  .RemainingRets(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnFp8AttentionBackward, fp8_backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<std::string_view>("key")
                                  .RemainingArgs()
                                  .RemainingRets(),
                              {ffi::Traits::kCmdBufferCompatible});

FUSEDATTN_MODULE_INIT(cudnn_fp8_attention_ffi) {
  pybind11::dict targets = m.attr("ffi_targets");
  targets["fusedattn_cudnn_fp8_fwd"] = ffi_capsule(CudnnFp8AttentionForward);
  targets["fusedattn_cudnn_fp8_bwd"] = ffi_capsule(CudnnFp8AttentionBackward);
}

}  // namespace
}  // namespace fusedattn::cudnn_attn
