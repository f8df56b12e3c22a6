// The static description of one cuDNN attention call, as Python sends it.
//
// Python (backends/cudnn.py, `graph_key`) writes it as "name=value;..." with
// integer and float values; that string is both the FFI attribute `key` and the
// graph cache key, so a trace-time probe and the run-time handler meet in the
// same cache entry. This header parses it and derives the tensor geometry
// (dims/strides in elements) cuDNN's [batch, head, seq, dim] view needs.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace fusedattn::cudnn_attn {

enum class Layout { kBSHD = 0, kSBHD = 1 };
enum class Packing { kSeparate = 0, kQKV = 1, kKV = 2 };
enum class Mask { kNone = 0, kCausal = 1, kCausalBottomRight = 2 };
enum class Softmax { kVanilla = 0, kOffByOne = 1, kLearnable = 2 };
enum class Sequence { kDense = 0, kPadding = 1, kPacked = 2 };
enum class Fp8Type { kE4M3 = 0, kE5M2 = 1 };

struct AttnParams {
  int64_t b = 0, sq = 0, skv = 0, hq = 0, hkv = 0, dqk = 0, dv = 0;
  bool bf16 = true;
  Layout layout = Layout::kBSHD;
  Packing packing = Packing::kSeparate;
  Mask mask = Mask::kNone;
  int64_t window_left = -1, window_right = -1;  // -1: unbounded
  int64_t bias_dims[4] = {0, 0, 0, 0};          // all 0: no bias
  float scale = 1.f;
  Softmax softmax = Softmax::kVanilla;
  float dropout = 0.f;
  Sequence sequence = Sequence::kDense;
  int64_t segments = 1;  // packed: segments per row
  bool deterministic = false;
  // ALiBi in cuDNN's form (set_alibi_mask, its slopes for hq heads); other score_mods,
  // and ALiBi where they can, are lowered programs (flex below).
  bool alibi = false;
  // FP8 (cudnn_fp8_graph.cc): q, k, v, o in E4M3 with per-tensor scales; dO and
  // the gradients dq, dk, dv each E4M3 or E5M2.
  // A lowered score_mod (cudnn_flex.h): forward and bprop programs and the shapes
  // of their static inputs; all empty without one.
  std::string flex, flex_bprop, flex_inputs;
  bool fp8 = false;
  Fp8Type fp8_do = Fp8Type::kE4M3;
  Fp8Type fp8_grad = Fp8Type::kE4M3;

  bool has_bias() const { return bias_dims[0] != 0; }
  bool has_dropout() const { return dropout > 0.f; }
  bool has_sink() const { return softmax != Softmax::kVanilla; }
  bool learnable_sink() const { return softmax == Softmax::kLearnable; }
  bool has_seq_lens() const { return sequence != Sequence::kDense; }
  bool has_flex() const { return !flex.empty(); }
  // Static inputs of a lowered score_mod (comma-separated shapes).
  size_t flex_input_count() const {
    if (flex_inputs.empty()) return 0;
    size_t n = 1;
    for (char c : flex_inputs) n += c == ',';
    return n;
  }
  bool packed() const { return sequence == Sequence::kPacked; }
  // Bytes per element of q, k, v, o as the handlers receive them.
  size_t element_bytes() const { return fp8 ? 1 : 2; }
  // Sequences cuDNN sees: one per row, or one per segment of a packed row.
  int64_t batch() const { return packed() ? b * segments : b; }
};

