// cuDNN fused attention (BF16/FP16) through XLA's typed FFI, built with
// cudnn-frontend's graph API.
//
// Three graphs per configuration: forward for inference (no statistics),
// forward for training (fp32 log-sum-exp written straight into a [b, h, s_q]
// buffer) and backward. They are built once per (device, cuDNN version,
// frontend version, kind, key) and cached; `check_support` builds the three at
// once (one thread each) at trace time, so the handlers only look them up, bind
// pointers and launch on XLA's stream: no host synchronisation, no device
// allocation. Workspace is an XLA output whose size Python learns from
// `check_support`.
//
// Built-in score_mods: ALiBi goes through the frontend's ALiBi mask, soft-capping
// through its score_mod hook (see `make_graph`). ALiBi's slopes reach the device
// as a host-to-device copy the frontend issues on every execute; graphs with
// such copies run through FFI targets that do not declare XLA's command-buffer
// trait (see the handlers below).
#include <cuda_runtime.h>
#include <cudnn.h>
#include <dlfcn.h>

#include <cudnn_frontend.h>

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "capture_stats.h"
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

// ---- the current device --------------------------------------------------------
// Makes `device` the calling thread's current device for a scope (cudnnCreate and
// the frontend's graph validation read it), and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device)
      switched_ = cudaSetDevice(device) == cudaSuccess;
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  bool switched_ = false;
};

// A failed query counts as "no" and is cleared, so it cannot surface later as
// somebody else's error.
bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}

// ---- handles: a pool per device ----------------------------------------------------
// A cuDNN handle is tied to the device current at cudnnCreate and must not be used
// by two threads at once (two cudnnSetStream calls on one handle would race). Each
// device keeps a pool of idle handles; a graph build or an FFI call checks one out
// for its own duration and gives it back, so no handle is ever shared, and the
// number of handles is the peak concurrency on that device, not the number of
// threads that ever ran (graph builds run on short-lived threads). Handles are
// never destroyed: they live as long as the process (destroying them at exit could
// run after the CUDA runtime shut down).
class HandlePool {
 public:
  static HandlePool& of(int device) {
    static std::mutex* mutex = new std::mutex();
    static auto* pools = new std::map<int, std::unique_ptr<HandlePool>>();  // never freed
    std::lock_guard<std::mutex> lock(*mutex);
    auto& slot = (*pools)[device];
    if (!slot) slot.reset(new HandlePool(device));
    return *slot;
  }

  // An idle handle, else a new one. `stream` (may be null) is the stream the
  // caller is about to run on: while it is being captured into a CUDA graph no
  // handle is created here (cudnnCreate allocates device memory, which capture
  // forbids) as long as one exists; the caller waits for a handle to come back.
  // Every checkout is short (an execute, or one graph build at trace time) and
  // none is nested in another, so the wait ends.
  cudnnHandle_t acquire(cudaStream_t stream, std::string* error) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (idle_.empty() && created_ > 0 && stream != nullptr && stream_is_capturing(stream))
      returned_.wait(lock, [this] { return !idle_.empty(); });
    if (!idle_.empty()) {
      cudnnHandle_t handle = idle_.back();
      idle_.pop_back();
      return handle;
    }
    ++created_;
    idle_.reserve(created_);  // give-backs never allocate
    lock.unlock();
    cudnnHandle_t handle = nullptr;
    cudnnStatus_t status;
    {
      DeviceGuard on_device(device_);
      status = cudnnCreate(&handle);
    }
    if (status != CUDNN_STATUS_SUCCESS) {
      lock.lock();
      --created_;
      *error = std::string("cudnnCreate failed on device ") + std::to_string(device_) + ": " +
               cudnnGetErrorString(status);
      return nullptr;
    }
    return handle;
  }

  void release(cudnnHandle_t handle) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      idle_.push_back(handle);
    }
    returned_.notify_one();
  }

  int created() {
    std::lock_guard<std::mutex> lock(mutex_);
    return created_;
  }

 private:
  explicit HandlePool(int device) : device_(device) {}
  const int device_;
  std::mutex mutex_;
  std::condition_variable returned_;
  std::vector<cudnnHandle_t> idle_;
  int created_ = 0;
};

