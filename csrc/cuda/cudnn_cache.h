// The graph cache: one entry per (cuDNN version, frontend version, device, kind,
// key), built on first use by exactly one thread; thread-safe and bounded (least
// recently used entries go first).
//
// An entry is built from scratch, or from a serialized execution plan that Python's
// persistent plan cache (fusedattn/plan_cache.py) hands in: deserializing skips
// cuDNN's heuristics and kernel compilation. A plan that fails to load is reported
// and the entry is built from scratch; a fresh build offers its serialized plan
// back for Python to store. A fresh build either takes the plan cuDNN's heuristics
// rank first or, autotuned, the fastest of all plans (cudnn_autotune.h); an
// entry built under autotuning (tuned, or loaded from a stored tuned plan) has its
// plan remembered past eviction, so a rebuild runs the same plan with the same
// workspace (a rebuild without it would take the heuristics' plan).
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "cudnn_autotune.h"
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
  // Built from a serialized plan (persistent cache hit).
  bool from_plan = false;
  // A fresh build's serialized plan, when the support probe asked for it (empty if
  // the frontend cannot serialize it), and what went wrong with a plan handed in or
  // with serializing, if anything.
  std::vector<uint8_t> plan;
  std::string plan_note;
  std::string plan_name;  // the plan execute() runs (cudnn-frontend's name)
  bool autotuned = false;
  TuneReport tuning;      // when autotuned
};

// How to build an entry that is not cached yet.
struct BuildRequest {
  std::vector<uint8_t> plan;  // a serialized plan to build from, if not empty
  bool offer_plan = false;    // a fresh build serializes its plan into the entry
  bool autotune = false;      // a fresh build times every plan (cudnn_autotune.h)
};

struct CacheStats {
  size_t entries = 0, capacity = 0;
  size_t builds = 0;        // entries built (from scratch or from a plan)
  size_t from_plans = 0;    // of those, from a serialized plan
  size_t hits = 0;          // lookups that found an entry
  size_t evictions = 0;
};

class GraphCache {
 public:
  static GraphCache& instance();

  // The entry for this key, built on first use by exactly one thread (any other
  // thread asking for it meanwhile waits for that build, whatever it requests);
  // thread-safe.
  std::shared_ptr<CachedGraph> get(int device, GraphKind kind, std::string_view key,
                                   const BuildRequest& request = {});

  // At most `capacity` entries (>= 1) stay cached; the least recently used go.
  // An evicted graph that a compiled program still calls is rebuilt on its next call.
  void set_capacity(size_t capacity);
  CacheStats stats();

 private:
  GraphCache();
  std::shared_ptr<CachedGraph> slot(std::string full_key);
  void evict_locked();

  struct Slot {
    std::shared_ptr<CachedGraph> entry;
    std::list<std::string>::iterator recency;
  };
  std::string prefix_;
  std::mutex mutex_;  // guards what follows
  std::unordered_map<std::string, Slot> entries_;
  std::list<std::string> recency_;  // most recently used first
  // The serialized plan of each entry built under autotuning (tuned, or loaded from a
  // stored tuned plan), kept past eviction; empty unless autotuning is on.
  std::unordered_map<std::string, std::vector<uint8_t>> kept_plans_;
  CacheStats stats_;
};

}  // namespace fusedattn::cudnn_attn
