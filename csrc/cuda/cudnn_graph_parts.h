// Pieces every attention graph file builds from (cudnn_graph.cc for BF16/FP16,
// cudnn_fp8_graph.cc for FP8): tensor declarations with the handlers' uids, the
// tensors both directions share, and the mask / padding / dropout / sink options,
// which the SDPA, SDPA backward and FP8 backward attributes all take the same way.
#pragma once

#include "cudnn_graph.h"

namespace fusedattn::cudnn_attn {

TensorPtr add_tensor(fe::graph::Graph& g, const char* name, Uid uid,
                     const TensorGeometry& geom, fe::DataType_t type);
TensorPtr add_index_tensor(fe::graph::Graph& g, const char* name, Uid uid, int64_t n);

// The data type of q, k, v, o: BF16 / FP16, or E4M3 for FP8 graphs.
fe::DataType_t io_type(const AttnParams& p);
fe::DataType_t fp8_type(Fp8Type t);

struct CommonTensors {
  TensorPtr q, k, v, o, stats, bias, seq_q, seq_kv, seed, offset, sink;
};

// Declared identically for forward and backward (o and stats only as backward inputs).
CommonTensors declare_common(fe::graph::Graph& g, const AttnParams& p, bool with_stats,
                             bool o_is_input);

inline void set_output(const TensorPtr& t, const char* name, Uid uid, const TensorGeometry& geom,
                       fe::DataType_t type) {
  t->set_output(true).set_name(name).set_uid(uid).set_dim(geom.dims)
      .set_stride(geom.strides).set_data_type(type);
}

// Masking, padding, dropout and sink options are the same on both sides.
template <typename Attrs>
void set_common_options(Attrs& a, const AttnParams& p, const CommonTensors& t) {
  a.set_attn_scale(p.scale);
  if (p.mask != Mask::kNone) {
    a.set_diagonal_alignment(p.mask == Mask::kCausalBottomRight
                                 ? fe::DiagonalAlignment_t::BOTTOM_RIGHT
                                 : fe::DiagonalAlignment_t::TOP_LEFT);
  }
  // Our window (left, right) counts keys beside the diagonal; cuDNN's left bound
  // counts the diagonal itself (keys j > i - left_bound).
  if (p.window_left >= 0) a.set_diagonal_band_left_bound(static_cast<int>(p.window_left + 1));
  if (p.window_right >= 0) a.set_diagonal_band_right_bound(static_cast<int>(p.window_right));
  if (p.window_left >= 0 && p.mask == Mask::kNone)
    a.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT);
  if (t.bias) a.set_bias(t.bias);
  if (p.has_seq_lens()) {
    a.set_padding_mask(true).set_seq_len_q(t.seq_q).set_seq_len_kv(t.seq_kv);
  }
  if (p.packed()) {
    a.set_max_total_seq_len_q(p.b * p.sq).set_max_total_seq_len_kv(p.b * p.skv);
  }
  if (p.has_dropout()) a.set_dropout(p.dropout, t.seed, t.offset);
  if (t.sink) a.set_sink_token(t.sink);
}

// The FP8 graphs (cudnn_fp8_graph.cc); make_graph hands FP8 keys to it.
std::shared_ptr<fe::graph::Graph> make_fp8_graph(const AttnParams& p, GraphKind kind,
                                                 int sm_version);

}  // namespace fusedattn::cudnn_attn
