// Per FFI handler: how many calls ran, and how many of them ran while the
// stream was being captured into a CUDA / HIP graph (XLA's command buffers
// record a custom call by capturing it once, then replay the graph without
// calling the handler). This is how tests observe that XLA did capture our
// handlers. Host code only (no vendor header): each handler asks its runtime
// whether the stream is capturing (one call, no synchronisation).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace fusedattn {

struct HandlerCounts {
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> captured{0};
};

class HandlerCountRegistry {
 public:
  static HandlerCountRegistry& instance() {
    static HandlerCountRegistry* registry = new HandlerCountRegistry();  // outlives every call
    return *registry;
  }

  // The counters of `name`, created on first use; the reference stays valid.
  HandlerCounts& counts(const std::string& name) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = index_.find(name);
    if (it != index_.end()) return *it->second;
    HandlerCounts& c = storage_.emplace_back();
    index_.emplace(name, &c);
    return c;
  }

  // name -> (calls, captured calls)
  std::map<std::string, std::pair<int64_t, int64_t>> snapshot() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::map<std::string, std::pair<int64_t, int64_t>> out;
    for (const auto& [name, c] : index_) out[name] = {c->calls.load(), c->captured.load()};
    return out;
  }

 private:
  std::mutex mutex_;
  std::deque<HandlerCounts> storage_;  // deque: growing never moves an element
  std::map<std::string, HandlerCounts*> index_;
};

// Call at the top of a handler: `static HandlerCounts& c = ...counts("name");
// note_call(c, vendor::stream_is_capturing(stream));`.
inline void note_call(HandlerCounts& counts, bool capturing) {
  counts.calls.fetch_add(1, std::memory_order_relaxed);
  if (capturing) counts.captured.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace fusedattn
