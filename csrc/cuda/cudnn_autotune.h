// Plan autotuning: time every execution plan cuDNN offers for a graph and make the
// fastest one the graph's plan.
//
// cuDNN's heuristics rank the engine configurations of a graph and the frontend
// builds the first that works. Autotuning builds all of them, runs each on scratch
// buffers of the graph's own shapes (random values, real sequence lengths, the
// largest workspace any plan needs) on a stream of its own, and keeps the one with
// the shortest time. A graph whose plans cannot be timed keeps the heuristics' plan,
// with a note saying why: tuning never turns a supported config into an error.
#pragma once

#include <cudnn.h>

#include <string>

#include "cudnn_graph.h"

namespace fusedattn::cudnn_attn {

struct TuneReport {
  int plans = 0;      // plans timed
  std::string chosen, heuristic;  // plan names (cudnn-frontend's get_plan_name)
  float chosen_ms = 0, heuristic_ms = 0;
  std::string note;   // why nothing (or not everything) was timed; empty if all went well
};

// `g` has its execution plans created and support checked (not yet built). Builds
// every plan, times each, and leaves the winner as the plan `execute` runs (the
// heuristics' plan if none could be timed). Returns an error only when not even the
// heuristics' plan builds, as build_plans(HEURISTICS_CHOICE) would.
std::string autotune(fe::graph::Graph& g, cudnnHandle_t handle, const AttnParams& p,
                     TuneReport& report);

}  // namespace fusedattn::cudnn_attn
