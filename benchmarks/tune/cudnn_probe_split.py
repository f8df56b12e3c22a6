"""First support probe of fresh cuDNN configs, in the order given: wall time and the
per-graph build split. Run it in a fresh process to see the first cuDNN use's cost.

    python benchmarks/tune/cudnn_probe_split.py [d[:mask],...]   (default 128,64:causal,128:causal,256)
"""
import sys
import time

import jax

from fusedattn.backends import cudnn, native
from fusedattn.config import AttnConfig

t0 = time.perf_counter()
jax.devices()
m = native.module("cuda")
print(f"jax.devices + extension load: {time.perf_counter() - t0:.3f}s", flush=True)
order = sys.argv[1] if len(sys.argv) > 1 else "128,64:causal,128:causal,256"
for item in order.split(","):
    d, _, mask = item.partition(":")
    d, mask = int(d), mask or "none"
    cfg = AttnConfig(batch=4, s_q=4096, s_kv=4096, h_q=16, h_kv=16, d_qk=d, d_v=d, dtype="bfloat16",
                     scale=d ** -0.5, mask=mask)
    t0 = time.perf_counter()
    r = m.cudnn_check_support(cudnn.graph_key(cfg))
    wall = time.perf_counter() - t0
    print(f"d{d} {mask}: wall {wall:.3f}s ok={r['ok']} build_seconds={dict(r['build_seconds'])} "
          f"plans={dict(r['plan_names'])}", flush=True)
