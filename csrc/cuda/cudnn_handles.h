// cuDNN handles: a scope on a device, and a pool of handles per device that graph
// builds and FFI calls check out for their own duration.
#pragma once

#include <cuda_runtime.h>
#include <cudnn.h>

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace fusedattn::cudnn_attn {

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
inline bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}

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

}  // namespace fusedattn::cudnn_attn
