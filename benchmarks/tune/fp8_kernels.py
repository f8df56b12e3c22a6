"""Which kernels does cuDNN launch for an FP8 (and a BF16) attention graph, and how long
does each take? cudnn-frontend's own graphs (cudnn_graphs.Graph, the heuristics' first
plan), each run a few times under torch.profiler (CUPTI sees every kernel of the
process, whoever launched it).

    python -m benchmarks.tune.fp8_kernels [--backward-only] [b,s,h ...]   (default 4,4096,16 1,16384,16)
"""
from __future__ import annotations

import collections
import sys

import cupy as cp
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.cudnn_graphs import Graph

REPS = 5


def profiled(run_once, reps: int = REPS):
    """[(kernel name, mean microseconds per run)] of `run_once()` (which waits for its
    kernels), run `reps` times under the profiler."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run_once()
    total = collections.defaultdict(float)
    for avg in prof.key_averages():
        us = getattr(avg, "self_device_time_total", 0.0)
        if us > 0:
            total[avg.key] += us / reps
    return sorted(total.items(), key=lambda kv: -kv[1])


def kernels(graph):
    """`profiled` kernels of the graph's first plan."""
    graph.run(graph.plans[0], 3)
    cp.cuda.Device().synchronize()
    torch.cuda.synchronize()

    def run_once():
        graph.run(graph.plans[0], 1)
        cp.cuda.Device().synchronize()
    return profiled(run_once)


def main():
    args = sys.argv[1:]
    backward_only = "--backward-only" in args
    shapes = [tuple(int(x) for x in a.split(",")) for a in args if a != "--backward-only"]
    torch.zeros(1, device="cuda")
    for b, s, h in shapes or [(4, 4096, 16), (1, 16384, 16)]:
        for backward in (True,) if backward_only else (False, True):
            for causal in (False, True):
                for fp8 in (True, False):
                    g = Graph(b, s, h, 128, causal, fp8, "bshd", "bshd", True, True,
                              backward=backward, modes=("A",))
                    rows = kernels(g)
                    print(f"b{b} s{s} h{h} {'bwd' if backward else 'fwd'} "
                          f"{'fp8' if fp8 else 'bf16'} causal={causal} plan {g.plans[0][1]}: "
                          f"{sum(t for _, t in rows):.0f} us")
                    for name, us in rows:
                        print(f"    {us:9.1f} us  {name[:150]}")


if __name__ == "__main__":
    main()
