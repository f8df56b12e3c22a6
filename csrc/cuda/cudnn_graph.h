// cuDNN fused attention (BF16/FP16) through XLA's typed FFI, built with
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
// Built-in score_mods: ALiBi goes through the frontend's ALiBi mask, soft-capping
// through its score_mod hook (see `make_graph`). ALiBi's slopes reach the device
// as a host-to-device copy the frontend issues on every execute; graphs with
// such copies run through FFI targets that do not declare XLA's command-buffer
// trait (cudnn_ffi.cc).
//
// The files, one concern each:
//   cudnn_params.h   the config key -> AttnParams and tensor geometries
//   cudnn_graph.*    graph construction (this header: uids, kinds, make_graph)
//   cudnn_handles.h  device scope and the per-device pool of cuDNN handles
//   cudnn_cache.*    the thread-safe graph cache (build once, keep the plan)
//   cudnn_ffi.cc     the FFI handlers and their targets
//   cudnn_python.cc  support probes, validation, versions for Python
// New graph families (FP8, lowered score_mods) add their own graph file beside
// cudnn_graph.cc and reuse the cache, handles and handler plumbing.
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
};

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
