// What the FFI handlers of cuDNN attention share (cudnn_ffi.cc for BF16/FP16,
// cudnn_fp8_ffi.cc for FP8): walking XLA's argument / result lists, binding
// buffers to the graphs' tensor uids, and running a cached graph on XLA's stream
// (no host sync, no allocation).
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cudnn_graph.h"
#include "xla/ffi/api/ffi.h"

namespace fusedattn::cudnn_attn {

namespace ffi = xla::ffi;

// An FFI error carrying the library's prefix.
ffi::Error ffi_error(std::string msg);

// Walks RemainingArgs / RemainingRets in the order Python lays them out.
template <typename Remaining>
class Cursor {
 public:
  explicit Cursor(const Remaining& r) : r_(r) {}
  // ErrorOr<T> for arguments, ErrorOr<Result<T>> for results.
  template <typename T>
  auto next() { return r_.template get<T>(i_++); }
  size_t used() const { return i_; }
  size_t size() const { return r_.size(); }
 private:
  const Remaining& r_;
  size_t i_ = 0;
};

inline void* byte_offset(void* base, int64_t elements, size_t element_bytes) {
  return static_cast<char*>(base) + elements * static_cast<int64_t>(element_bytes);
}

struct Bindings {
  std::unordered_map<int64_t, void*> pointers;
  std::vector<std::pair<void*, size_t>> zero_first;  // outputs padding leaves unwritten
};

// The FFI target a call came through (see the handler definitions in cudnn_ffi.cc).
enum class Target { kCommandBuffer, kPlain };

// The key attribute -> AttnParams, or an FFI error with the parser's message.
ffi::Error parse_key(std::string_view key, AttnParams& p);
// The inputs every handler takes first, in Python's order: q, k, v from one, two or
// three buffers (at the offsets the packing implies); for the backward o, dO and the
// stats; then the auxiliary inputs the key asks for (bias, sequence lengths, ragged
// offsets, dropout seed / offset, sink, a lowered score_mod's static inputs).
ffi::Error bind_inputs(const AttnParams& p, GraphKind kind, Cursor<ffi::RemainingArgs>& args,
                       Bindings& b);
// The next output, bound to `uid`; zeroed first when padding leaves part of it unwritten.
ffi::Error bind_output(const AttnParams& p, Cursor<ffi::RemainingRets>& rets, Bindings& b,
                       Uid uid);
// A training forward's fp32 log-sum-exp output.
ffi::Error bind_stats(Cursor<ffi::RemainingRets>& rets, Bindings& b);
// `uids[i]` bound to row i of a [n, kFp8SlotFloats] fp32 buffer (FP8 scales, amaxes).
ffi::Error bind_slots(void* base, size_t size_bytes, const Uid* uids, size_t n, Bindings& b);
// Once a handler has bound its inputs and outputs: the workspace (the last output),
// a check that no argument or result is left over, then the graph of (device, kind,
// key) looked up, `b.zero_first` zeroed and the graph executed on `stream`.
ffi::Error run_bound(cudaStream_t stream, int device, GraphKind kind, std::string_view key,
                     Bindings& b, const Cursor<ffi::RemainingArgs>& args,
                     Cursor<ffi::RemainingRets>& rets, Target target);

}  // namespace fusedattn::cudnn_attn
