"""The XLA backend on the CPU: speed next to jax.nn.dot_product_attention, and
the long-sequence case's peak memory.

* b2 s1024 h8 d64 (fp32 and bf16, no mask and causal): forward and
  forward+backward of ``fused_attn(backend="xla")`` against
  ``jax.nn.dot_product_attention(implementation="xla")``. The two are timed in
  alternation, round after round, so load from other processes hits both alike.
* b1 s16384 h8 d64 forward+backward in a child process
  (benchmarks/long_sequence.py), reporting its peak RSS and the size the dense
  fp32 score matrix would have.

    python -m benchmarks.bench_cpu            # writes benchmarks/results/cpu_xla.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import jax
import jax.numpy as jnp

import fusedattn
from benchmarks import common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fns(causal: bool):
    def ours(q, k, v):
        return fusedattn.fused_attn(q, k, v, mask="causal" if causal else "none", backend="xla")

    def ref(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

    def fwd_bwd(f):
        def loss(q, k, v, d_out):
            out, vjp = jax.vjp(f, q, k, v)
            return vjp(d_out)
        return jax.jit(loss)
    return {"ours": (jax.jit(ours), fwd_bwd(ours)), "ref": (jax.jit(ref), fwd_bwd(ref))}


def _paired(fns: dict, args, rounds: int, reps: int) -> dict:
    """Median seconds per call of each fn, timing them in alternation."""
    for f in fns.values():
        common.time_fn(f, *args, warmup=2, reps=1, rounds=1)
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            samples[name].append(common.time_fn(f, *args, warmup=0, reps=reps, rounds=1))
    return {name: statistics.median(s) for name, s in samples.items()}


def speed_rows(batch=2, seq=1024, heads=8, dim=64, rounds=7, reps=3):
    rows = []
    for dtype in ("float32", "bfloat16"):
        keys = jax.random.split(jax.random.PRNGKey(0), 4)
        q, k, v, d_out = (jax.random.normal(key, (batch, seq, heads, dim), jnp.float32).astype(dtype)
                          for key in keys)
        for causal in (False, True):
            fns = _fns(causal)
            fwd = _paired({n: f[0] for n, f in fns.items()}, (q, k, v), rounds, reps)
            both = _paired({n: f[1] for n, f in fns.items()}, (q, k, v, d_out), rounds, reps)
            for phase, t in (("fwd", fwd), ("fwd+bwd", both)):
                rows.append({"case": f"b{batch} s{seq} h{heads} d{dim}", "dtype": dtype,
                             "mask": "causal" if causal else "none", "phase": phase,
                             "xla_backend_ms": t["ours"] * 1e3, "jax_nn_ms": t["ref"] * 1e3,
                             "ratio": t["ours"] / t["ref"]})
    return rows


def long_sequence_row(seq=16384, heads=8, dim=64) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.long_sequence", "--seq", str(seq),
                          "--heads", str(heads), "--dim", str(dim)],
                         cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-long", action="store_true", help="skip the long-sequence memory run")
    ap.add_argument("--out", default=common.RESULTS_DIR)
    a = ap.parse_args(argv)

    meta = common.device_meta()
    meta["cpu_count"] = os.cpu_count()
    meta.update(common.measure_ceilings())
    rows = speed_rows(rounds=a.rounds)
    print("XLA backend vs jax.nn.dot_product_attention(implementation='xla'), median ms")
    common.print_table(rows, ["case", "dtype", "mask", "phase", "xla_backend_ms", "jax_nn_ms", "ratio"])
    if not a.no_long:
        long = long_sequence_row()
        gib = 1024 ** 3
        print(f"\nlong sequence b{long['batch']} s{long['seq']} h{long['heads']} d{long['dim']} "
              f"{long['dtype']} fwd+bwd: {long['fwd_bwd_seconds']:.1f} s, peak RSS "
              f"{long['peak_rss_bytes'] / gib:.2f} GiB during the call, runtime and arrays "
              f"included (dense fp32 scores alone: "
              f"{long['dense_fp32_scores_bytes'] / gib:.0f} GiB); checks {long['checks']}")
        rows.append(dict(long, case="long_sequence"))
    path = common.write_results("cpu_xla", rows, meta, a.out)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
