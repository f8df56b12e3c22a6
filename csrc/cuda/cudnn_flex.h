// score_mods lowered by Python (src/fusedattn/flex_lowering.py) into programs of
// cuDNN pointwise operations, rebuilt here inside the SDPA node's score_mod and
// score_mod_bprop callbacks.
//
// A program is text: instructions separated by '|', each "op:operand,operand,..".
// Operands: s (the score: fp32 scaled logits), q / k (query / key index, from
// cuDNN's index generation along axes 2 / 3; in a forward program, of the latest
// float value, so a mask written after the score_mod has the frontend's form; in a
// bprop, of its gradient, as the frontend's bprop sample), g
// (the incoming gradient, bprop only), aN (static input N: a float tensor
// broadcast over [b, h, s_q, s_kv], evaluated by XLA from batch / head indices and
// score_mod_args; int32 where the inputs' text marks it), vN (the result of
// instruction N), wN (the forward program's value N, bprop only), c<float> (a
// constant). An arithmetic op named with the suffix ".i" (add.i) computes in int32,
// its constants int32 too (div.i truncates, as int32 division does): the form of
// cuDNN's own mask offsets (the frontend's diagonal band mask adds to its int32
// indices), which its engines recognise.
// tanh_bwd / sigmoid_bwd take (dy, x) and give dy * f'(x) (cuDNN's TANH_BWD /
// SIGMOID_BWD, the frontend's soft-capping bprop form).
// The last instruction is the result. The backward graph runs the
// forward program first (cuDNN recomputes the scores); the bprop reads its values
// through wN (cuDNN's engines take a bprop built on the forward's values, as the
// frontend's own soft-capping does, not one that recomputes from the score).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "cudnn_graph.h"

namespace fusedattn::cudnn_attn {

// What the SDPA attributes' set_score_mod / set_score_mod_bprop take.
using ScoreModifier = std::function<TensorPtr(std::shared_ptr<fe::graph::Graph>, TensorPtr)>;

struct FlexOperand {
  enum class Kind { kScore, kQIdx, kKvIdx, kGrad, kInput, kValue, kForward, kConst } kind;
  int64_t index = 0;  // input or value number
  float value = 0.f;  // constant
};

struct FlexOp {
  std::string name;  // add, sub, ..., sel (cond, if_true, if_false), id
  bool integer = false;  // ".i": int32 compute and result
  std::vector<FlexOperand> args;
};

using FlexProgram = std::vector<FlexOp>;

// Throws std::invalid_argument naming what is malformed.
FlexProgram parse_flex_program(std::string_view text);
struct FlexInput {
  std::vector<int64_t> dims;  // [b|1, h|1, s_q|1, s_kv|1]
  bool integer = false;       // int32, else float32
};
// "b.h.q.k" dims of the static inputs, comma separated; a trailing 'i' marks int32.
std::vector<FlexInput> parse_flex_inputs(std::string_view text);

// The score_mod callbacks of one graph: declares the static inputs on the main
// graph (uids kFlexInput + i) and emits the programs when the frontend calls back.
class FlexMod {
 public:
  FlexMod(fe::graph::Graph& g, const AttnParams& p);
  ScoreModifier forward() const;
  ScoreModifier backward() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace fusedattn::cudnn_attn
