// Construction of the cuDNN attention graphs (see cudnn_graph.h).
#include "cudnn_graph.h"
#include "cudnn_flex.h"
#include "cudnn_graph_parts.h"

#include <cstdlib>
#include <string>
#include <utility>

#include <cuda_runtime.h>
#include <dlfcn.h>

// The frontend's dynamic loader resolves cuDNN symbols through this handle. The
// extension links libcudnn.so.9 (RPATH: the wheel jaxlib uses), so it is already
// loaded and this returns that very library: one libcudnn per process.
// Its CUDA runtime loader would take the first of libcudart.so.12 / .so.13 it can
// open; pin the major version these headers were compiled for (unless the user
// chose), since the two differ in struct layouts.
namespace cudnn_frontend {
void* cudnn_dlhandle = [] {
  const std::string cudart = "libcudart.so." + std::to_string(CUDART_VERSION / 1000);
  setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", cudart.c_str(), /*overwrite=*/0);
  void* h = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_NOLOAD);
  return h ? h : dlopen("libcudnn.so.9", RTLD_NOW);
}();
}  // namespace cudnn_frontend

namespace fusedattn::cudnn_attn {

const char* kind_name(GraphKind kind) {
  switch (kind) {
    case GraphKind::kForwardInference: return "forward (inference)";
    case GraphKind::kForwardTraining: return "forward (training)";
    default: return "backward";
  }
}

const char* kind_key(GraphKind kind) {
  switch (kind) {
    case GraphKind::kForwardInference: return "forward_inference";
    case GraphKind::kForwardTraining: return "forward_training";
    default: return "backward";
  }
}

TensorPtr add_tensor(fe::graph::Graph& g, const char* name, Uid uid,
                     const TensorGeometry& geom, fe::DataType_t type) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name).set_uid(uid)
                      .set_dim(geom.dims).set_stride(geom.strides)
                      .set_data_type(type));
}

TensorPtr add_index_tensor(fe::graph::Graph& g, const char* name, Uid uid, int64_t n) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name).set_uid(uid)
                      .set_dim({n, 1, 1, 1}).set_stride({1, 1, 1, 1})
                      .set_data_type(fe::DataType_t::INT32));
}

fe::DataType_t io_type(const AttnParams& p) {
  if (p.fp8) return fe::DataType_t::FP8_E4M3;
  return p.bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF;
}

fe::DataType_t fp8_type(Fp8Type t) {
  return t == Fp8Type::kE5M2 ? fe::DataType_t::FP8_E5M2 : fe::DataType_t::FP8_E4M3;
}

CommonTensors declare_common(fe::graph::Graph& g, const AttnParams& p, bool with_stats,
                             bool o_is_input) {
  const auto io = io_type(p);
  CommonTensors t;
  t.q = add_tensor(g, "Q", kQ, q_geometry(p), io);
  t.k = add_tensor(g, "K", kK, k_geometry(p), io);
  t.v = add_tensor(g, "V", kV, v_geometry(p), io);
  if (o_is_input) t.o = add_tensor(g, "O", kO, o_geometry(p), io);
  if (o_is_input && with_stats)
    t.stats = add_tensor(g, "Stats", kStats, stats_geometry(p), fe::DataType_t::FLOAT);
  if (p.has_bias()) t.bias = add_tensor(g, "Bias", kBias, bias_geometry(p), io);
  if (p.has_seq_lens()) {
    t.seq_q = add_index_tensor(g, "seq_q", kSeqQ, p.batch());
    t.seq_kv = add_index_tensor(g, "seq_kv", kSeqKV, p.batch());
  }
  if (p.packed()) {
    const int64_t n = p.batch() + 1;
    t.q->set_ragged_offset(add_index_tensor(g, "ragged_q", kRaggedQ, n));
    t.k->set_ragged_offset(add_index_tensor(g, "ragged_k", kRaggedK, n));
    t.v->set_ragged_offset(add_index_tensor(g, "ragged_v", kRaggedV, n));
    if (t.o) t.o->set_ragged_offset(add_index_tensor(g, "ragged_o", kRaggedO, n));
    if (t.stats) t.stats->set_ragged_offset(add_index_tensor(g, "ragged_stats", kRaggedStats, n));
  }
  if (p.has_dropout()) {
    // 64-bit Philox seed and offset, read on the device (Python passes 2 x u32 each).
    TensorGeometry scalar{{1, 1, 1, 1}, {1, 1, 1, 1}, 0};
    t.seed = add_tensor(g, "seed", kSeed, scalar, fe::DataType_t::INT64);
    t.offset = add_tensor(g, "offset", kOffset, scalar, fe::DataType_t::INT64);
  }
  if (p.has_sink()) {
    TensorGeometry sink{{1, p.hq, 1, 1}, {p.hq, 1, 1, 1}, 0};
    t.sink = add_tensor(g, "sink", kSink, sink, fe::DataType_t::FLOAT);
  }
  return t;
}

