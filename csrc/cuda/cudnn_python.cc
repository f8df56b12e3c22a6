// The Python side of cuDNN attention: support probes (the three graphs of a key,
// built concurrently), frontend-only validation, versions, cache and handle counts.
#include <cuda_runtime.h>
#include <cudnn.h>
#include <dlfcn.h>

#include <array>
#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <system_error>

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
