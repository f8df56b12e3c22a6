// The Python side of cuDNN attention: support probes (the three graphs of a key,
// built concurrently, from serialized plans where Python has them), frontend-only
// validation, versions, the device's identity, cache statistics and handle counts.
#include <cuda_runtime.h>
#include <cudnn.h>
#include <dlfcn.h>

#include <array>
#include <chrono>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cudnn_cache.h"
#include "cudnn_handles.h"
#include "module_registry.h"

namespace fusedattn::cudnn_attn {
namespace {

namespace py = pybind11;

// The three graphs of `key` on `device`, built at once: the calling thread builds
// one, a thread of its own each builds the other two (handles come from the
// device's pool, so these short-lived threads leave nothing behind). The cache
// still lets exactly one thread build an entry: a second probe of the same key
// waits for the first one's builds. Returns when all three are done.
std::array<std::shared_ptr<CachedGraph>, 3> get_all(int device, const std::string& key,
                                                     const std::array<BuildRequest, 3>& requests) {
  auto build = [device, &key, &requests](GraphKind kind) {
    return GraphCache::instance().get(device, kind, key, requests[static_cast<int>(kind)]);
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

// What autotuning found for a graph, for Python.
py::dict tuning_dict(const TuneReport& r) {
  py::dict d;
  d["plans"] = r.plans;
  d["chosen"] = r.chosen;
  d["chosen_ms"] = r.chosen_ms;
  d["heuristic"] = r.heuristic;
  d["heuristic_ms"] = r.heuristic_ms;
  d["note"] = r.note;
  return d;
}

// Builds (or finds) the three graphs of `key` on the current device; `plans` maps a
// graph name ("forward_inference", ...) to a serialized plan to build it from; with
// `autotune`, a graph built from scratch runs the fastest of its plans.
py::dict check_support(const std::string& key, const py::dict& plans, bool autotune) {
  py::dict result;
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) {
    result["ok"] = false;
    result["message"] = std::string("no CUDA device: ") + cudaGetErrorString(e);
    return result;
  }
  std::array<BuildRequest, 3> requests;
  for (size_t i = 0; i < kKinds.size(); ++i) {
    const char* name = kind_key(kKinds[i]);
    if (plans.contains(name)) {
      std::string bytes = plans[name].cast<py::bytes>();
      requests[i].plan.assign(bytes.begin(), bytes.end());
    }
    requests[i].offer_plan = true;
    requests[i].autotune = autotune;
  }
  std::array<std::shared_ptr<CachedGraph>, 3> entries;
  double wall_seconds = 0;
  {
    py::gil_scoped_release release;  // building takes a while; let other threads run
    const auto t0 = std::chrono::steady_clock::now();
    entries = get_all(device, key, requests);
    wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  std::string message;
  py::dict workspace, build_seconds, host_copies, from_plan, new_plans, plan_notes, plan_names,
      tuning;
  for (size_t i = 0; i < kKinds.size(); ++i) {
    const char* name = kind_key(kKinds[i]);
    const auto& entry = entries[i];
    build_seconds[name] = entry->build_seconds;
    from_plan[name] = entry->from_plan;
    plan_names[name] = entry->plan_name;
    if (entry->autotuned) tuning[name] = tuning_dict(entry->tuning);
    std::vector<uint8_t> plan;
    {
      std::lock_guard<std::mutex> lock(entry->build_mutex);
      plan.swap(entry->plan);  // handed to the first probe that asks, then freed here
      if (!entry->plan_note.empty()) plan_notes[name] = entry->plan_note;
    }
    if (!plan.empty())
      new_plans[name] = py::bytes(reinterpret_cast<const char*>(plan.data()), plan.size());
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
  result["from_plan"] = from_plan;    // per graph: built from a plan handed in
  result["plans"] = new_plans;        // per graph: a fresh build's serialized plan
  result["plan_notes"] = plan_notes;  // per graph: a plan not used, or not serializable
  result["plan_names"] = plan_names;  // per graph: the plan its execute runs
  result["tuning"] = tuning;          // per autotuned graph: what timing its plans found
  result["device"] = device;
  return result;
}

// What a stored plan is only valid for: the GPU model and its compute capability.
py::dict device_identity() {
  py::dict result;
  int device = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return result;
  }
  result["name"] = std::string(prop.name);
  result["sm"] = prop.major * 10 + prop.minor;
  result["multiprocessors"] = prop.multiProcessorCount;
  return result;
}

py::dict cache_stats() {
  CacheStats s = GraphCache::instance().stats();
  py::dict d;
  d["entries"] = s.entries;
  d["capacity"] = s.capacity;
  d["builds"] = s.builds;
  d["from_plans"] = s.from_plans;
  d["hits"] = s.hits;
  d["evictions"] = s.evictions;
  return d;
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
  m.def("cudnn_check_support", &check_support, py::arg("key"), py::arg("plans") = py::dict(),
        py::arg("autotune") = false,
        "Build (or find cached) the three cuDNN graphs of a config key (inference and "
        "training forward, backward), concurrently, from the serialized plans given per "
        "graph where they load, else (with autotune) from the fastest of all plans; returns "
        "{ok, message, workspace, build_seconds (per graph), wall_seconds (this call), "
        "host_copies, from_plan, plans (fresh builds' serialized plans), plan_notes, "
        "plan_names, tuning (per autotuned graph: plans, chosen, chosen_ms, heuristic, "
        "heuristic_ms, note), device}.");
  m.def("cudnn_device_identity", &device_identity,
        "The current device's {name, sm, multiprocessors} (what a stored plan is valid for).");
  m.def("cudnn_cache_stats", &cache_stats,
        "Graph cache counters: {entries, capacity, builds, from_plans, hits, evictions}.");
  m.def("cudnn_set_cache_capacity",
        [](size_t n) { GraphCache::instance().set_capacity(n); }, py::arg("capacity"),
        "Bound the graph cache to `capacity` entries (least recently used go first).");
  m.def("cudnn_versions", &versions, "cuDNN runtime/compiled, cudnn-frontend and CUDA versions.");
  m.def("cudnn_cache_size", []() { return GraphCache::instance().stats().entries; },
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
