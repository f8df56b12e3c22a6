// cuDNN fused attention (BF16/FP16) through XLA's typed FFI, built with
// cudnn-frontend's graph API.
//
// Three graphs per configuration: forward for inference (no statistics),
// forward for training (fp32 log-sum-exp written straight into a [b, h, s_q]
// buffer) and backward. They are built once per (device, cuDNN version,
// frontend version, kind, key) and cached; `check_support` builds them at trace
// time, so the handlers only look them up, bind pointers and launch on XLA's
// stream: no host synchronisation, no allocation. Workspace is an XLA output
// whose size Python learns from `check_support`.
#include <cuda_runtime.h>
#include <cudnn.h>
#include <dlfcn.h>

#include <cudnn_frontend.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cudnn_params.h"
#include "module_registry.h"
#include "xla/ffi/api/ffi.h"

// The frontend's dynamic loader resolves cuDNN symbols through this handle. The
// extension links libcudnn.so.9 (RPATH: the wheel jaxlib uses), so it is already
// loaded and this returns that very library: one libcudnn per process.
// Its CUDA runtime loader would take the first of libcudart.so.12 / .so.13 it can
// open; pin the major version these headers were compiled for (unless the user
// chose), since the two differ in struct layouts.
namespace cudnn_frontend {
void* cudnn_dlhandle = [] {
  const std::string cudart = "libcudart.so." + std::to_string(CUDART_VERSION / 1000);
  setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", cudart.c_str(), /*overwrite=*/0);
  void* h = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_NOLOAD);
  return h ? h : dlopen("libcudnn.so.9", RTLD_NOW);
}();
}  // namespace cudnn_frontend

namespace fusedattn::cudnn_attn {
namespace {

namespace fe = cudnn_frontend;
namespace ffi = xla::ffi;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

enum class GraphKind { kForwardInference = 0, kForwardTraining = 1, kBackward = 2 };

// Fixed tensor uids: the handlers bind device pointers by these.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kBias, kSeqQ, kSeqKV,
  kRaggedQ, kRaggedK, kRaggedV, kRaggedO, kRaggedStats,
  kSeed, kOffset, kSink, kdO, kdQ, kdK, kdV, kdBias, kdSink,
};

// ---- handles: one per (device, thread) ----------------------------------------
// Deliberately never destroyed: they live as long as the process, and
// destroying them at thread exit could run after the CUDA runtime shut down.
cudnnHandle_t handle_for(int device, std::string* error) {
  thread_local std::unordered_map<int, cudnnHandle_t> handles;
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cudnnHandle_t handle = nullptr;
  cudnnStatus_t status = cudnnCreate(&handle);
  if (status != CUDNN_STATUS_SUCCESS) {
    *error = std::string("cudnnCreate failed: ") + cudnnGetErrorString(status);
    return nullptr;
  }
  handles.emplace(device, handle);
  return handle;
}

// ---- graph construction ----------------------------------------------------------
TensorPtr add_tensor(fe::graph::Graph& g, const char* name, Uid uid,
                     const TensorGeometry& geom, fe::DataType_t type) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name).set_uid(uid)
                      .set_dim(geom.dims).set_stride(geom.strides)
                      .set_data_type(type));
}

TensorPtr add_index_tensor(fe::graph::Graph& g, const char* name, Uid uid, int64_t n) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name).set_uid(uid)
                      .set_dim({n, 1, 1, 1}).set_stride({1, 1, 1, 1})
                      .set_data_type(fe::DataType_t::INT32));
}

// Tensors both directions share, declared identically for forward and backward.
struct CommonTensors {
  TensorPtr q, k, v, o, stats, bias, seq_q, seq_kv, seed, offset, sink;
};

