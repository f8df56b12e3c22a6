"""First support probe of fresh cuDNN configs: wall time and the per-graph build split."""
import time

from fusedattn.backends import cudnn, native
from fusedattn.config import AttnConfig

m = native.module("cuda")
for d, mask in ((128, "none"), (64, "causal"), (128, "causal"), (256, "none")):
    cfg = AttnConfig(batch=4, s_q=4096, s_kv=4096, h_q=16, h_kv=16, d_qk=d, d_v=d, dtype="bfloat16",
                     scale=d ** -0.5, mask=mask)
    t0 = time.perf_counter()
    r = m.cudnn_check_support(cudnn.graph_key(cfg))
    wall = time.perf_counter() - t0
    print(f"d{d} {mask}: wall {wall:.3f}s {dict((k, v) for k, v in r.items() if k != 'workspace')}", flush=True)
