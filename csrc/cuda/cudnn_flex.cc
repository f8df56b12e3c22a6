// Rebuilding lowered score_mod programs as cuDNN pointwise nodes (cudnn_flex.h).
#include "cudnn_flex.h"

#include <cstdlib>
#include <map>
#include <stdexcept>

#include "cudnn_graph_parts.h"

namespace fusedattn::cudnn_attn {
namespace {

using fe::PointwiseMode_t;

struct OpInfo {
  PointwiseMode_t mode;
  int arity;
  bool boolean;  // the result is a predicate
};

const std::map<std::string, OpInfo, std::less<>>& op_table() {
  static const std::map<std::string, OpInfo, std::less<>> table = {
      {"add", {PointwiseMode_t::ADD, 2, false}},     {"sub", {PointwiseMode_t::SUB, 2, false}},
      {"mul", {PointwiseMode_t::MUL, 2, false}},     {"div", {PointwiseMode_t::DIV, 2, false}},
      {"max", {PointwiseMode_t::MAX, 2, false}},     {"min", {PointwiseMode_t::MIN, 2, false}},
      {"pow", {PointwiseMode_t::POW, 2, false}},     {"mod", {PointwiseMode_t::MOD, 2, false}},
      {"neg", {PointwiseMode_t::NEG, 1, false}},     {"abs", {PointwiseMode_t::ABS, 1, false}},
      {"exp", {PointwiseMode_t::EXP, 1, false}},     {"log", {PointwiseMode_t::LOG, 1, false}},
      {"tanh", {PointwiseMode_t::TANH_FWD, 1, false}},
      {"sigmoid", {PointwiseMode_t::SIGMOID_FWD, 1, false}},
      {"erf", {PointwiseMode_t::ERF, 1, false}},     {"sqrt", {PointwiseMode_t::SQRT, 1, false}},
      {"rsqrt", {PointwiseMode_t::RSQRT, 1, false}}, {"sin", {PointwiseMode_t::SIN, 1, false}},
      {"cos", {PointwiseMode_t::COS, 1, false}},     {"tan", {PointwiseMode_t::TAN, 1, false}},
      {"floor", {PointwiseMode_t::FLOOR, 1, false}}, {"ceil", {PointwiseMode_t::CEIL, 1, false}},
      {"recip", {PointwiseMode_t::RECIPROCAL, 1, false}},
      {"id", {PointwiseMode_t::IDENTITY, 1, false}},
      {"eq", {PointwiseMode_t::CMP_EQ, 2, true}},    {"ne", {PointwiseMode_t::CMP_NEQ, 2, true}},
      {"gt", {PointwiseMode_t::CMP_GT, 2, true}},    {"ge", {PointwiseMode_t::CMP_GE, 2, true}},
      {"lt", {PointwiseMode_t::CMP_LT, 2, true}},    {"le", {PointwiseMode_t::CMP_LE, 2, true}},
      {"and", {PointwiseMode_t::LOGICAL_AND, 2, true}},
      {"or", {PointwiseMode_t::LOGICAL_OR, 2, true}},
      {"not", {PointwiseMode_t::LOGICAL_NOT, 1, true}},
      {"sel", {PointwiseMode_t::BINARY_SELECT, 3, false}},
      // (dy, x) -> dy * f'(x), the frontend's own Softcap bprop form.
      {"tanh_bwd", {PointwiseMode_t::TANH_BWD, 2, false}},
      {"sigmoid_bwd", {PointwiseMode_t::SIGMOID_BWD, 2, false}},
  };
  return table;
}

FlexOperand parse_operand(std::string_view t, size_t n_values) {
  if (t.empty()) throw std::invalid_argument("flex program: empty operand");
  FlexOperand o{FlexOperand::Kind::kScore};
  auto number = [&](std::string_view digits) {
    char* end = nullptr;
    std::string s(digits);
    const long long v = std::strtoll(s.c_str(), &end, 10);
    if (s.empty() || *end != '\0' || v < 0)
      throw std::invalid_argument("flex program: bad operand '" + std::string(t) + "'");
    return static_cast<int64_t>(v);
  };
  switch (t[0]) {
    case 's': if (t.size() != 1) break; return {FlexOperand::Kind::kScore};
    case 'q': if (t.size() != 1) break; return {FlexOperand::Kind::kQIdx};
    case 'k': if (t.size() != 1) break; return {FlexOperand::Kind::kKvIdx};
    case 'g': if (t.size() != 1) break; return {FlexOperand::Kind::kGrad};
    case 'a': o.kind = FlexOperand::Kind::kInput; o.index = number(t.substr(1)); return o;
    case 'w': o.kind = FlexOperand::Kind::kForward; o.index = number(t.substr(1)); return o;
    case 'v':
      o.kind = FlexOperand::Kind::kValue;
      o.index = number(t.substr(1));
      if (static_cast<size_t>(o.index) >= n_values)
        throw std::invalid_argument("flex program: '" + std::string(t) + "' used before it is made");
      return o;
    case 'c': {
      std::string s(t.substr(1));
      char* end = nullptr;
      o.kind = FlexOperand::Kind::kConst;
      o.value = std::strtof(s.c_str(), &end);
      if (s.empty() || *end != '\0') break;
      return o;
    }
    default: break;
  }
  throw std::invalid_argument("flex program: bad operand '" + std::string(t) + "'");
}

std::vector<std::string_view> split(std::string_view text, char sep) {
  std::vector<std::string_view> parts;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t end = text.find(sep, pos);
    if (end == std::string_view::npos) end = text.size();
    parts.push_back(text.substr(pos, end - pos));
    pos = end + 1;
  }
  return parts;
}

}  // namespace

