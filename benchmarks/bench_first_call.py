"""The cost of a config's first call in a fresh process, with and without the
persistent plan cache (fusedattn.plan_cache).

Each measurement is a new Python process (what a new training job pays): it
imports JAX, starts the GPU, then times (a) the cuDNN support probe, which builds
or loads the config's three graphs, and (b) the first jitted forward+backward call
(XLA compilation included), then (c) the first such call with backend="auto": where
FlashAttention-3 runs the config too, it first times both (`backend_choice`). "cold"
runs with an empty cache directory, "warm" with the one the cold run filled. The process's first cuDNN handle is created inside
the probe either way; the "second config" column is a probe of another config
after the first one, which no longer pays for it.

    python -m benchmarks.bench_first_call

Writes benchmarks/results/first_call_<device>.json.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import jax

from benchmarks.common import device_meta, device_slug, print_table, run_main, write_results

# (name, head dim, causal)
CONFIGS = [("d64 causal", 64, True), ("d128", 128, False), ("d128 causal", 128, True),
           ("d256", 256, False)]

CHILD = r"""
import json, sys, time
t_start = time.perf_counter()
import jax, jax.numpy as jnp
import fusedattn
from fusedattn.backends import cudnn
from fusedattn.config import AttnConfig
jax.devices()
d, causal = int(sys.argv[1]), sys.argv[2] == "1"
mask = "causal" if causal else "none"
def config(b):
    return AttnConfig(batch=b, s_q=4096, s_kv=4096, h_q=16, h_kv=16, d_qk=d, d_v=d,
                      dtype="bfloat16", scale=d ** -0.5, mask=mask)
t0 = time.perf_counter()
probe = cudnn.probe(config(4))
probe_s = time.perf_counter() - t0
t0 = time.perf_counter()
other = cudnn.probe(config(2))
second_s = time.perf_counter() - t0
q = jnp.ones((4, 4096, 16, d), jnp.bfloat16)
step = jax.jit(jax.grad(lambda q: jnp.sum(fusedattn.fused_attn(q, q, q, mask=mask,
                                                                backend="cudnn"))))
t0 = time.perf_counter()
jax.block_until_ready(step(q))
call_s = time.perf_counter() - t0
# backend="auto": where flash runs the config too, its first call times both backends
# (fusedattn.dispatch.measure) unless the persistent cache holds the choice.
auto = jax.jit(jax.grad(lambda q: jnp.sum(fusedattn.fused_attn(q, q, q, mask=mask) * 2)))
t0 = time.perf_counter()
jax.block_until_ready(auto(q))
auto_s = time.perf_counter() - t0
print("RESULT" + json.dumps({"ok": probe.ok, "from_plan": probe.from_plan,
                             "probe_s": probe_s, "second_config_probe_s": second_s,
                             "first_step_s": call_s, "auto_first_step_s": auto_s,
                             "notes": probe.plan_notes}))
"""


def child(cache_dir: str, d: int, causal: bool) -> dict:
    env = dict(os.environ, FUSEDATTN_CACHE_DIR=cache_dir)
    env.pop("FUSEDATTN_PLAN_CACHE", None)
    done = subprocess.run([sys.executable, "-c", CHILD, str(d), "1" if causal else "0"],
                          env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def main():
    if jax.default_backend() != "gpu":
        print("bench_first_call: needs a CUDA GPU, skipped")
        return
    meta = device_meta()
    rows = []
    for name, d, causal in CONFIGS:
        with tempfile.TemporaryDirectory() as cache:
            cold = child(cache, d, causal)
            warm = child(cache, d, causal)
        row = {"config": f"b4 s4096 h16 {name}"}
        for label, r in (("cold", cold), ("warm", warm)):
            row[f"{label} probe ms"] = 1e3 * r["probe_s"]
            row[f"{label} 2nd config probe ms"] = 1e3 * r["second_config_probe_s"]
            row[f"{label} first step s"] = r["first_step_s"]
            row[f"{label} auto first step s"] = r["auto_first_step_s"]
            row[f"{label} from plan"] = all(r["from_plan"])
        row["notes"] = "; ".join(n for n in warm["notes"] + cold["notes"] if n)
        rows.append(row)
        print(row, flush=True)
    print_table(rows, [k for k in rows[0] if k != "notes"])
    path = write_results(f"first_call_{device_slug(meta)}", rows, meta)
    print(f"wrote {path}")


if __name__ == "__main__":
    run_main(main)
