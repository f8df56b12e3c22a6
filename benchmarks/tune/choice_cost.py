"""Where does a cold `backend="auto"` first call spend its time? Runs the phases of
`backend_choice._measure` one by one in this (fresh) process and times each:
loading the rival backends and compiling their four steps side by side; then the
whole measurement (compiling anew, then warm-up and timed rounds) with the kernels
already loaded.

    python benchmarks/tune/choice_cost.py [d] [causal 0/1]     (b4 s4096 h16, default d128)
"""
from __future__ import annotations

import concurrent.futures
import sys
import time

t_start = time.perf_counter()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from fusedattn import backend_choice as bc  # noqa: E402
from fusedattn.backends.base import AttnInputs  # noqa: E402
from fusedattn.config import AttnConfig  # noqa: E402
from fusedattn.dispatch import load_backend  # noqa: E402


def main():
    d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    causal = len(sys.argv) > 2 and sys.argv[2] == "1"
    config = AttnConfig(batch=4, s_q=4096, s_kv=4096, h_q=16, h_kv=16, d_qk=d, d_v=d,
                        dtype="bfloat16", mask="causal" if causal else "none")
    jnp.zeros(1).block_until_ready()
    phases = {"import + GPU start": time.perf_counter() - t_start}
    t = time.perf_counter()
    backends = {name: load_backend(name) for name in ("cudnn", "flash")}
    phases["load backends"] = time.perf_counter() - t
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    shape = (4, 4096, 16, d)
    q, k, v, do = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
    steps = []
    for name, backend in backends.items():
        def attend(q, k, v, backend=backend):
            return backend.attention(config, AttnInputs(q, k, v))

        def train(q, k, v, d_out, attend=attend):
            return jax.vjp(attend, q, k, v)[1](d_out)
        steps += [(jax.jit(attend), (q, k, v)), (jax.jit(train), (q, k, v, do))]
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(steps)) as pool:
        list(pool.map(lambda s: bc._compiled(*s), steps))
    phases["compile 4 steps side by side (and run each once)"] = time.perf_counter() - t
    t = time.perf_counter()
    bc._measure(config, ("cudnn", "flash"))
    phases["whole measurement again (kernels loaded, steps compiled anew)"] = time.perf_counter() - t
    print(f"b4 s4096 h16 d{d} causal={causal}")
    for name, sec in phases.items():
        print(f"  {sec:6.3f} s  {name}")


if __name__ == "__main__":
    main()
