// The graph cache: one entry per (cuDNN version, frontend version, device, kind,
// key), built on first use by exactly one thread; thread-safe.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

#include "cudnn_graph.h"

namespace fusedattn::cudnn_attn {

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

class GraphCache {
 public:
  static GraphCache& instance();

  // The entry for this key, built on first use by exactly one thread (any other
  // thread asking for it meanwhile waits for that build); thread-safe.
  std::shared_ptr<CachedGraph> get(int device, GraphKind kind, std::string_view key);

  size_t size();

 private:
  GraphCache();
  std::string prefix_;
  std::mutex mutex_;
  std::unordered_map<std::string, std::shared_ptr<CachedGraph>> entries_;
};

}  // namespace fusedattn::cudnn_attn
