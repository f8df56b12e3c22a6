// The graph cache (see cudnn_cache.h): builds a graph with a pooled handle on its
// device, from scratch or from a serialized plan, and keeps it, with its workspace
// size and cudnn-frontend's message, in a bounded LRU map.
#include "cudnn_cache.h"

#include <chrono>
#include <exception>

#include <cuda_runtime.h>
#include <cudnn.h>

#include "cudnn_handles.h"

namespace fusedattn::cudnn_attn {
namespace {

// Entries kept by default: 3 graphs each for about 340 configs. Python may change it
// (fusedattn.plan_cache.set_graph_cache_size, or FUSEDATTN_GRAPH_CACHE_SIZE).
constexpr size_t kDefaultCapacity = 1024;

std::string check(fe::error_t status, const char* step) {
  if (status.is_good()) return {};
  return std::string(step) + ": " + status.get_message();
}

// What a built graph tells the handlers: its workspace, and whether execute() adds
// frontend copies (host-to-device, or memsets on old cuDNN) in front of the cuDNN
// plan; for these SDPA graphs: the ALiBi slopes.
std::string finish(CachedGraph& entry, std::shared_ptr<fe::graph::Graph> g) {
  int64_t workspace = 0;
  std::string msg = check(g->get_workspace_size(workspace), "get_workspace_size");
  if (!msg.empty()) return msg;
  entry.host_copies = !g->cuda_graph_direct_population_eligible();
  entry.graph = std::move(g);
  entry.workspace = workspace;
  return {};
}

// A fresh graph holding a serialized plan.
std::string deserialize(std::shared_ptr<fe::graph::Graph>& g, cudnnHandle_t handle,
                        const std::vector<uint8_t>& plan) {
  g = std::make_shared<fe::graph::Graph>();
  try {
    // No frontend warmup: it captures the plan into a throwaway CUDA graph, and a
    // capture begun here while XLA captures a command buffer on another thread
    // invalidates XLA's (cudaErrorStreamCaptureInvalidated in the next jitted call;
    // docs/decisions.md); it also failed outright for some plans (d64 causal, cuDNN 9.19).
    // A freshly built graph gets no warmup either.
    return check(g->deserialize(handle, plan, /*enforce_precompiled=*/false, /*warmup=*/false),
                 "deserialize");
  } catch (const std::exception& e) {  // the JSON parser throws on malformed data
    return std::string("deserialize: ") + e.what();
  }
}

// A graph from a serialized plan: no heuristics query, no kernel compilation. Any
// failure (a stale or corrupt plan) is a note, and the caller builds from scratch.
bool load_plan(CachedGraph& entry, cudnnHandle_t handle, const std::vector<uint8_t>& plan) {
  std::shared_ptr<fe::graph::Graph> g;
  std::string msg = deserialize(g, handle, plan);
  if (msg.empty()) (void)g->get_plan_name(entry.plan_name);
  if (msg.empty()) msg = finish(entry, std::move(g));
  if (!msg.empty()) {
    entry.plan_note = "stored plan not used (" + msg + "); built from scratch";
    return false;
  }
  entry.from_plan = true;
  return true;
}

std::string build_graph(CachedGraph& entry, std::string_view key, GraphKind kind, int device,
                        const BuildRequest& request) {
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
  if (!request.plan.empty() && load_plan(entry, handle.get(), request.plan)) return {};
  std::shared_ptr<fe::graph::Graph> g;
  try {
    g = make_graph(p, kind);
  } catch (const std::exception& e) {
    return std::string("graph construction: ") + e.what();
  }
  std::string msg = check(g->validate(), "validate");
  if (msg.empty()) msg = check(g->build_operation_graph(handle.get()), "build_operation_graph");
  if (msg.empty()) msg = check(g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}),
                               "create_execution_plans");
  // The graph asks cuDNN for a deterministic backward; plans that still say they are
  // not deterministic are not candidates (heuristics' or autotuning's).
  if (msg.empty() && p.deterministic)
    g->deselect_numeric_notes({fe::NumericalNote_t::NONDETERMINISTIC});
  if (msg.empty()) msg = check(g->check_support(), "check_support");
  if (msg.empty() && request.autotune) {
    msg = autotune(*g, handle.get(), p, entry.tuning);
    entry.autotuned = msg.empty();
  } else if (msg.empty()) {
    msg = check(g->build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), "build_plans");
  }
  if (!msg.empty()) return msg;
  (void)g->get_plan_name(entry.plan_name);
  // Plan only (no graph structure): what load_plan reads back. An autotuned plan is
  // always kept, for a rebuild after eviction.
  if (request.offer_plan || entry.autotuned) {
    std::string serialize_msg;
    try {
      serialize_msg = check(g->serialize(entry.plan, /*serialize_structure=*/false), "serialize");
    } catch (const std::exception& e) {
      serialize_msg = std::string("serialize: ") + e.what();
    }
    if (!serialize_msg.empty()) {
      entry.plan.clear();
      entry.plan_note += (entry.plan_note.empty() ? "" : "; ") + serialize_msg;
    }
  }
  return finish(entry, std::move(g));
}

}  // namespace