// A handle checked out of its device's pool for the lifetime of this object.
class HandleLease {
 public:
  HandleLease(int device, cudaStream_t stream) : pool_(HandlePool::of(device)) {
    handle_ = pool_.acquire(stream, &error_);
  }
  ~HandleLease() {
    if (handle_) pool_.release(handle_);
  }
  HandleLease(const HandleLease&) = delete;
  HandleLease& operator=(const HandleLease&) = delete;
  cudnnHandle_t get() const { return handle_; }
  const std::string& error() const { return error_; }

 private:
  HandlePool& pool_;
  cudnnHandle_t handle_ = nullptr;
  std::string error_;
};

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
  // ALiBi: the frontend adds slope[h] * (kv index - q index) after the bias, with
  // its own slopes for the hq query heads (detail::get_alibi_slope, which
  // fusedattn.score_mods.alibi_slopes reproduces). It needs the right bound 0
  // (causal, top-left); it copies the slopes from host memory into the workspace
  // on every execute.
  if (p.alibi) a.set_alibi_mask(true);
}

// Soft-capping, cap * tanh(s / cap) on the scaled logits, through the frontend's
// score_mod hook and its Softcap functor (utils/attn_score_modifiers.h). The
// frontend applies a score_mod before the bias and allows no mask, window or
// padding with it (Python refuses those configs). The backward graph recomputes
// the scores with the same functor object (score_mod) before applying its
// derivative (score_mod_bprop), which reuses the tanh input the recompute made.
struct SoftcapMod {
  std::shared_ptr<fe::graph::attn::score_modifiers::Softcap> functor =
      std::make_shared<fe::graph::attn::score_modifiers::Softcap>();
  TensorPtr cap;  // a pass-by-value fp32 scalar of the graph

  SoftcapMod(fe::graph::Graph& g, float value) : cap(g.tensor(fe::graph::Tensor_attributes(value))) {}

  auto forward() const {
    return [functor = functor, cap = cap](std::shared_ptr<fe::graph::Graph> sub, TensorPtr score) {
      return functor->forward(std::move(sub), std::move(score), cap);
    };
  }
  auto backward() const {
    return [functor = functor, cap = cap](std::shared_ptr<fe::graph::Graph> sub, TensorPtr d_score) {
      return functor->backward(std::move(sub), std::move(d_score), cap);
    };
  }
};

void set_output(const TensorPtr& t, const char* name, Uid uid, const TensorGeometry& geom,
                fe::DataType_t type) {
  t->set_output(true).set_name(name).set_uid(uid).set_dim(geom.dims)
      .set_stride(geom.strides).set_data_type(type);
}

