// The FP8 attention graphs: cudnn-frontend's sdpa_fp8 (forward) and
// sdpa_fp8_backward with per-tensor scaling.
//
// q, k, v and o are E4M3; dO and the gradients dq, dk, dv are E4M3 or E5M2 (the
// key says which; the backward's internal dP takes dO's type, as the frontend
// decides). Every scale is a device scalar bound from the handler's scales
// buffer (kFp8Scales), so new scale values never rebuild a graph. Each graph
// also writes amaxes: of S (the softmax probabilities) and O in the forward, of
// dQ, dK, dV and dP in the backward. Stats are fp32 log-sum-exp, as in the
// BF16 graphs, so the partitioning rule and checkpointing see one contract.
//
// What cuDNN allows depends on the GPU and cuDNN version (on Hopper with cuDNN
// 9.19: E4M3 outputs only, backward at head dim 128 only, no THD backward, no
// bottom-right causal); the support probe reports the frontend's own message.
#include "cudnn_graph_parts.h"

namespace fusedattn::cudnn_attn {
namespace {

const TensorGeometry kScalar{{1, 1, 1, 1}, {1, 1, 1, 1}, 0};

TensorPtr scalar_input(fe::graph::Graph& g, const char* name, Uid uid) {
  return add_tensor(g, name, uid, kScalar, fe::DataType_t::FLOAT);
}

void set_amax(const TensorPtr& t, const char* name, Uid uid) {
  set_output(t, name, uid, kScalar, fe::DataType_t::FLOAT);
}

std::shared_ptr<fe::graph::Graph> forward(const AttnParams& p, bool training, int sm_version) {
  auto g = std::make_shared<fe::graph::Graph>();
  if (sm_version > 0) g->set_sm_version(sm_version);
  g->set_io_data_type(fe::DataType_t::FP8_E4M3)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  CommonTensors t = declare_common(*g, p, /*with_stats=*/false, /*o_is_input=*/false);
  auto attrs = fe::graph::SDPA_fp8_attributes().set_name("sdpa_fp8").set_generate_stats(training);
  set_common_options(attrs, p, t);
  auto [o, stats, amax_s, amax_o] = g->sdpa_fp8(
      t.q, t.k, t.v, scalar_input(*g, "descale_q", kDescaleQ),
      scalar_input(*g, "descale_k", kDescaleK), scalar_input(*g, "descale_v", kDescaleV),
      scalar_input(*g, "descale_s", kDescaleS), scalar_input(*g, "scale_s", kScaleS),
      scalar_input(*g, "scale_o", kScaleO), attrs);
  set_output(o, "O", kO, o_geometry(p), fe::DataType_t::FP8_E4M3);
  if (training) set_output(stats, "Stats", kStats, stats_geometry(p), fe::DataType_t::FLOAT);
  set_amax(amax_s, "amax_s", kAmaxS);
  set_amax(amax_o, "amax_o", kAmaxO);
  return g;
}

std::shared_ptr<fe::graph::Graph> backward(const AttnParams& p, int sm_version) {
  auto g = std::make_shared<fe::graph::Graph>();
  if (sm_version > 0) g->set_sm_version(sm_version);
  g->set_io_data_type(fe::DataType_t::FP8_E4M3)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  CommonTensors t = declare_common(*g, p, /*with_stats=*/true, /*o_is_input=*/true);
  auto d_o = add_tensor(*g, "dO", kdO, o_geometry(p), fp8_type(p.fp8_do));
  auto attrs = fe::graph::SDPA_fp8_backward_attributes().set_name("sdpa_fp8_backward")
                   .set_deterministic_algorithm(p.deterministic);
  set_common_options(attrs, p, t);
  auto s = [&](const char* name, Uid uid) { return scalar_input(*g, name, uid); };
  auto [dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dp] = g->sdpa_fp8_backward(
      t.q, t.k, t.v, t.o, d_o, t.stats, s("descale_q", kDescaleQ), s("descale_k", kDescaleK),
      s("descale_v", kDescaleV), s("descale_o", kDescaleO), s("descale_dO", kDescaleDO),
      s("descale_s", kDescaleS), s("descale_dP", kDescaleDP), s("scale_s", kScaleS),
      s("scale_dQ", kScaleDQ), s("scale_dK", kScaleDK), s("scale_dV", kScaleDV),
      s("scale_dP", kScaleDP), attrs);
  const auto grad = fp8_type(p.fp8_grad);
  set_output(dq, "dQ", kdQ, q_geometry(p), grad);
  set_output(dk, "dK", kdK, k_geometry(p), grad);
  set_output(dv, "dV", kdV, v_geometry(p), grad);
  set_amax(amax_dq, "amax_dQ", kAmaxDQ);
  set_amax(amax_dk, "amax_dK", kAmaxDK);
  set_amax(amax_dv, "amax_dV", kAmaxDV);
  set_amax(amax_dp, "amax_dP", kAmaxDP);
  return g;
}

}  // namespace

std::shared_ptr<fe::graph::Graph> make_fp8_graph(const AttnParams& p, GraphKind kind,
                                                 int sm_version) {
  if (kind == GraphKind::kBackward) return backward(p, sm_version);
  return forward(p, kind == GraphKind::kForwardTraining, sm_version);
}

}  // namespace fusedattn::cudnn_attn