CommonTensors declare_common(fe::graph::Graph& g, const AttnParams& p, bool with_stats,
                             bool o_is_input) {
  const auto io = p.bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF;
  CommonTensors t;
  t.q = add_tensor(g, "Q", kQ, q_geometry(p), io);
  t.k = add_tensor(g, "K", kK, k_geometry(p), io);
  t.v = add_tensor(g, "V", kV, v_geometry(p), io);
  if (o_is_input) t.o = add_tensor(g, "O", kO, o_geometry(p), io);
  if (o_is_input && with_stats)
    t.stats = add_tensor(g, "Stats", kStats, stats_geometry(p), fe::DataType_t::FLOAT);
  if (p.has_bias()) t.bias = add_tensor(g, "Bias", kBias, bias_geometry(p), io);
  if (p.has_seq_lens()) {
    t.seq_q = add_index_tensor(g, "seq_q", kSeqQ, p.batch());
    t.seq_kv = add_index_tensor(g, "seq_kv", kSeqKV, p.batch());
  }
  if (p.packed()) {
    const int64_t n = p.batch() + 1;
    t.q->set_ragged_offset(add_index_tensor(g, "ragged_q", kRaggedQ, n));
    t.k->set_ragged_offset(add_index_tensor(g, "ragged_k", kRaggedK, n));
    t.v->set_ragged_offset(add_index_tensor(g, "ragged_v", kRaggedV, n));
    if (t.o) t.o->set_ragged_offset(add_index_tensor(g, "ragged_o", kRaggedO, n));
    if (t.stats) t.stats->set_ragged_offset(add_index_tensor(g, "ragged_stats", kRaggedStats, n));
  }
  if (p.has_dropout()) {
    // 64-bit Philox seed and offset, read on the device (Python passes 2 x u32 each).
    TensorGeometry scalar{{1, 1, 1, 1}, {1, 1, 1, 1}, 0};
    t.seed = add_tensor(g, "seed", kSeed, scalar, fe::DataType_t::INT64);
    t.offset = add_tensor(g, "offset", kOffset, scalar, fe::DataType_t::INT64);
  }
  if (p.has_sink()) {
    TensorGeometry sink{{1, p.hq, 1, 1}, {p.hq, 1, 1, 1}, 0};
    t.sink = add_tensor(g, "sink", kSink, sink, fe::DataType_t::FLOAT);
  }
  return t;
}

// Masking, padding, dropout and sink options are the same on both sides.
template <typename Attrs>
void set_common_options(Attrs& a, const AttnParams& p, const CommonTensors& t) {
  a.set_attn_scale(p.scale);
  if (p.mask != Mask::kNone) {
    a.set_diagonal_alignment(p.mask == Mask::kCausalBottomRight
                                 ? fe::DiagonalAlignment_t::BOTTOM_RIGHT
                                 : fe::DiagonalAlignment_t::TOP_LEFT);
  }
  // Our window (left, right) counts keys beside the diagonal; cuDNN's left bound
  // counts the diagonal itself (keys j > i - left_bound).
  if (p.window_left >= 0) a.set_diagonal_band_left_bound(static_cast<int>(p.window_left + 1));
  if (p.window_right >= 0) a.set_diagonal_band_right_bound(static_cast<int>(p.window_right));
  if (p.window_left >= 0 && p.mask == Mask::kNone)
    a.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT);
  if (t.bias) a.set_bias(t.bias);
  if (p.has_seq_lens()) {
    a.set_padding_mask(true).set_seq_len_q(t.seq_q).set_seq_len_kv(t.seq_kv);
  }
  if (p.packed()) {
    a.set_max_total_seq_len_q(p.b * p.sq).set_max_total_seq_len_kv(p.b * p.skv);
  }
  if (p.has_dropout()) a.set_dropout(p.dropout, t.seed, t.offset);
  if (t.sink) a.set_sink_token(t.sink);
}

void set_output(const TensorPtr& t, const char* name, Uid uid, const TensorGeometry& geom,
                fe::DataType_t type) {
  t->set_output(true).set_name(name).set_uid(uid).set_dim(geom.dims)
      .set_stride(geom.strides).set_data_type(type);
}