// `sm_version` > 0 fixes the target architecture instead of asking the current
// device (`cudnn_validate_graphs` checks graphs on a machine without a GPU).
std::shared_ptr<fe::graph::Graph> make_graph(const AttnParams& p, GraphKind kind,
                                             int sm_version = 0) {
  auto g = std::make_shared<fe::graph::Graph>();
  if (sm_version > 0) g->set_sm_version(sm_version);  // before any node copies the context
  g->set_io_data_type(p.bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const auto io = p.bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF;
  if (kind != GraphKind::kBackward) {
    const bool training = kind == GraphKind::kForwardTraining;
    CommonTensors t = declare_common(*g, p, /*with_stats=*/false, /*o_is_input=*/false);
    auto attrs = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(training);
    set_common_options(attrs, p, t);
    if (p.has_softcap()) attrs.set_score_mod(SoftcapMod(*g, p.softcap).forward());
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
  if (p.has_softcap()) {
    SoftcapMod softcap(*g, p.softcap);
    attrs.set_score_mod(softcap.forward()).set_score_mod_bprop(softcap.backward());
  }
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
  // execute() makes the frontend issue copies into the workspace (ALiBi slopes
  // from host memory): not for XLA command buffers, see the handlers.
  bool host_copies = false;
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
  DeviceGuard on_device(device);  // the frontend validates against the current device
  HandleLease handle(device, /*stream=*/nullptr);
  if (!handle.get()) return handle.error();
  // A pooled handle keeps the stream of the call that used it last (maybe XLA's,
  // maybe being captured right now): builds get the default stream, as a fresh
  // handle has.
  if (cudnnStatus_t s = cudnnSetStream(handle.get(), nullptr); s != CUDNN_STATUS_SUCCESS)
    return std::string("cudnnSetStream: ") + cudnnGetErrorString(s);
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
  if (msg.empty()) msg = check(g->build_operation_graph(handle.get()), "build_operation_graph");
  if (msg.empty()) msg = check(g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}),
                               "create_execution_plans");
  if (msg.empty()) msg = check(g->check_support(), "check_support");
  if (msg.empty()) msg = check(g->build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), "build_plans");
  if (!msg.empty()) return msg;
  int64_t workspace = 0;
  msg = check(g->get_workspace_size(workspace), "get_workspace_size");
  if (!msg.empty()) return msg;
  // True when execute() adds frontend copies (host-to-device, or memsets on old
  // cuDNN) in front of the cuDNN plan; for these SDPA graphs: the ALiBi slopes.
  entry.host_copies = !g->cuda_graph_direct_population_eligible();
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

  // The entry for this key, built on first use by exactly one thread (any other
  // thread asking for it meanwhile waits for that build); thread-safe.
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

// The FFI target a call came through (see the handler definitions below).
enum class Target { kCommandBuffer, kPlain };

ffi::Error run_graph(cudaStream_t stream, int device, GraphKind kind, std::string_view key,
                     Bindings& b, ffi::Result<ffi::AnyBuffer> workspace, Target target) {
  auto entry = GraphCache::instance().get(device, kind, key);
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

ffi::Error check_all_used(size_t used, size_t given, const char* what) {
  if (used == given) return ffi::Error::Success();
  return ffi_error(std::string("expected ") + std::to_string(used) + " " + what + ", got " +
                   std::to_string(given));
}

ffi::Error forward_impl(cudaStream_t stream, int32_t device, std::string_view key,
                        int64_t training, ffi::RemainingArgs args, ffi::RemainingRets rets,
                        Target target) {
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
                   *workspace, target);
}

