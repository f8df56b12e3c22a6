"""How many (batch, head) pairs should one call of cuDNN's causal FP8 backward take
(backends/cudnn/fp8.py, CAUSAL_BACKWARD_PAIRS)?

Causal forward+backward, timed round-robin in one process: precision="fp8" and the
explicit FP8 kernels (fp8.attention on FP8 tensors), with the backward as one call
(limit 0) or in calls of at most 16 / 32 pairs, beside our BF16 cuDNN step. TFLOP/s
count the BF16 FLOPs of a causal step (halved).

    python -m benchmarks.tune.fp8_causal_pairs
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp

import fusedattn
from benchmarks.bench_fp8 import explicit_inputs
from benchmarks.common import fwd_bwd, time_interleaved, warmed
from fusedattn import fp8
from fusedattn.backends.cudnn import fp8 as cudnn_fp8
from fusedattn.config import AttnConfig

SHAPES = [(4, 4096, 16, 16), (8, 2048, 16, 16), (16, 4096, 16, 16), (4, 4096, 32, 8),
          (1, 16384, 16, 16)]
LIMITS = (0, 16, 32)


def compiled_with_limit(limit: int, fn, *args):
    """`fn` compiled and warmed with calls of at most `limit` pairs (read at lowering)."""
    os.environ[cudnn_fp8.ENV_CAUSAL_PAIRS] = str(limit)
    try:
        return warmed(fn, *args)
    finally:
        del os.environ[cudnn_fp8.ENV_CAUSAL_PAIRS]


def main():
    for b, s, h, h_kv in SHAPES:
        key = jax.random.PRNGKey(0)
        q, do = (jax.random.normal(jax.random.fold_in(key, i), (b, s, h, 128), jnp.bfloat16)
                 for i in (0, 3))
        k, v = (jax.random.normal(jax.random.fold_in(key, i), (b, s, h_kv, 128), jnp.bfloat16)
                for i in (1, 2))
        scales, (q8, k8, v8, do8) = explicit_inputs(q, k, v, do)

        def current(q, k, v):
            return fusedattn.fused_attn(q, k, v, mask="causal", precision="fp8", backend="cudnn")

        def explicit(q8, k8, v8):
            return fp8.attention(q8, k8, v8, scales, mask="causal", backend="cudnn")[0]
        calls = {"bf16 cudnn": (warmed(fwd_bwd(lambda q, k, v: fusedattn.fused_attn(
            q, k, v, mask="causal", backend="cudnn")), q, k, v, do), (q, k, v, do))}
        for limit in LIMITS:
            calls[f"precision=fp8 pairs<={limit}"] = (
                compiled_with_limit(limit, fwd_bwd(current), q, k, v, do), (q, k, v, do))
            calls[f"fp8 kernels pairs<={limit}"] = (
                compiled_with_limit(limit, fwd_bwd(explicit), q8, k8, v8, do8),
                (q8, k8, v8, do8))
        flops = AttnConfig(batch=b, s_q=s, s_kv=s, h_q=h, h_kv=h_kv, d_qk=128, d_v=128,
                           dtype="bfloat16", mask="causal").flops(backward=True)
        print(f"b{b} s{s} h{h}/{h_kv} d128 causal fwd+bwd (pairs<=0: one call)", flush=True)
        for name, sec in time_interleaved(calls).items():
            print(f"  {flops / sec / 1e12:7.1f} TFLOP/s  {sec * 1e3:7.3f} ms  {name}", flush=True)


if __name__ == "__main__":
    main()