FlexProgram parse_flex_program(std::string_view text) {
  FlexProgram program;
  if (text.empty()) return program;
  for (std::string_view item : split(text, '|')) {
    const size_t colon = item.find(':');
    if (colon == std::string_view::npos)
      throw std::invalid_argument("flex program: instruction '" + std::string(item) + "' lacks ':'");
    FlexOp op;
    op.name = std::string(item.substr(0, colon));
    if (op.name.size() > 2 && op.name.compare(op.name.size() - 2, 2, ".i") == 0) {
      op.name.resize(op.name.size() - 2);
      op.integer = true;
    }
    auto info = op_table().find(op.name);
    if (info == op_table().end())
      throw std::invalid_argument("flex program: unknown operation '" + op.name + "'");
    if (op.integer && (info->second.boolean || info->second.arity == 3))
      throw std::invalid_argument("flex program: '" + op.name + ".i': only arithmetic computes in int32");
    for (std::string_view arg : split(item.substr(colon + 1), ','))
      op.args.push_back(parse_operand(arg, program.size()));
    if (static_cast<int>(op.args.size()) != info->second.arity)
      throw std::invalid_argument("flex program: '" + op.name + "' takes " +
                                  std::to_string(info->second.arity) + " operands");
    program.push_back(std::move(op));
  }
  return program;
}

std::vector<FlexInput> parse_flex_inputs(std::string_view text) {
  std::vector<FlexInput> inputs;
  if (text.empty()) return inputs;
  for (std::string_view item : split(text, ',')) {
    FlexInput in;
    if (!item.empty() && item.back() == 'i') {
      in.integer = true;
      item.remove_suffix(1);
    }
    for (std::string_view d : split(item, '.')) {
      char* end = nullptr;
      std::string s(d);
      in.dims.push_back(std::strtoll(s.c_str(), &end, 10));
      if (s.empty() || *end != '\0') in.dims.back() = 0;
    }
    const auto& dims = in.dims;
    if (dims.size() != 4 || dims[0] <= 0 || dims[1] <= 0 || dims[2] <= 0 || dims[3] <= 0)
      throw std::invalid_argument("flex inputs: bad shape '" + std::string(item) + "'");
    inputs.push_back(std::move(in));
  }
  return inputs;
}

struct FlexMod::State {
  FlexProgram forward, backward;
  std::vector<TensorPtr> inputs;  // on the main graph, captured by the callbacks
  TensorPtr score;                // the backward graph's recomputed score, for the bprop
  std::vector<TensorPtr> forward_values;  // the forward program's values (wN)
};