ffi::Error backward_impl(cudaStream_t stream, int32_t device, std::string_view key,
                         ffi::RemainingArgs args, ffi::RemainingRets rets, Target target) {
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
  return run_graph(stream, device, GraphKind::kBackward, key, b, *workspace, target);
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

// ---- Python side -------------------------------------------------------------------------
namespace py = pybind11;

constexpr std::array<GraphKind, 3> kKinds = {GraphKind::kForwardInference,
                                              GraphKind::kForwardTraining, GraphKind::kBackward};

const char* kind_key(GraphKind kind) {
  switch (kind) {
    case GraphKind::kForwardInference: return "forward_inference";
    case GraphKind::kForwardTraining: return "forward_training";
    default: return "backward";
  }
}

// The three graphs of `key` on `device`, built at once: the calling thread builds
// one, a thread of its own each builds the other two (handles come from the
// device's pool, so these short-lived threads leave nothing behind). The cache
// still lets exactly one thread build an entry: a second probe of the same key
// waits for the first one's builds. Returns when all three are done.
std::array<std::shared_ptr<CachedGraph>, 3> get_all(int device, const std::string& key) {
  auto build = [device, &key](GraphKind kind) {
    return GraphCache::instance().get(device, kind, key);
  };
  std::array<std::future<std::shared_ptr<CachedGraph>>, 2> others;
  for (size_t i = 0; i < others.size(); ++i) {
    const GraphKind kind = kKinds[i + 1];
    try {
      others[i] = std::async(std::launch::async, build, kind);
    } catch (const std::system_error&) {  // no thread to be had: build it here, in turn
      others[i] = std::async(std::launch::deferred, build, kind);
    }
  }
  // (A future from std::async joins its thread when destroyed, so an exception
  // thrown below still waits for the other builds before it leaves.)
  std::array<std::shared_ptr<CachedGraph>, 3> entries;
  entries[0] = build(kKinds[0]);
  for (size_t i = 0; i < others.size(); ++i) entries[i + 1] = others[i].get();
  return entries;
}

// Builds (or finds) the three graphs of `key` on the current device.
py::dict check_support(const std::string& key) {
  py::dict result;
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) {
    result["ok"] = false;
    result["message"] = std::string("no CUDA device: ") + cudaGetErrorString(e);
    return result;
  }
  std::array<std::shared_ptr<CachedGraph>, 3> entries;
  double wall_seconds = 0;
  {
    py::gil_scoped_release release;  // building takes a while; let other threads run
    const auto t0 = std::chrono::steady_clock::now();
    entries = get_all(device, key);
    wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  std::string message;
  py::dict workspace, build_seconds, host_copies;
  for (size_t i = 0; i < kKinds.size(); ++i) {
    const char* name = kind_key(kKinds[i]);
    const auto& entry = entries[i];
    build_seconds[name] = entry->build_seconds;
    if (!entry->graph) {
      if (message.empty()) message = entry->error;  // the first failing kind, in order
      continue;
    }
    workspace[name] = entry->workspace;
    host_copies[name] = entry->host_copies;
  }
  result["ok"] = message.empty();
  result["message"] = message;
  result["workspace"] = workspace;
  result["build_seconds"] = build_seconds;  // per graph, when it was built
  result["wall_seconds"] = wall_seconds;    // this call: the three at once, or cache hits
  result["host_copies"] = host_copies;
  result["device"] = device;
  return result;
}

// Builds the three graphs of `key` for an SM version and runs only the frontend's
// validation (its support-surface checks): no device, no handle, no cuDNN plan.
// A graph that passes can still be refused later by cuDNN's heuristics or plan
// build on a real device; one that fails here fails there with the same message.
py::dict validate_graphs(const std::string& key, int sm_version) {
  py::dict result;
  AttnParams p;
  try {
    p = parse_params(key);
  } catch (const std::exception& e) {
    for (GraphKind kind : kKinds) result[kind_key(kind)] = std::string(e.what());
    return result;
  }
  for (GraphKind kind : kKinds) {
    std::string message;
    try {
      auto g = make_graph(p, kind, sm_version);
      auto status = g->validate();
      if (status.is_bad()) message = "validate: " + status.get_message();
    } catch (const std::exception& e) {
      message = std::string("graph construction: ") + e.what();
    }
    result[kind_key(kind)] = message;
  }
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
  targets["fusedattn_cudnn_fwd_nocmdbuf"] = ffi_capsule(CudnnAttentionForwardPlain);
  targets["fusedattn_cudnn_bwd_nocmdbuf"] = ffi_capsule(CudnnAttentionBackwardPlain);
  m.def("cudnn_check_support", &check_support, py::arg("key"),
        "Build (or find cached) the three cuDNN graphs of a config key (inference and "
        "training forward, backward), concurrently; returns {ok, message, workspace, "
        "build_seconds (per graph), wall_seconds (this call), host_copies (per graph), "
        "device}.");
  m.def("cudnn_versions", &versions, "cuDNN runtime/compiled, cudnn-frontend and CUDA versions.");
  m.def("cudnn_cache_size", []() { return GraphCache::instance().size(); },
        "Number of cached cuDNN graphs (all devices and kinds).");
  m.def("cudnn_validate_graphs", &validate_graphs, py::arg("key"), py::arg("sm_version"),
        "Frontend validation only (no GPU needed) of the three graphs of a key for an SM "
        "version; returns {graph: '' if valid else the frontend's message}.");
  m.def("cudnn_handle_count", [](int device) { return HandlePool::of(device).created(); },
        py::arg("device"),
        "Number of cuDNN handles created on a device: the peak number of concurrent builds "
        "and calls there, however many threads ran them.");
}

}  // namespace
}  // namespace fusedattn::cudnn_attn