namespace {

// ALiBi in cuDNN's own form, for the configs a lowered score_mod cannot run
// (padding lengths, packed sequences, bias: Python decides): the frontend adds
// slope[h] * (kv index - q index) after the bias, with its own slopes for the hq
// query heads (detail::get_alibi_slope, which fusedattn.score_mods.alibi_slopes
// reproduces). It needs the right bound 0 (causal, top-left); it copies the
// slopes from host memory into the workspace on every execute.
template <typename Attrs>
void set_alibi(Attrs& a, const AttnParams& p) {
  if (p.alibi) a.set_alibi_mask(true);
}

}  // namespace

std::shared_ptr<fe::graph::Graph> make_graph(const AttnParams& p, GraphKind kind, int sm_version) {
  if (p.fp8) return make_fp8_graph(p, kind, sm_version);
  auto g = std::make_shared<fe::graph::Graph>();
  if (sm_version > 0) g->set_sm_version(sm_version);  // before any node copies the context
  g->set_io_data_type(p.bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const auto io = p.bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF;
  if (kind != GraphKind::kBackward) {
    const bool training = kind == GraphKind::kForwardTraining;
    CommonTensors t = declare_common(*g, p, /*with_stats=*/false, /*o_is_input=*/false);
    auto attrs = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(training);
    set_common_options(attrs, p, t);
    set_alibi(attrs, p);
    if (p.has_flex()) attrs.set_score_mod(FlexMod(*g, p).forward());
    auto [o, stats] = g->sdpa(t.q, t.k, t.v, attrs);
    set_output(o, "O", kO, o_geometry(p), io);
    if (p.packed()) o->set_ragged_offset(add_index_tensor(*g, "ragged_o", kRaggedO, p.batch() + 1));
    if (training) {
      set_output(stats, "Stats", kStats, stats_geometry(p), fe::DataType_t::FLOAT);
      if (p.packed())
        stats->set_ragged_offset(add_index_tensor(*g, "ragged_stats", kRaggedStats, p.batch() + 1));
    }
    return g;
  }
  CommonTensors t = declare_common(*g, p, /*with_stats=*/true, /*o_is_input=*/true);
  auto d_o = add_tensor(*g, "dO", kdO, o_geometry(p), io);
  if (p.packed()) d_o->set_ragged_offset(t.o->get_ragged_offset());
  auto attrs = fe::graph::SDPA_backward_attributes().set_name("sdpa_backward")
                   .set_deterministic_algorithm(p.deterministic);
  set_common_options(attrs, p, t);
  set_alibi(attrs, p);
  if (p.has_flex()) {
    FlexMod flex(*g, p);
    attrs.set_score_mod(flex.forward()).set_score_mod_bprop(flex.backward());
  }
  TensorPtr d_bias, d_sink;
  if (p.has_bias()) {
    d_bias = g->tensor(fe::graph::Tensor_attributes().set_name("dBias").set_uid(kdBias)
                           .set_dim(bias_geometry(p).dims).set_stride(bias_geometry(p).strides)
                           .set_data_type(io));
    attrs.set_dbias(d_bias);
  }
  if (p.learnable_sink()) {
    d_sink = g->tensor(fe::graph::Tensor_attributes().set_name("dSink").set_uid(kdSink)
                           .set_dim({1, p.hq, 1, 1}).set_stride({p.hq, 1, 1, 1})
                           .set_data_type(fe::DataType_t::FLOAT));
    attrs.set_dsink_token(d_sink);
  }
  auto [dq, dk, dv] = g->sdpa_backward(t.q, t.k, t.v, t.o, d_o, t.stats, attrs);
  set_output(dq, "dQ", kdQ, q_geometry(p), io);
  set_output(dk, "dK", kdK, k_geometry(p), io);
  set_output(dv, "dV", kdV, v_geometry(p), io);
  if (p.packed()) {
    dq->set_ragged_offset(t.q->get_ragged_offset());
    dk->set_ragged_offset(t.k->get_ragged_offset());
    dv->set_ragged_offset(t.v->get_ragged_offset());
  }
  if (d_bias) d_bias->set_output(true);
  if (d_sink) d_sink->set_output(true);
  return g;
}

}  // namespace fusedattn::cudnn_attn