GraphCache& GraphCache::instance() {
  static GraphCache* cache = new GraphCache();  // outlives every handler call
  return *cache;
}

GraphCache::GraphCache()
    : prefix_("cudnn" + std::to_string(cudnnGetVersion()) + "|fe" +
              std::to_string(CUDNN_FRONTEND_VERSION) + "|") {
  stats_.capacity = kDefaultCapacity;
}

std::shared_ptr<CachedGraph> GraphCache::slot(std::string full_key) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = entries_.find(full_key);
  if (found != entries_.end()) {
    ++stats_.hits;
    recency_.splice(recency_.begin(), recency_, found->second.recency);
    return found->second.entry;
  }
  recency_.push_front(full_key);
  auto entry = std::make_shared<CachedGraph>();
  entries_.emplace(std::move(full_key), Slot{entry, recency_.begin()});
  evict_locked();
  return entry;
}

void GraphCache::evict_locked() {
  // An evicted entry lives on in whoever holds it (a build in progress, a handler).
  while (entries_.size() > stats_.capacity) {
    entries_.erase(recency_.back());
    recency_.pop_back();
    ++stats_.evictions;
  }
}

std::shared_ptr<CachedGraph> GraphCache::get(int device, GraphKind kind, std::string_view key,
                                             const BuildRequest& request) {
  std::string full_key = prefix_ + std::to_string(device) + "|" +
                         std::to_string(static_cast<int>(kind)) + "|" + std::string(key);
  auto entry = slot(full_key);
  std::lock_guard<std::mutex> lock(entry->build_mutex);
  if (!entry->built) {
    const BuildRequest* use = &request;
    BuildRequest remembered;
    if (request.plan.empty()) {  // an evicted entry: the plan it ran before
      std::lock_guard<std::mutex> map_lock(mutex_);
      auto found = kept_plans_.find(full_key);
      if (found != kept_plans_.end()) {
        remembered = request;
        remembered.plan = found->second;
        use = &remembered;
      }
    }
    auto t0 = std::chrono::steady_clock::now();
    entry->error = build_graph(*entry, key, kind, device, *use);
    if (!entry->error.empty())
      entry->error = std::string(kind_name(kind)) + " graph: " + entry->error;
    entry->build_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    entry->built = true;
    std::lock_guard<std::mutex> stats_lock(mutex_);
    ++stats_.builds;
    if (entry->from_plan) ++stats_.from_plans;
    // Under autotuning, the plan may not be the heuristics' one: keep it, tuned here
    // or loaded (a tuned plan stored by an earlier process).
    if (use->autotune && entry->autotuned && !entry->plan.empty())
      kept_plans_[full_key] = entry->plan;
    else if (use->autotune && entry->from_plan)
      kept_plans_[full_key] = use->plan;
  }
  return entry;
}

void GraphCache::set_capacity(size_t capacity) {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.capacity = capacity < 1 ? 1 : capacity;
  evict_locked();
}

CacheStats GraphCache::stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  CacheStats s = stats_;
  s.entries = entries_.size();
  return s;
}

}  // namespace fusedattn::cudnn_attn