inline AttnParams parse_params(std::string_view key) {
  std::map<std::string, std::string, std::less<>> kv;
  size_t pos = 0;
  while (pos < key.size()) {
    size_t end = key.find(';', pos);
    if (end == std::string_view::npos) end = key.size();
    std::string_view item = key.substr(pos, end - pos);
    size_t eq = item.find('=');
    if (eq == std::string_view::npos)
      throw std::invalid_argument("malformed cudnn attention key item '" + std::string(item) + "'");
    kv.emplace(std::string(item.substr(0, eq)), std::string(item.substr(eq + 1)));
    pos = end + 1;
  }
  auto take = [&](const char* name) -> const std::string& {
    auto it = kv.find(name);
    if (it == kv.end())
      throw std::invalid_argument(std::string("cudnn attention key lacks '") + name + "'");
    return it->second;
  };
  auto i64 = [&](const char* name) { return std::strtoll(take(name).c_str(), nullptr, 10); };
  auto f32 = [&](const char* name) { return static_cast<float>(std::strtod(take(name).c_str(), nullptr)); };

  AttnParams p;
  p.b = i64("b"); p.sq = i64("sq"); p.skv = i64("skv");
  p.hq = i64("hq"); p.hkv = i64("hkv"); p.dqk = i64("dqk"); p.dv = i64("dv");
  p.bf16 = i64("bf16") != 0;
  p.layout = static_cast<Layout>(i64("layout"));
  p.packing = static_cast<Packing>(i64("packing"));
  p.mask = static_cast<Mask>(i64("mask"));
  p.window_left = i64("wl"); p.window_right = i64("wr");
  p.bias_dims[0] = i64("bias_b"); p.bias_dims[1] = i64("bias_h");
  p.bias_dims[2] = i64("bias_sq"); p.bias_dims[3] = i64("bias_skv");
  p.scale = f32("scale");
  p.softmax = static_cast<Softmax>(i64("softmax"));
  p.dropout = f32("dropout");
  p.sequence = static_cast<Sequence>(i64("seq"));
  p.segments = i64("segs");
  p.deterministic = i64("det") != 0;
  p.alibi = i64("alibi") != 0;
  p.flex = take("flex");
  p.flex_bprop = take("flexb");
  p.flex_inputs = take("flexin");
  p.fp8 = i64("fp8") != 0;
  p.fp8_do = static_cast<Fp8Type>(i64("fp8_do"));
  p.fp8_grad = static_cast<Fp8Type>(i64("fp8_grad"));
  if (p.b <= 0 || p.sq <= 0 || p.skv <= 0 || p.hq <= 0 || p.hkv <= 0 || p.dqk <= 0 || p.dv <= 0)
    throw std::invalid_argument("cudnn attention key has a non-positive dimension");
  return p;
}

// Where a [batch, head, seq, dim] operand lives inside the buffer XLA hands over.
struct TensorGeometry {
  std::vector<int64_t> dims, strides;
  int64_t pointer_offset = 0;  // elements from the buffer start (packed q/k/v)
};

// `slot` is this operand's index inside a packed [.., n_packed, h, d] buffer.
inline TensorGeometry operand_geometry(const AttnParams& p, int64_t seq, int64_t heads,
                                       int64_t dim, int64_t n_packed, int64_t slot) {
  const int64_t width = n_packed * heads * dim;  // elements per (row, token)
  TensorGeometry g;
  g.pointer_offset = slot * heads * dim;
  const int64_t token_stride = p.layout == Layout::kBSHD ? width : p.b * width;
  const int64_t batch_stride = p.layout == Layout::kBSHD ? seq * width : width;
  g.dims = {p.batch(), heads, seq, dim};
  g.strides = {batch_stride, dim, token_stride, 1};
  return g;
}

inline TensorGeometry q_geometry(const AttnParams& p) {
  return p.packing == Packing::kQKV ? operand_geometry(p, p.sq, p.hq, p.dqk, 3, 0)
                                    : operand_geometry(p, p.sq, p.hq, p.dqk, 1, 0);
}
inline TensorGeometry k_geometry(const AttnParams& p) {
  switch (p.packing) {
    case Packing::kQKV: return operand_geometry(p, p.skv, p.hkv, p.dqk, 3, 1);
    case Packing::kKV: return operand_geometry(p, p.skv, p.hkv, p.dqk, 2, 0);
    default: return operand_geometry(p, p.skv, p.hkv, p.dqk, 1, 0);
  }
}
inline TensorGeometry v_geometry(const AttnParams& p) {
  switch (p.packing) {
    case Packing::kQKV: return operand_geometry(p, p.skv, p.hkv, p.dv, 3, 2);
    case Packing::kKV: return operand_geometry(p, p.skv, p.hkv, p.dv, 2, 1);
    default: return operand_geometry(p, p.skv, p.hkv, p.dv, 1, 0);
  }
}
inline TensorGeometry o_geometry(const AttnParams& p) {
  return operand_geometry(p, p.sq, p.hq, p.dv, 1, 0);
}
// Softmax statistics, fp32: [b, h, s_q] when dense or padded; token-major
// [b * s_q, h] when packed, the layout cudnn-frontend sizes its backward
// workspace for (Python transposes that one to [b, h, s_q] for users).
inline TensorGeometry stats_geometry(const AttnParams& p) {
  TensorGeometry g;
  g.dims = {p.batch(), p.hq, p.sq, 1};
  g.strides = p.packed() ? std::vector<int64_t>{p.sq * p.hq, 1, p.hq, 1}
                         : std::vector<int64_t>{p.hq * p.sq, p.sq, 1, 1};
  return g;
}
inline TensorGeometry bias_geometry(const AttnParams& p) {
  const int64_t* d = p.bias_dims;
  TensorGeometry g;
  g.dims = {d[0], d[1], d[2], d[3]};
  g.strides = {d[1] * d[2] * d[3], d[2] * d[3], d[3], 1};
  return g;
}

}  // namespace fusedattn::cudnn_attn
