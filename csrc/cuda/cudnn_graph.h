// cuDNN fused attention (BF16/FP16, and FP8 in cudnn_fp8_graph.cc) through XLA's typed FFI, built with
// cudnn-frontend's graph API.
//
// Three graphs per configuration: forward for inference (no statistics),
// forward for training (fp32 log-sum-exp written straight into a [b, h, s_q]
// buffer) and backward. They are built once per (device, cuDNN version,
// frontend version, kind, key) and cached; `check_support` builds the three at
// once (one thread each) at trace time, so the handlers only look them up, bind
// pointers and launch on XLA's stream: no host synchronisation, no device
// allocation. Workspace is an XLA output whose size Python learns from
// `check_support`.
//
// score_mods are lowered programs (cudnn_flex.h), the built-in ALiBi and softcap
// too; ALiBi goes through the frontend's ALiBi mask where a program cannot run
// (padding, packed sequences, bias; see `make_graph`). ALiBi's slopes reach the device
// as a host-to-device copy the frontend issues on every execute; graphs with
// such copies run through FFI targets that do not declare XLA's command-buffer
// trait (cudnn_ffi.cc).
//
// The files, one concern each:
//   cudnn_params.h   the config key -> AttnParams and tensor geometries
//   cudnn_graph.*    graph construction (this header: uids, kinds, make_graph);
//                    cudnn_graph_parts.h holds what the graph files share
//   cudnn_fp8_graph.cc  the FP8 graphs (sdpa_fp8, sdpa_fp8_backward)
//   cudnn_handles.h  device scope and the per-device pool of cuDNN handles
//   cudnn_cache.*    the thread-safe, bounded (LRU) graph cache: build once, or
//                    load a serialized plan Python's persistent cache hands in
//   cudnn_autotune.* plan autotuning: every plan of a graph timed, the fastest kept
//   cudnn_ffi.cc     the FFI handlers and their targets (cudnn_ffi_common.h:
//                    what they share with the FP8 handlers in cudnn_fp8_ffi.cc)
//   cudnn_python.cc  support probes, validation, versions for Python
// New graph families (lowered score_mods next) add their own graph file beside
// cudnn_graph.cc and reuse the cache, handles and handler plumbing, as FP8 does.
#pragma once

#include <cudnn_frontend.h>

#include <array>
#include <cstdint>
#include <memory>

#include "cudnn_params.h"

namespace fusedattn::cudnn_attn {

namespace fe = cudnn_frontend;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

enum class GraphKind { kForwardInference = 0, kForwardTraining = 1, kBackward = 2 };

// Fixed tensor uids: the handlers bind device pointers by these.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kBias, kSeqQ, kSeqKV,
  kRaggedQ, kRaggedK, kRaggedV, kRaggedO, kRaggedStats,
  kSeed, kOffset, kSink, kdO, kdQ, kdK, kdV, kdBias, kdSink,
  // FP8 scale factors (fp32 scalars, in the order of kFp8Scales) and amaxes.
  kDescaleQ, kDescaleK, kDescaleV, kDescaleS, kScaleS, kScaleO, kDescaleO, kDescaleDO,
  kDescaleDP, kScaleDQ, kScaleDK, kScaleDV, kScaleDP,
  kAmaxS, kAmaxO, kAmaxDQ, kAmaxDK, kAmaxDV, kAmaxDP,
  // Static inputs of a lowered score_mod: kFlexInput + i.
  kFlexInput = 200,
};

// FP8 scalars travel in one fp32 buffer of [n, kFp8SlotFloats]: scalar i at row i,
// so each cuDNN scalar tensor gets a 16-byte aligned pointer. Python
// (backends/cudnn_fp8.py) writes and reads them in these orders.
constexpr int64_t kFp8SlotFloats = 4;
constexpr std::array<Uid, 13> kFp8Scales = {
    kDescaleQ, kDescaleK, kDescaleV, kDescaleS, kScaleS, kScaleO, kDescaleO,
    kDescaleDO, kDescaleDP, kScaleDQ, kScaleDK, kScaleDV, kScaleDP};
constexpr std::array<Uid, 2> kFp8ForwardAmaxes = {kAmaxS, kAmaxO};
constexpr std::array<Uid, 4> kFp8BackwardAmaxes = {kAmaxDQ, kAmaxDK, kAmaxDV, kAmaxDP};

constexpr std::array<GraphKind, 3> kKinds = {GraphKind::kForwardInference,
                                              GraphKind::kForwardTraining, GraphKind::kBackward};

// "forward (inference)" etc., for messages.
const char* kind_name(GraphKind kind);
// "forward_inference" etc., the keys Python reads.
const char* kind_key(GraphKind kind);

// The graph of one kind for a config. `sm_version` > 0 fixes the target
// architecture instead of asking the current device (frontend validation on a
// machine without a GPU).
std::shared_ptr<fe::graph::Graph> make_graph(const AttnParams& p, GraphKind kind,
                                             int sm_version = 0);

}  // namespace fusedattn::cudnn_attn