namespace {

// Emits `program`; its values are left in `values` (the forward's, for the bprop's wN).
TensorPtr emit(const FlexProgram& program, const std::shared_ptr<fe::graph::Graph>& g,
               const std::vector<TensorPtr>& inputs, const TensorPtr& score, const TensorPtr& grad,
               const std::vector<TensorPtr>& forward, std::vector<TensorPtr>& values) {
  // A fresh index node for every use, as cuDNN's own masks each generate theirs. In
  // a forward program it is generated from the latest float value, as the frontend's
  // diagonal band mask generates its indices from the score it masks: cuDNN 9.19
  // skips the tiles a causal select hides only in that form (docs/decisions.md;
  // benchmarks/tune/flex_mask_speed.py measures it). A bprop has no masks; its indices
  // are generated from the gradient it receives, as the frontend's own bprop sample
  // does (test_flexible_sdpa_bprop.py), never from the recomputed score.
  TensorPtr latest = score;
  auto index = [&](int axis) {
    TensorPtr idx = g->pointwise(grad ? grad : latest, fe::graph::Pointwise_attributes()
                                            .set_mode(PointwiseMode_t::GEN_INDEX).set_axis(axis)
                                            .set_compute_data_type(fe::DataType_t::INT32));
    idx->set_data_type(fe::DataType_t::INT32);
    return idx;
  };
  auto operand = [&](const FlexOperand& o, bool integer) -> TensorPtr {
    switch (o.kind) {
      case FlexOperand::Kind::kScore: return score;
      case FlexOperand::Kind::kQIdx: return index(2);
      case FlexOperand::Kind::kKvIdx: return index(3);
      case FlexOperand::Kind::kGrad:
        if (!grad) throw std::invalid_argument("flex program: 'g' outside a bprop");
        return grad;
      case FlexOperand::Kind::kInput:
        if (static_cast<size_t>(o.index) >= inputs.size())
          throw std::invalid_argument("flex program: input a" + std::to_string(o.index) + " missing");
        return inputs[o.index];
      case FlexOperand::Kind::kValue: return values[o.index];
      case FlexOperand::Kind::kForward:
        if (static_cast<size_t>(o.index) >= forward.size())
          throw std::invalid_argument("flex program: forward value w" + std::to_string(o.index) +
                                      " missing (only a bprop reads the forward's values)");
        return forward[o.index];
      default:
        if (integer) return std::make_shared<fe::graph::Tensor_attributes>(static_cast<int32_t>(o.value));
        return std::make_shared<fe::graph::Tensor_attributes>(o.value);
    }
  };
  for (const FlexOp& op : program) {
    const OpInfo& info = op_table().find(op.name)->second;
    const fe::DataType_t type = info.boolean ? fe::DataType_t::BOOLEAN
                                : op.integer ? fe::DataType_t::INT32
                                             : fe::DataType_t::FLOAT;
    auto attrs = fe::graph::Pointwise_attributes().set_mode(info.mode).set_compute_data_type(type);
    // A comparison of an int32 value with an integral constant compares in int32.
    bool int_compare = false;
    if (info.boolean && info.arity == 2) {
      for (const FlexOperand& o : op.args) {
        using K = FlexOperand::Kind;
        const TensorPtr t = o.kind == K::kValue ? values[o.index]
                            : o.kind == K::kInput && static_cast<size_t>(o.index) < inputs.size()
                                ? inputs[o.index] : nullptr;
        int_compare |= o.kind == K::kQIdx || o.kind == K::kKvIdx ||
                       (t && t->get_data_type() == fe::DataType_t::INT32);
      }
      for (const FlexOperand& o : op.args)
        int_compare &= o.kind != FlexOperand::Kind::kConst || o.value == static_cast<int32_t>(o.value);
    }
    auto arg = [&](size_t i) { return operand(op.args[i], op.integer || int_compare); };
    TensorPtr out;
    if (info.arity == 1) {
      out = g->pointwise(arg(0), attrs);
    } else if (info.arity == 2) {
      out = g->pointwise(arg(0), arg(1), attrs);
    } else {  // sel: cuDNN's BINARY_SELECT(a, b, cond) is cond ? a : b
      out = g->pointwise(arg(1), arg(2), arg(0), attrs);
    }
    out->set_data_type(type);
    if (type == fe::DataType_t::FLOAT) latest = out;
    values.push_back(out);
  }
  return values.empty() ? score : values.back();
}

}  // namespace

FlexMod::FlexMod(fe::graph::Graph& g, const AttnParams& p) : state_(std::make_shared<State>()) {
  state_->forward = parse_flex_program(p.flex);
  state_->backward = parse_flex_program(p.flex_bprop);
  const auto inputs = parse_flex_inputs(p.flex_inputs);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto& d = inputs[i].dims;
    TensorGeometry geom{d, {d[1] * d[2] * d[3], d[2] * d[3], d[3], 1}, 0};
    const std::string name = "flex_input" + std::to_string(i);
    state_->inputs.push_back(add_tensor(g, name.c_str(), static_cast<Uid>(kFlexInput + i), geom,
                                        inputs[i].integer ? fe::DataType_t::INT32
                                                          : fe::DataType_t::FLOAT));
  }
}

ScoreModifier FlexMod::forward() const {
  return [state = state_](std::shared_ptr<fe::graph::Graph> g, TensorPtr score) {
    state->score = score;
    state->forward_values.clear();
    return emit(state->forward, g, state->inputs, score, nullptr, {}, state->forward_values);
  };
}

ScoreModifier FlexMod::backward() const {
  return [state = state_](std::shared_ptr<fe::graph::Graph> g, TensorPtr grad) {
    if (!state->score)
      throw std::runtime_error("flex bprop called before the forward score_mod (recompute)");
    std::vector<TensorPtr> values;
    return emit(state->backward, g, state->inputs, state->score, grad, state->forward_values,
                values);
  };
}

}  // namespace fusedattn::cudnn_attn
