"""Does cuDNN's FP8 forward on this GPU depend on the tensors' layout, the plan, or the
data it is timed on? cudnn-frontend's own Python graphs on cupy buffers (no JAX),
every variant timed round-robin in one process, beside the BF16 graph of the same shape.

Variants: forward with q/k/v/o in BSHD (fusedattn's layout) or BHSD (cuDNN 9.19 refuses
a dim-major V: "the stride for the last dimension ... should be 1 for V"); stats on
(training) or off; data random or all ones; the backward in BSHD. Every plan that
heuristic modes A, B and FALLBACK list is timed, and each mode's own ranking printed.

    python benchmarks/tune/fp8_layouts.py [b s h d]
"""
from __future__ import annotations

import os
import statistics
import sys

import cudnn
import cupy as cp

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from cudnn_graphs import Graph  # noqa: E402


def time_all(cases, rounds=7, reps=20):
    """Median ms per call of each (name, graph, plan), round-robin."""
    times = {name: [] for name, _, _ in cases}
    for name, g, p in cases:
        g.run(p, 3)
    for _ in range(rounds):
        for name, g, p in cases:
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            g.run(p, reps)
            end.record()
            end.synchronize()
            times[name].append(cp.cuda.get_elapsed_time(start, end) / reps)
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    b, s, h, d = (int(x) for x in sys.argv[1:5]) if len(sys.argv) == 5 else (4, 4096, 16, 128)
    print(f"device {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}  "
          f"cuDNN {cudnn.backend_version()}  frontend {cudnn.__version__}  b{b} s{s} h{h} d{d}")
    for causal in (False, True):
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        cases = []
        variants = [("fwd bf16 bshd stats", False, "bshd", "bshd", True, True, False)]
        for qko in ("bshd", "bhsd"):
            for stats in (False, True):
                variants.append((f"fwd fp8 {qko} {'stats' if stats else 'nostats'}",
                                 True, qko, qko, stats, True, False))
        variants += [("fwd fp8 bshd nostats ones", True, "bshd", "bshd", False, False, False),
                     ("bwd bf16 bshd", False, "bshd", "bshd", True, True, True),
                     ("bwd fp8 bshd", True, "bshd", "bshd", True, True, True)]
        for name, fp8, qko, vl, stats, random, bwd in variants:
            args = (b, s, h, d, causal, fp8, qko, vl, stats, random, bwd)
            try:
                g = Graph(*args)
            except Exception as e:  # noqa: BLE001
                print(f"  causal={causal} {name}: refused: {str(e).splitlines()[0][:160]}")
                continue
            for mode in ("A", "B", "FALLBACK"):
                try:
                    print(f"  causal={causal} {name}: mode {mode} ranks "
                          f"{Graph(*args, modes=(mode,), build=False).names}")
                except Exception as e:  # noqa: BLE001
                    print(f"  causal={causal} {name}: mode {mode}: {str(e).splitlines()[0][:160]}")
            for p in g.plans:
                cases.append((f"{name} | plan {p[0]} {p[1]}", g, p, 2.5 if bwd else 1.0))
        res = time_all([c[:3] for c in cases])
        print(f"\ncausal={causal}  TFLOP/s (causal halved; backward counts 2.5x the forward)")
        for name, _, _, mult in cases:
            ms = res[name]
            print(f"  {mult * flops / ms / 1e9:7.1f}  {ms:.3f} ms  {name}")


if __name__ == "__main__":
    main()
