// Plan autotuning (see cudnn_autotune.h): every plan of a graph built and timed on
// scratch buffers, the fastest kept.
#include "cudnn_autotune.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <random>
#include <unordered_map>
#include <vector>

namespace fusedattn::cudnn_attn {
namespace {

// A timed run this long is measured once; shorter ones up to kRuns times (the least
// counts), after kWarmups untimed runs. Enough to order plans whose times differ
// by a few percent.
constexpr float kLongRunMs = 20.f;
constexpr int kRuns = 5;
constexpr int kWarmups = 2;

// One tuning loop at a time in this process: the probe builds a config's three
// graphs on three threads, and plans timed side by side would share the GPU (seen:
// a forward timed at twice its time while a backward ran beside it).
std::mutex timing_mutex;

std::string cuda_message(const char* step, cudaError_t e) {
  (void)cudaGetLastError();
  return std::string(step) + ": " + cudaGetErrorString(e);
}

// Raw bits of a random value in +-[0.5, 1) of a tensor type: the kernels run on them
// as on real activations (all zeros would let the GPU clock higher than it does in
// training). Integer tensors (dropout seed and offset) stay zero.
uint32_t unit_bits(fe::DataType_t type, uint32_t r) {
  const uint32_t sign = r >> 31;
  switch (type) {
    case fe::DataType_t::BFLOAT16: return (sign << 15) | 0x3F00u | (r & 0x7Fu);
    case fe::DataType_t::HALF: return (sign << 15) | 0x3800u | (r & 0x3FFu);
    case fe::DataType_t::FLOAT: return (sign << 31) | 0x3F000000u | (r & 0x7FFFFFu);
    case fe::DataType_t::FP8_E4M3: return (sign << 7) | 0x30u | (r & 0x7u);
    case fe::DataType_t::FP8_E5M2: return (sign << 7) | 0x38u | (r & 0x3u);
    default: return 0;
  }
}

// Device buffers for every tensor a graph binds, freed on scope exit.
class Scratch {
 public:
  explicit Scratch(cudaStream_t stream) : stream_(stream) {}
  ~Scratch() {
    cudaStreamSynchronize(stream_);
    for (void* p : owned_) cudaFree(p);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  std::string alloc(size_t bytes, void*& ptr) {
    if (cudaError_t e = cudaMalloc(&ptr, std::max<size_t>(bytes, 16)); e != cudaSuccess)
      return cuda_message("cudaMalloc", e);
    owned_.push_back(ptr);
    return {};
  }

  // `bytes` of elements of `element_bytes` each, from `pattern` (one block of host
  // values, repeated by doubling device-to-device copies).
  std::string fill(void* ptr, size_t bytes, const std::vector<uint8_t>& pattern) {
    size_t done = std::min(bytes, pattern.size());
    if (cudaError_t e = cudaMemcpyAsync(ptr, pattern.data(), done, cudaMemcpyHostToDevice, stream_);
        e != cudaSuccess)
      return cuda_message("cudaMemcpyAsync", e);
    while (done < bytes) {
      const size_t n = std::min(done, bytes - done);
      char* base = static_cast<char*>(ptr);
      if (cudaError_t e = cudaMemcpyAsync(base + done, base, n, cudaMemcpyDeviceToDevice, stream_);
          e != cudaSuccess)
        return cuda_message("cudaMemcpyAsync", e);
      done += n;
    }
    // The host pattern must outlive the copy.
    if (cudaError_t e = cudaStreamSynchronize(stream_); e != cudaSuccess)
      return cuda_message("cudaStreamSynchronize", e);
    return {};
  }

 private:
  cudaStream_t stream_;
  std::vector<void*> owned_;
};

std::vector<uint8_t> pattern_of(fe::DataType_t type, size_t element_bytes, size_t elements,
                                std::mt19937& rng) {
  std::vector<uint8_t> out(element_bytes * elements);
  for (size_t i = 0; i < elements; ++i) {
    const uint32_t bits = unit_bits(type, static_cast<uint32_t>(rng()));
    std::memcpy(out.data() + i * element_bytes, &bits, std::min<size_t>(element_bytes, 4));
  }
  return out;
}

// Binds scratch buffers to every tensor uid the graph has: random values, sequence
// lengths at their maxima (a zero length would let kernels skip the work).
std::string bind_scratch(const fe::graph::Graph& g, const AttnParams& p, Scratch& scratch,
                         std::unordered_map<int64_t, void*>& pointers) {
  std::vector<int64_t> uids;
  for (int64_t u = kQ; u <= kAmaxDP; ++u) uids.push_back(u);
  for (size_t i = 0; i < p.flex_input_count(); ++i) uids.push_back(kFlexInput + i);
  std::mt19937 rng(12345);
  for (int64_t uid : uids) {
    fe::graph::Tensor_attributes t;
    if (g.query_tensor_attributes_of_uid(uid, t).is_bad() || t.get_is_pass_by_value()) continue;
    const auto dims = t.get_dim(), strides = t.get_stride();
    size_t elements = 1;
    for (size_t i = 0; i < dims.size() && i < strides.size(); ++i)
      elements += static_cast<size_t>((dims[i] - 1) * strides[i]);
    size_t element_bytes = fe::detail::get_data_type_size(t.get_data_type());
    if (element_bytes == 0) element_bytes = 4;
    void* ptr = nullptr;
    if (auto msg = scratch.alloc(elements * element_bytes, ptr); !msg.empty()) return msg;
    std::vector<uint8_t> pattern;
    if (uid == kSeqQ || uid == kSeqKV) {
      std::vector<int32_t> lengths(elements, static_cast<int32_t>(uid == kSeqQ ? p.sq : p.skv));
      pattern.resize(lengths.size() * sizeof(int32_t));
      std::memcpy(pattern.data(), lengths.data(), pattern.size());
    } else {
      pattern = pattern_of(t.get_data_type(), element_bytes,
                           std::min<size_t>(elements, (size_t{1} << 20) / element_bytes), rng);
    }
    if (auto msg = scratch.fill(ptr, elements * element_bytes, pattern); !msg.empty()) return msg;
    pointers[uid] = ptr;
  }
  return {};
}

struct Events {
  cudaEvent_t start = nullptr, stop = nullptr;
  ~Events() {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
  }
};

// The least of a few timed runs of plan `index` (after untimed ones), or a negative
// time with `error` set.
float time_plan(fe::graph::Graph& g, cudnnHandle_t handle,
                std::unordered_map<int64_t, void*>& pointers, void* workspace, int64_t index,
                cudaStream_t stream, Events& ev, std::string& error) {
  for (int run = 0; run < kWarmups; ++run) {
    auto status = g.execute_plan_at_index(handle, pointers, workspace, index);
    if (status.is_bad()) {
      error = status.get_message();
      return -1.f;
    }
  }
  float best = std::numeric_limits<float>::max();
  for (int run = 0; run < kRuns; ++run) {
    cudaEventRecord(ev.start, stream);
    auto status = g.execute_plan_at_index(handle, pointers, workspace, index);
    cudaEventRecord(ev.stop, stream);
    if (cudaError_t e = cudaEventSynchronize(ev.stop); e != cudaSuccess) {
      error = cuda_message("cudaEventSynchronize", e);
      return -1.f;
    }
    if (status.is_bad()) {
      error = status.get_message();
      return -1.f;
    }
    float ms = 0;
    cudaEventElapsedTime(&ms, ev.start, ev.stop);
    best = std::min(best, ms);
    if (ms > kLongRunMs) break;
  }
  return best;
}

// Times each built plan on scratch buffers, on a stream of our own (a build may run
// while another thread captures XLA's stream: nothing here may touch the legacy
// default stream). Sets report.note on failure; times[i] < 0 for untimed plans.
void time_plans(fe::graph::Graph& g, cudnnHandle_t handle, const AttnParams& p,
                const std::vector<int64_t>& built, std::vector<float>& times, TuneReport& report) {
  cudaStream_t stream = nullptr;
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
    report.note = cuda_message("cudaStreamCreate", e);
    return;
  }
  {
    Scratch scratch(stream);
    std::unordered_map<int64_t, void*> pointers;
    void* workspace = nullptr;
    Events ev;
    std::string msg = bind_scratch(g, p, scratch, pointers);
    if (msg.empty())
      msg = scratch.alloc(static_cast<size_t>(g.get_autotune_workspace_size()), workspace);
    if (msg.empty() && (cudaEventCreate(&ev.start) != cudaSuccess ||
                        cudaEventCreate(&ev.stop) != cudaSuccess))
      msg = cuda_message("cudaEventCreate", cudaGetLastError());
    if (msg.empty() && cudnnSetStream(handle, stream) != CUDNN_STATUS_SUCCESS)
      msg = "cudnnSetStream failed";
    std::unique_lock<std::mutex> one_at_a_time(timing_mutex, std::defer_lock);
    if (msg.empty()) one_at_a_time.lock();
    for (size_t i = 0; msg.empty() && i < built.size(); ++i) {
      std::string error;
      times[i] = time_plan(g, handle, pointers, workspace, built[i], stream, ev, error);
      if (times[i] < 0) report.note += "plan " + std::to_string(built[i]) + " not timed: " + error + "; ";
    }
    if (!msg.empty()) report.note = "not timed (" + msg + ")";
  }
  cudnnSetStream(handle, nullptr);
  cudaStreamDestroy(stream);
}

std::string plan_name(fe::graph::Graph& g, int64_t index) {
  std::string name;
  (void)g.get_plan_name_at_index(index, name);
  return name;
}

}  // namespace

std::string autotune(fe::graph::Graph& g, cudnnHandle_t handle, const AttnParams& p,
                     TuneReport& report) {
  if (p.packed()) {
    report.note = "not tuned: packed sequences (timing them needs real segment offsets)";
    auto status = g.build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE);
    return status.is_good() ? std::string() : "build_plans: " + status.get_message();
  }
  // Every plan that builds; the first of them is what the heuristics would have run.
  std::vector<int64_t> built;
  std::string first_error;
  for (int64_t i = 0; i < g.get_execution_plan_count(); ++i) {
    auto status = g.build_plan_at_index(i);
    if (status.is_good()) {
      built.push_back(i);
    } else if (first_error.empty()) {
      first_error = status.get_message();
    }
  }
  if (built.empty()) return "build_plans: " + (first_error.empty() ? "no plan" : first_error);
  report.heuristic = plan_name(g, built.front());
  int64_t best = built.front();
  if (built.size() > 1) {
    std::vector<float> times(built.size(), -1.f);
    time_plans(g, handle, p, built, times, report);
    float best_ms = std::numeric_limits<float>::max();
    for (size_t i = 0; i < built.size(); ++i) {
      if (times[i] < 0) continue;
      ++report.plans;
      if (times[i] < best_ms) best_ms = times[i], best = built[i];
    }
    report.heuristic_ms = std::max(times.front(), 0.f);
    report.chosen_ms = report.plans ? best_ms : 0.f;
  } else {
    report.note = "one plan: nothing to choose";
  }
  report.chosen = plan_name(g, best);
  // Building an index again only makes it the plan execute() and serialize() use.
  auto status = g.build_plan_at_index(best);
  return status.is_good() ? std::string() : "build_plan_at_index: " + status.get_message();
}

}  // namespace fusedattn::cudnn_attn
