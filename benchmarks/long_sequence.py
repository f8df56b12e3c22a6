"""One forward+backward of the XLA backend on a long sequence, in its own process.

Run as a child (by tests/test_long_sequence.py and benchmarks/bench_cpu.py) so
that its peak resident memory is this process's alone; the peak is reset after
compilation (Linux ``clear_refs``), so it covers the call with its inputs,
outputs and the JAX runtime, not the compiler. Prints one
JSON line: the shape, the wall time, the peak RSS next to the size a dense
score matrix would take, and correctness checks that need no dense matrix:

* output and dq of a few query rows against float64 NumPy;
* sum over keys of dv == sum over queries of dO (rows of P sum to 1);
* sum over keys of dk == 0 (each row of dS sums to 0).

    python -m benchmarks.long_sequence --seq 16384 --heads 8 --dim 64
"""
from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np


def _peak_rss_bytes() -> int:
    """Peak RSS since the last `_reset_peak_rss` (Linux VmHWM), else since process start."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _reset_peak_rss() -> bool:
    """Restart the peak at the current RSS (Linux: write 5 to clear_refs), so compilation
    and setup do not count; False where unsupported (the peak then covers them too)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _row_reference(q, k, v, d_out, rows, scale):
    """Output and dq of the given query rows, float64, vanilla softmax, no mask."""
    outs, dqs = [], []
    for i in rows:
        s = scale * np.einsum("bhd,bkhd->bhk", q[:, i], k)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("bhk,bkhd->bhd", p, v)
        dp = np.einsum("bhd,bkhd->bhk", d_out[:, i], v)
        ds = p * (dp - np.sum(p * dp, -1, keepdims=True))
        outs.append(o)
        dqs.append(scale * np.einsum("bhk,bkhd->bhd", ds, k))
    return np.stack(outs, 1), np.stack(dqs, 1)


def _rel(x, ref) -> float:
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def run(batch: int, seq: int, heads: int, dim: int, dtype: str, mask: str) -> dict:
    import jax
    import jax.numpy as jnp
    import fusedattn

    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    shape = (batch, seq, heads, dim)
    q, k, v, d_out = (jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys)
    scale = dim ** -0.5

    @jax.jit
    def fwd_bwd(q, k, v, d_out):
        out, vjp = jax.vjp(lambda q, k, v: fusedattn.fused_attn(
            q, k, v, mask=mask, scale=scale, backend="xla"), q, k, v)
        return (out,) + vjp(d_out)

    compiled = fwd_bwd.lower(q, k, v, d_out).compile()
    peak_setup = _peak_rss_bytes()
    call_only = _reset_peak_rss()
    start = time.perf_counter()
    out, dq, dk, dv = jax.block_until_ready(compiled(q, k, v, d_out))
    seconds = time.perf_counter() - start
    peak = _peak_rss_bytes()

    f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)  # noqa: E731
    q, k, v, d_out, out, dq, dk, dv = map(f64, (q, k, v, d_out, out, dq, dk, dv))
    checks = {"finite": bool(all(np.isfinite(x).all() for x in (out, dq, dk, dv)))}
    if mask == "none":
        rows = [0, seq // 3, seq - 1]
        ref_out, ref_dq = _row_reference(q, k, v, d_out, rows, scale)
        checks["rows_out_rel_error"] = _rel(out[:, rows], ref_out)
        checks["rows_dq_rel_error"] = _rel(dq[:, rows], ref_dq)
        checks["dv_sum_rel_error"] = _rel(dv.sum(1), d_out.sum(1))
    checks["dk_sum_over_abs"] = float(np.abs(dk.sum(1)).max() / np.abs(dk).sum(1).max())
    dense = batch * heads * seq * seq * 4
    return {"batch": batch, "seq": seq, "heads": heads, "dim": dim, "dtype": dtype, "mask": mask,
            "fwd_bwd_seconds": seconds, "peak_rss_bytes": peak, "peak_is_call_only": call_only,
            "peak_rss_setup_and_compile_bytes": peak_setup, "dense_fp32_scores_bytes": dense,
            "checks": checks}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--mask", default="none", choices=["none", "causal"])
    a = ap.parse_args(argv)
    print(json.dumps(run(a.batch, a.seq, a.heads, a.dim, a.dtype, a.mask)))


if __name__ == "__main__":
    main()
