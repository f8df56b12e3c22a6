"""Where a process's first cuDNN attention build spends its time: handle creation, then
each build stage of a forward and a backward graph (b4 s4096 h16, the given head dim),
with the heuristic modes given. Run each variant in a fresh process.

    python benchmarks/tune/first_use_split.py [d] [A|A,FALLBACK|A,B]
"""
import sys
import time

import cudnn

from cudnn_plans import build

d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
names = (sys.argv[2] if len(sys.argv) > 2 else "A,FALLBACK").split(",")
modes = [getattr(cudnn.heur_mode, n) for n in names]
t0 = time.perf_counter()
handle = cudnn.create_handle()
print(f"d{d} modes {names}: create_handle {time.perf_counter() - t0:.3f}s", flush=True)
for kind in ("fwd", "bwd", "fwd"):
    timings = {}
    t0 = time.perf_counter()
    g, _, _ = build(kind, False, False, 4, 4096, 16, d, handle, modes=modes,
                    policy=cudnn.build_plan_policy.HEURISTICS_CHOICE, timings=timings)
    print(f"  {kind}: {time.perf_counter() - t0:.3f}s " +
          " ".join(f"{k}={v:.3f}" for k, v in timings.items()) +
          f" plans={g.get_execution_plan_count()}", flush=True)
