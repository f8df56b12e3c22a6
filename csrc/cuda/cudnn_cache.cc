// The graph cache (see cudnn_cache.h): builds a graph with a pooled handle on its
// device and keeps it, with its workspace size and cudnn-frontend's message.
#include "cudnn_cache.h"

#include <chrono>
#include <exception>

#include <cudnn.h>

#include "cudnn_handles.h"

namespace fusedattn::cudnn_attn {
namespace {

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

}  // namespace

GraphCache& GraphCache::instance() {
  static GraphCache* cache = new GraphCache();  // outlives every handler call
  return *cache;
}

GraphCache::GraphCache()
    : prefix_("cudnn" + std::to_string(cudnnGetVersion()) + "|fe" +
              std::to_string(CUDNN_FRONTEND_VERSION) + "|") {}

std::shared_ptr<CachedGraph> GraphCache::get(int device, GraphKind kind, std::string_view key) {
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


size_t GraphCache::size() {
  std::lock_guard<std::mutex> lock(mutex_);
  return entries_.size();
}

}  // namespace fusedattn::cudnn_attn