std::shared_ptr<fe::graph::Graph> make_graph(const AttnParams& p, GraphKind kind) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(p.bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const auto io = p.bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF;
  if (kind != GraphKind::kBackward) {
    const bool training = kind == GraphKind::kForwardTraining;
    CommonTensors t = declare_common(*g, p, /*with_stats=*/false, /*o_is_input=*/false);
    auto attrs = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(training);
    set_common_options(attrs, p, t);
    auto [o, stats] = g->sdpa(t.q, t.k, t.v, attrs);
    set_output(o, "O", kO, o_geometry(p), io);
    if (p.packed()) o->set_ragged_offset(add_index_tensor(*g, "ragged_o", kRaggedO, p.batch() + 1));
    if (training) {
      set_output(stats, "Stats", kStats, stats_geometry(p), fe::DataType_t::FLOAT);
      if (p.packed())
        stats->set_ragged_offset(add_index_tensor(*g, "ragged_stats", kRaggedStats, p.batch() + 1));
    }
    return g;
  }
  CommonTensors t = declare_common(*g, p, /*with_stats=*/true, /*o_is_input=*/true);
  auto d_o = add_tensor(*g, "dO", kdO, o_geometry(p), io);
  if (p.packed()) d_o->set_ragged_offset(t.o->get_ragged_offset());
  auto attrs = fe::graph::SDPA_backward_attributes().set_name("sdpa_backward")
                   .set_deterministic_algorithm(p.deterministic);
  set_common_options(attrs, p, t);
  TensorPtr d_bias, d_sink;
  if (p.has_bias()) {
    d_bias = g->tensor(fe::graph::Tensor_attributes().set_name("dBias").set_uid(kdBias)
                           .set_dim(bias_geometry(p).dims).set_stride(bias_geometry(p).strides)
                           .set_data_type(io));
    attrs.set_dbias(d_bias);
  }
  if (p.learnable_sink()) {
    d_sink = g->tensor(fe::graph::Tensor_attributes().set_name("dSink").set_uid(kdSink)
                           .set_dim({1, p.hq, 1, 1}).set_stride({p.hq, 1, 1, 1})
                           .set_data_type(fe::DataType_t::FLOAT));
    attrs.set_dsink_token(d_sink);
  }
  auto [dq, dk, dv] = g->sdpa_backward(t.q, t.k, t.v, t.o, d_o, t.stats, attrs);
  set_output(dq, "dQ", kdQ, q_geometry(p), io);
  set_output(dk, "dK", kdK, k_geometry(p), io);
  set_output(dv, "dV", kdV, v_geometry(p), io);
  if (p.packed()) {
    dq->set_ragged_offset(t.q->get_ragged_offset());
    dk->set_ragged_offset(t.k->get_ragged_offset());
    dv->set_ragged_offset(t.v->get_ragged_offset());
  }
  if (d_bias) d_bias->set_output(true);
  if (d_sink) d_sink->set_output(true);
  return g;
}

// ---- the cache ---------------------------------------------------------------------
struct CachedGraph {
  std::mutex build_mutex;
  bool built = false;
  std::shared_ptr<fe::graph::Graph> graph;  // null when the build failed
  std::string error;                        // cudnn-frontend's message
  int64_t workspace = 0;
  double build_seconds = 0;
};

const char* kind_name(GraphKind kind) {
  switch (kind) {
    case GraphKind::kForwardInference: return "forward (inference)";
    case GraphKind::kForwardTraining: return "forward (training)";
    default: return "backward";
  }
}

std::string build_graph(CachedGraph& entry, std::string_view key, GraphKind kind, int device) {
  AttnParams p;
  try {
    p = parse_params(key);
  } catch (const std::exception& e) {
    return e.what();
  }
  std::string error;
  cudnnHandle_t handle = handle_for(device, &error);
  if (!handle) return error;
  std::shared_ptr<fe::graph::Graph> g;
  try {
    g = make_graph(p, kind);
  } catch (const std::exception& e) {
    return std::string("graph construction: ") + e.what();
  }
  auto check = [](fe::error_t status, const char* step) -> std::string {
    if (status.is_good()) return {};
    return std::string(step) + ": " + status.get_message();
  };
  std::string msg = check(g->validate(), "validate");
  if (msg.empty()) msg = check(g->build_operation_graph(handle), "build_operation_graph");
  if (msg.empty()) msg = check(g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}),
                               "create_execution_plans");
  if (msg.empty()) msg = check(g->check_support(), "check_support");
  if (msg.empty()) msg = check(g->build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), "build_plans");
  if (!msg.empty()) return msg;
  int64_t workspace = 0;
  msg = check(g->get_workspace_size(workspace), "get_workspace_size");
  if (!msg.empty()) return msg;
  entry.graph = std::move(g);
  entry.workspace = workspace;
  return {};
}

