// The FFI handlers of cuDNN attention: bind XLA's buffers to the cached graph's
// tensor uids and execute it on XLA's stream (no host sync, no allocation).
#include <cuda_runtime.h>
#include <cudnn.h>

#include <future>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>

#include "capture_stats.h"
#include "cudnn_cache.h"
#include "cudnn_ffi_common.h"
#include "cudnn_handles.h"
#include "module_registry.h"

namespace fusedattn::cudnn_attn {

// ---- shared with the FP8 handlers (cudnn_ffi_common.h) ---------------------------
ffi::Error ffi_error(std::string msg) {
  return ffi::Error(ffi::ErrorCode::kInternal, "fusedattn cuDNN attention: " + std::move(msg));
}

ffi::Error parse_key(std::string_view key, AttnParams& p) {
  try {
    p = parse_params(key);
  } catch (const std::exception& e) {
    return ffi_error(e.what());
  }
  return ffi::Error::Success();
}

namespace {

ffi::Error bind_next(Cursor<ffi::RemainingArgs>& args, Bindings& b, Uid uid) {
  auto buf = args.next<ffi::AnyBuffer>();
  if (buf.has_error()) return buf.error();
  b.pointers[uid] = buf->untyped_data();
  return ffi::Error::Success();
}

ffi::Error bind_aux_inputs(const AttnParams& p, Cursor<ffi::RemainingArgs>& args, Bindings& b) {
  std::vector<Uid> uids;
  if (p.has_bias()) uids.push_back(kBias);
  if (p.has_seq_lens()) uids.insert(uids.end(), {kSeqQ, kSeqKV});
  if (p.packed()) uids.insert(uids.end(), {kRaggedQ, kRaggedK, kRaggedV, kRaggedO, kRaggedStats});
  if (p.has_dropout()) uids.insert(uids.end(), {kSeed, kOffset});
  if (p.has_sink()) uids.push_back(kSink);
  for (size_t i = 0; i < p.flex_input_count(); ++i) uids.push_back(static_cast<Uid>(kFlexInput + i));
  for (Uid u : uids)
    if (auto e = bind_next(args, b, u); e.failure()) return e;
  return ffi::Error::Success();
}

ffi::Error bind_qkv(const AttnParams& p, Cursor<ffi::RemainingArgs>& args, Bindings& b) {
  auto q = args.next<ffi::AnyBuffer>();
  if (q.has_error()) return q.error();
  const size_t es = p.element_bytes();
  b.pointers[kQ] = byte_offset(q->untyped_data(), q_geometry(p).pointer_offset, es);
  void* k_base = q->untyped_data();
  if (p.packing != Packing::kQKV) {
    auto k = args.next<ffi::AnyBuffer>();
    if (k.has_error()) return k.error();
    k_base = k->untyped_data();
  }
  b.pointers[kK] = byte_offset(k_base, k_geometry(p).pointer_offset, es);
  void* v_base = k_base;
  if (p.packing == Packing::kSeparate) {
    auto v = args.next<ffi::AnyBuffer>();
    if (v.has_error()) return v.error();
    v_base = v->untyped_data();
  }
  b.pointers[kV] = byte_offset(v_base, v_geometry(p).pointer_offset, es);
  return ffi::Error::Success();
}

ffi::Error check_all_used(size_t used, size_t given, const char* what) {
  if (used == given) return ffi::Error::Success();
  return ffi_error(std::string("expected ") + std::to_string(used) + " " + what + ", got " +
                   std::to_string(given));
}

}  // namespace

ffi::Error bind_inputs(const AttnParams& p, GraphKind kind, Cursor<ffi::RemainingArgs>& args,
                       Bindings& b) {
  if (auto e = bind_qkv(p, args, b); e.failure()) return e;
  if (kind == GraphKind::kBackward)
    for (Uid u : {kO, kdO, kStats})
      if (auto e = bind_next(args, b, u); e.failure()) return e;
  return bind_aux_inputs(p, args, b);
}

ffi::Error bind_output(const AttnParams& p, Cursor<ffi::RemainingRets>& rets, Bindings& b,
                       Uid uid) {
  auto out = rets.next<ffi::AnyBuffer>();
  if (out.has_error()) return out.error();
  b.pointers[uid] = (*out)->untyped_data();
  if (p.has_seq_lens()) b.zero_first.emplace_back((*out)->untyped_data(), (*out)->size_bytes());
  return ffi::Error::Success();
}

ffi::Error bind_stats(Cursor<ffi::RemainingRets>& rets, Bindings& b) {
  auto stats = rets.next<ffi::AnyBuffer>();
  if (stats.has_error()) return stats.error();
  b.pointers[kStats] = (*stats)->untyped_data();
  return ffi::Error::Success();
}

ffi::Error bind_slots(void* base, size_t size_bytes, const Uid* uids, size_t n, Bindings& b) {
  const size_t row = kFp8SlotFloats * sizeof(float);
  if (size_bytes < n * row)
    return ffi_error("FP8 scalar buffer of " + std::to_string(size_bytes) + " bytes, expected " +
                     std::to_string(n) + " rows of " + std::to_string(row));
  for (size_t i = 0; i < n; ++i) b.pointers[uids[i]] = static_cast<char*>(base) + i * row;
  return ffi::Error::Success();
}

namespace {

ffi::Error run_graph(cudaStream_t stream, int device, GraphKind kind, std::string_view key,
                     Bindings& b, ffi::Result<ffi::AnyBuffer> workspace, Target target) {
  auto lookup = [&] { return GraphCache::instance().get(device, kind, key); };
  // The probe built the graph at trace time, but the bounded cache may have evicted
  // it since: then it is rebuilt here. While XLA captures this stream into a command
  // buffer (thread-local capture mode) this thread must not make the CUDA calls a
  // build makes, so another thread looks it up.
  auto entry = stream_is_capturing(stream) ? std::async(std::launch::async, lookup).get()
                                           : lookup();
  if (!entry->graph) return ffi_error(entry->error);
  if (static_cast<int64_t>(workspace->size_bytes()) < entry->workspace)
    return ffi_error("workspace of " + std::to_string(workspace->size_bytes()) +
                     " bytes is smaller than the " + std::to_string(entry->workspace) +
                     " the graph needs (was the call lowered without a support check?)");
  if (entry->host_copies && target == Target::kCommandBuffer && stream_is_capturing(stream))
    return ffi_error(std::string(kind_name(kind)) +
                     " graph copies from host memory into its workspace on every execute "
                     "(ALiBi slopes), so it must not be captured into a command buffer; it "
                     "belongs to the fusedattn_cudnn_*_nocmdbuf targets, which the support "
                     "probe selects (was the call lowered without one?)");
  // A handle of our own for this call: cudnnSetStream on it races with nobody.
  HandleLease handle(device, stream);
  if (!handle.get()) return ffi_error(handle.error());
  if (cudnnStatus_t s = cudnnSetStream(handle.get(), stream); s != CUDNN_STATUS_SUCCESS)
    return ffi_error(std::string("cudnnSetStream: ") + cudnnGetErrorString(s));
  for (auto [ptr, bytes] : b.zero_first)
    if (cudaError_t e = cudaMemsetAsync(ptr, 0, bytes, stream); e != cudaSuccess)
      return ffi_error(std::string("cudaMemsetAsync: ") + cudaGetErrorString(e));
  auto status = entry->graph->execute(handle.get(), b.pointers, workspace->untyped_data());
  if (status.is_bad()) return ffi_error("execute: " + status.get_message());
  return ffi::Error::Success();
}

}  // namespace

ffi::Error run_bound(cudaStream_t stream, int device, GraphKind kind, std::string_view key,
                     Bindings& b, const Cursor<ffi::RemainingArgs>& args,
                     Cursor<ffi::RemainingRets>& rets, Target target) {
  if (auto e = check_all_used(args.used(), args.size(), "inputs"); e.failure()) return e;
  auto workspace = rets.next<ffi::AnyBuffer>();
  if (workspace.has_error()) return workspace.error();
  if (auto e = check_all_used(rets.used(), rets.size(), "outputs"); e.failure()) return e;
  return run_graph(stream, device, kind, key, b, *workspace, target);
}

namespace {

ffi::Error forward_impl(cudaStream_t stream, int32_t device, std::string_view key,
                        int64_t training, ffi::RemainingArgs args, ffi::RemainingRets rets,
                        Target target) {
  const GraphKind kind = training ? GraphKind::kForwardTraining : GraphKind::kForwardInference;
  AttnParams p;
  if (auto e = parse_key(key, p); e.failure()) return e;
  Bindings b;
  Cursor<ffi::RemainingArgs> in(args);
  if (auto e = bind_inputs(p, kind, in, b); e.failure()) return e;
  Cursor<ffi::RemainingRets> out(rets);
  if (auto e = bind_output(p, out, b, kO); e.failure()) return e;
  if (training)
    if (auto e = bind_stats(out, b); e.failure()) return e;
  return run_bound(stream, device, kind, key, b, in, out, target);
}

ffi::Error backward_impl(cudaStream_t stream, int32_t device, std::string_view key,
                         ffi::RemainingArgs args, ffi::RemainingRets rets, Target target) {
  AttnParams p;
  if (auto e = parse_key(key, p); e.failure()) return e;
  Bindings b;
  Cursor<ffi::RemainingArgs> in(args);
  if (auto e = bind_inputs(p, GraphKind::kBackward, in, b); e.failure()) return e;

  // Gradients mirror the input buffers (a packed qkv input gets a packed dqkv).
  Cursor<ffi::RemainingRets> out(rets);
  const int n_grads = p.packing == Packing::kQKV ? 1 : p.packing == Packing::kKV ? 2 : 3;
  std::vector<void*> grad_bases;
  for (int i = 0; i < n_grads; ++i) {
    auto g = out.next<ffi::AnyBuffer>();
    if (g.has_error()) return g.error();
    grad_bases.push_back((*g)->untyped_data());
    if (p.has_seq_lens()) b.zero_first.emplace_back((*g)->untyped_data(), (*g)->size_bytes());
  }
  void* dk_base = grad_bases[n_grads == 1 ? 0 : 1];
  void* dv_base = grad_bases[n_grads - 1];
  b.pointers[kdQ] = byte_offset(grad_bases[0], q_geometry(p).pointer_offset, 2);
  b.pointers[kdK] = byte_offset(dk_base, k_geometry(p).pointer_offset, 2);
  b.pointers[kdV] = byte_offset(dv_base, v_geometry(p).pointer_offset, 2);
  if (p.has_bias()) {
    auto g = out.next<ffi::AnyBuffer>();
    if (g.has_error()) return g.error();
    b.pointers[kdBias] = (*g)->untyped_data();
  }
  if (p.learnable_sink()) {
    auto g = out.next<ffi::AnyBuffer>();
    if (g.has_error()) return g.error();
    b.pointers[kdSink] = (*g)->untyped_data();
  }
  return run_bound(stream, device, GraphKind::kBackward, key, b, in, out, target);
}

// Two targets per direction.
//
// fusedattn_cudnn_fwd / _bwd declare XLA's command-buffer trait: XLA may capture
// them into CUDA graphs (stream capture of the handler, replayed later). That is
// sound for graphs whose execute() only binds pointers and launches cuDNN's plan
// (plus our memsets) on XLA's stream: no host synchronisation, no device
// allocation, and each call checks out a handle of its own.
//
// Graphs with ALiBi are not of that kind: the frontend's execute() first copies
// the slopes from pageable host memory (owned by the cached graph) into the
// workspace. Captured, that copy becomes a memcpy node that reads host memory on
// every replay. cudnn-frontend 1.32 does keep that host storage alive for CUDA
// graphs made by capture, and says that current drivers put such small pageable
// copies straight into the command stream; but whether a given driver accepts a
// pageable source in a captured graph, and copies it there without staging or
// waiting, is the driver's business, which we cannot check for every driver XLA
// runs on, and a CUDA graph replaying a host read is one more thing that has to
// stay alive. So graphs with such copies go through fusedattn_cudnn_fwd_nocmdbuf /
// _bwd_nocmdbuf, which do not declare the trait: XLA runs them as ordinary thunks
// (between command buffers), where the copy is a small cudaMemcpyAsync on XLA's
// stream, ordered with the kernel that reads it. Python picks the target from the
// support probe (`host_copies`); a command-buffer target that meets such a graph
// while being captured fails with that message instead of recording the copy.
template <Target kTarget>
ffi::Error forward_handler(cudaStream_t stream, int32_t device, std::string_view key,
                           int64_t training, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  static HandlerCounts& counts = HandlerCountRegistry::instance().counts(
      kTarget == Target::kCommandBuffer ? "fusedattn_cudnn_fwd" : "fusedattn_cudnn_fwd_nocmdbuf");
  note_call(counts, stream_is_capturing(stream));
  return forward_impl(stream, device, key, training, args, rets, kTarget);
}

template <Target kTarget>
ffi::Error backward_handler(cudaStream_t stream, int32_t device, std::string_view key,
                            ffi::RemainingArgs args, ffi::RemainingRets rets) {
  static HandlerCounts& counts = HandlerCountRegistry::instance().counts(
      kTarget == Target::kCommandBuffer ? "fusedattn_cudnn_bwd" : "fusedattn_cudnn_bwd_nocmdbuf");
  note_call(counts, stream_is_capturing(stream));
  return backward_impl(stream, device, key, args, rets, kTarget);
}

#define FUSEDATTN_FORWARD_BINDING                 \
  ffi::Ffi::Bind()                                \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()   \
      .Ctx<ffi::DeviceOrdinal>()                  \
      .Attr<std::string_view>("key")              \
      .Attr<int64_t>("training")                  \
      .RemainingArgs()                            \
      .RemainingRets()

#define FUSEDATTN_BACKWARD_BINDING                \
  ffi::Ffi::Bind()                                \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()   \
      .Ctx<ffi::DeviceOrdinal>()                  \
      .Attr<std::string_view>("key")              \
      .RemainingArgs()                            \
      .RemainingRets()

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnAttentionForward, forward_handler<Target::kCommandBuffer>,
                              FUSEDATTN_FORWARD_BINDING, {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnAttentionBackward, backward_handler<Target::kCommandBuffer>,
                              FUSEDATTN_BACKWARD_BINDING, {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnAttentionForwardPlain, forward_handler<Target::kPlain>,
                              FUSEDATTN_FORWARD_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnAttentionBackwardPlain, backward_handler<Target::kPlain>,
                              FUSEDATTN_BACKWARD_BINDING);

#undef FUSEDATTN_FORWARD_BINDING
#undef FUSEDATTN_BACKWARD_BINDING

FUSEDATTN_MODULE_INIT(cudnn_attention_ffi) {
  pybind11::dict targets = m.attr("ffi_targets");
  targets["fusedattn_cudnn_fwd"] = ffi_capsule(CudnnAttentionForward);
  targets["fusedattn_cudnn_bwd"] = ffi_capsule(CudnnAttentionBackward);
  targets["fusedattn_cudnn_fwd_nocmdbuf"] = ffi_capsule(CudnnAttentionForwardPlain);
  targets["fusedattn_cudnn_bwd_nocmdbuf"] = ffi_capsule(CudnnAttentionBackwardPlain);
}

}  // namespace
}  // namespace fusedattn::cudnn_attn