class GraphCache {
 public:
  static GraphCache& instance() {
    static GraphCache* cache = new GraphCache();  // outlives every handler call
    return *cache;
  }

  // The entry for this key, built on first use (by exactly one thread).
  std::shared_ptr<CachedGraph> get(int device, GraphKind kind, std::string_view key) {
    std::string full = prefix_ + std::to_string(device) + "|" +
                       std::to_string(static_cast<int>(kind)) + "|" + std::string(key);
    std::shared_ptr<CachedGraph> entry;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& slot = entries_[full];
      if (!slot) slot = std::make_shared<CachedGraph>();
      entry = slot;
    }
    std::lock_guard<std::mutex> lock(entry->build_mutex);
    if (!entry->built) {
      auto t0 = std::chrono::steady_clock::now();
      entry->error = build_graph(*entry, key, kind, device);
      if (!entry->error.empty())
        entry->error = std::string(kind_name(kind)) + " graph: " + entry->error;
      entry->build_seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      entry->built = true;
    }
    return entry;
  }

  size_t size() {
    std::lock_guard<std::mutex> lock(mutex_);
    return entries_.size();
  }

 private:
  GraphCache()
      : prefix_("cudnn" + std::to_string(cudnnGetVersion()) + "|fe" +
                std::to_string(CUDNN_FRONTEND_VERSION) + "|") {}
  std::string prefix_;
  std::mutex mutex_;
  std::unordered_map<std::string, std::shared_ptr<CachedGraph>> entries_;
};

// ---- FFI handlers ---------------------------------------------------------------------
ffi::Error ffi_error(std::string msg) {
  return ffi::Error(ffi::ErrorCode::kInternal, "fusedattn cuDNN attention: " + std::move(msg));
}

// Walks RemainingArgs / RemainingRets in the order Python lays them out.
template <typename Remaining>
class Cursor {
 public:
  explicit Cursor(const Remaining& r) : r_(r) {}
  // ErrorOr<T> for arguments, ErrorOr<Result<T>> for results.
  template <typename T>
  auto next() { return r_.template get<T>(i_++); }
  size_t used() const { return i_; }
 private:
  const Remaining& r_;
  size_t i_ = 0;
};

void* byte_offset(void* base, int64_t elements, size_t element_bytes) {
  return static_cast<char*>(base) + elements * static_cast<int64_t>(element_bytes);
}

struct Bindings {
  std::unordered_map<int64_t, void*> pointers;
  std::vector<std::pair<void*, size_t>> zero_first;  // outputs padding leaves unwritten
};

// Inputs shared by both directions: auxiliaries after the main tensors.
ffi::Error bind_aux_inputs(const AttnParams& p, Cursor<ffi::RemainingArgs>& args, Bindings& b,
                           bool with_bias_first) {
  auto bind = [&](Uid uid) -> ffi::Error {
    auto buf = args.next<ffi::AnyBuffer>();
    if (buf.has_error()) return buf.error();
    b.pointers[uid] = buf->untyped_data();
    return ffi::Error::Success();
  };
  if (with_bias_first && p.has_bias())
    if (auto e = bind(kBias); e.failure()) return e;
  if (p.has_seq_lens()) {
    for (Uid u : {kSeqQ, kSeqKV})
      if (auto e = bind(u); e.failure()) return e;
  }
  if (p.packed()) {
    for (Uid u : {kRaggedQ, kRaggedK, kRaggedV, kRaggedO, kRaggedStats})
      if (auto e = bind(u); e.failure()) return e;
  }
  if (p.has_dropout()) {
    for (Uid u : {kSeed, kOffset})
      if (auto e = bind(u); e.failure()) return e;
  }
  if (p.has_sink())
    if (auto e = bind(kSink); e.failure()) return e;
  return ffi::Error::Success();
}

// q, k, v from one, two or three buffers, at the offsets the packing implies.
ffi::Error bind_qkv(const AttnParams& p, Cursor<ffi::RemainingArgs>& args, Bindings& b) {
  auto q = args.next<ffi::AnyBuffer>();
  if (q.has_error()) return q.error();
  const size_t es = 2;  // bf16 / fp16
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

ffi::Error run_graph(cudaStream_t stream, int device, GraphKind kind, std::string_view key,
                     Bindings& b, ffi::Result<ffi::AnyBuffer> workspace) {
  auto entry = GraphCache::instance().get(device, kind, key);
  if (!entry->graph) return ffi_error(entry->error);
  if (static_cast<int64_t>(workspace->size_bytes()) < entry->workspace)
    return ffi_error("workspace of " + std::to_string(workspace->size_bytes()) +
                     " bytes is smaller than the " + std::to_string(entry->workspace) +
                     " the graph needs (was the call lowered without a support check?)");
  std::string error;
  cudnnHandle_t handle = handle_for(device, &error);
  if (!handle) return ffi_error(error);
  if (cudnnStatus_t s = cudnnSetStream(handle, stream); s != CUDNN_STATUS_SUCCESS)
    return ffi_error(std::string("cudnnSetStream: ") + cudnnGetErrorString(s));
  for (auto [ptr, bytes] : b.zero_first)
    if (cudaError_t e = cudaMemsetAsync(ptr, 0, bytes, stream); e != cudaSuccess)
      return ffi_error(std::string("cudaMemsetAsync: ") + cudaGetErrorString(e));
  auto status = entry->graph->execute(handle, b.pointers, workspace->untyped_data());
  if (status.is_bad()) return ffi_error("execute: " + status.get_message());
  return ffi::Error::Success();
}

ffi::Error check_all_used(size_t used, size_t given, const char* what) {
  if (used == given) return ffi::Error::Success();
  return ffi_error(std::string("expected ") + std::to_string(used) + " " + what + ", got " +
                   std::to_string(given));
}

ffi::Error forward_impl(cudaStream_t stream, int32_t device, std::string_view key,
                        int64_t training, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  AttnParams p;
  try {
    p = parse_params(key);
  } catch (const std::exception& e) {
    return ffi_error(e.what());
  }
  Bindings b;
  Cursor<ffi::RemainingArgs> in(args);
  if (auto e = bind_qkv(p, in, b); e.failure()) return e;
  if (auto e = bind_aux_inputs(p, in, b, /*with_bias_first=*/true); e.failure()) return e;
  if (auto e = check_all_used(in.used(), args.size(), "inputs"); e.failure()) return e;

  Cursor<ffi::RemainingRets> out(rets);
  auto o = out.next<ffi::AnyBuffer>();
  if (o.has_error()) return o.error();
  b.pointers[kO] = (*o)->untyped_data();
  if (p.has_seq_lens()) b.zero_first.emplace_back((*o)->untyped_data(), (*o)->size_bytes());
  if (training) {
    auto stats = out.next<ffi::AnyBuffer>();
    if (stats.has_error()) return stats.error();
    b.pointers[kStats] = (*stats)->untyped_data();
  }
  auto workspace = out.next<ffi::AnyBuffer>();
  if (workspace.has_error()) return workspace.error();
  if (auto e = check_all_used(out.used(), rets.size(), "outputs"); e.failure()) return e;
  return run_graph(stream, device,
                   training ? GraphKind::kForwardTraining : GraphKind::kForwardInference, key, b,
                   *workspace);
}

ffi::Error backward_impl(cudaStream_t stream, int32_t device, std::string_view key,
                         ffi::RemainingArgs args, ffi::RemainingRets rets) {
  AttnParams p;
  try {
    p = parse_params(key);
  } catch (const std::exception& e) {
    return ffi_error(e.what());
  }
  Bindings b;
  Cursor<ffi::RemainingArgs> in(args);
  if (auto e = bind_qkv(p, in, b); e.failure()) return e;
  for (Uid u : {kO, kdO, kStats}) {
    auto buf = in.next<ffi::AnyBuffer>();
    if (buf.has_error()) return buf.error();
    b.pointers[u] = buf->untyped_data();
  }
  if (auto e = bind_aux_inputs(p, in, b, /*with_bias_first=*/true); e.failure()) return e;
  if (auto e = check_all_used(in.used(), args.size(), "inputs"); e.failure()) return e;

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
  auto workspace = out.next<ffi::AnyBuffer>();
  if (workspace.has_error()) return workspace.error();
  if (auto e = check_all_used(out.used(), rets.size(), "outputs"); e.failure()) return e;
  return run_graph(stream, device, GraphKind::kBackward, key, b, *workspace);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnAttentionForward, forward_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<std::string_view>("key")
                                  .Attr<int64_t>("training")
                                  .RemainingArgs()
                                  .RemainingRets(),
                              // No host sync, no allocation: XLA may capture it in CUDA graphs.
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnAttentionBackward, backward_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<std::string_view>("key")
                                  .RemainingArgs()
                                  .RemainingRets(),
                              // No host sync, no allocation: XLA may capture it in CUDA graphs.
                              {ffi::Traits::kCmdBufferCompatible});

// ---- Python side -------------------------------------------------------------------------
namespace py = pybind11;

// Builds (or finds) the three graphs of `key` on the current device.
py::dict check_support(const std::string& key) {
  py::dict result;
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) {
    result["ok"] = false;
    result["message"] = std::string("no CUDA device: ") + cudaGetErrorString(e);
    return result;
  }
  std::string message;
  py::dict workspace, build_seconds;
  {
    py::gil_scoped_release release;  // building can take a while; let other threads run
    for (GraphKind kind : {GraphKind::kForwardInference, GraphKind::kForwardTraining,
                           GraphKind::kBackward}) {
      auto entry = GraphCache::instance().get(device, kind, key);
      py::gil_scoped_acquire acquire;
      const char* name = kind == GraphKind::kBackward ? "backward"
                         : kind == GraphKind::kForwardTraining ? "forward_training"
                                                               : "forward_inference";
      build_seconds[name] = entry->build_seconds;
      if (!entry->graph) {
        message = entry->error;
        break;
      }
      workspace[name] = entry->workspace;
    }
  }
  result["ok"] = message.empty();
  result["message"] = message;
  result["workspace"] = workspace;
  result["build_seconds"] = build_seconds;
  result["device"] = device;
  return result;
}

std::string loaded_library_path() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&cudnnGetVersion), &info) && info.dli_fname)
    return info.dli_fname;
  return "";
}

py::dict versions() {
  py::dict v;
  v["cudnn_runtime"] = static_cast<int64_t>(cudnnGetVersion());
  v["cudnn_compiled"] = static_cast<int64_t>(CUDNN_VERSION);
  v["cudnn_frontend"] = static_cast<int64_t>(CUDNN_FRONTEND_VERSION);
  v["cudart_compiled"] = static_cast<int64_t>(CUDART_VERSION);
  v["cudnn_library"] = loaded_library_path();
  return v;
}

FUSEDATTN_MODULE_INIT(cudnn_attention) {
  py::dict targets = m.attr("ffi_targets");
  targets["fusedattn_cudnn_fwd"] = ffi_capsule(CudnnAttentionForward);
  targets["fusedattn_cudnn_bwd"] = ffi_capsule(CudnnAttentionBackward);
  m.def("cudnn_check_support", &check_support, py::arg("key"),
        "Build (or find cached) the forward and backward cuDNN graphs of a config key; "
        "returns {ok, message, workspace, build_seconds, device}.");
  m.def("cudnn_versions", &versions, "cuDNN runtime/compiled, cudnn-frontend and CUDA versions.");
  m.def("cudnn_cache_size", []() { return GraphCache::instance().size(); },
        "Number of cached cuDNN graphs (all devices and kinds).");
}

}  // namespace
}  // namespace fusedattn::cudnn_attn
