"""How many key chunks should the causal FP8 backward run in (fusedattn.fp8_chunks)?

Causal forward+backward, timed round-robin in one process: precision="fp8" and the
explicit FP8 kernels (fp8.attention on FP8 tensors) with the backward in n = 1 (one
call), 2, 4 and 8 key chunks, beside our BF16 cuDNN step. TFLOP/s count the BF16
FLOPs of a causal step (halved).

    python benchmarks/tune/fp8_causal_chunks.py
"""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from common import fwd_bwd, time_interleaved, warmed  # noqa: E402

import fusedattn  # noqa: E402
from fusedattn import fp8, fp8_chunks  # noqa: E402
from fusedattn.config import AttnConfig  # noqa: E402

SHAPES = [(4, 4096, 16, 128), (1, 16384, 16, 128), (8, 2048, 16, 128)]


def traced_with_chunks(n: int, fn, *args):
    """`fn` jitted and compiled with the backward in `n` chunks (read at trace time)."""
    os.environ[fp8_chunks.ENV_CHUNKS] = str(n)
    try:
        return warmed(fn, *args)
    finally:
        del os.environ[fp8_chunks.ENV_CHUNKS]


def main():
    for b, s, h, d in SHAPES:
        key = jax.random.PRNGKey(0)
        q, k, v, do = (jax.random.normal(jax.random.fold_in(key, i), (b, s, h, d), jnp.bfloat16)
                       for i in range(4))
        scales, _ = fp8.forward_scales(q, k, v)
        scales = scales._replace(do=fp8.scale_for(fp8.amax(do)), dq=jnp.float32(1.0),
                                 dk=jnp.float32(1.0), dv=jnp.float32(1.0), dp=jnp.float32(1.0))
        q8, k8, v8 = (fp8.quantize(x, s_) for x, s_ in ((q, scales.q), (k, scales.k),
                                                          (v, scales.v)))
        do8 = fp8.quantize(do, scales.do)

        def current(q, k, v):
            return fusedattn.fused_attn(q, k, v, mask="causal", precision="fp8", backend="cudnn")

        def explicit(q8, k8, v8):
            return fp8.attention(q8, k8, v8, scales, mask="causal", backend="cudnn")[0]
        calls = {"bf16 cudnn": (warmed(fwd_bwd(lambda q, k, v: fusedattn.fused_attn(
            q, k, v, mask="causal", backend="cudnn")), q, k, v, do), (q, k, v, do))}
        for n in (1, 2, 4, 8):
            calls[f"precision=fp8 n={n}"] = (traced_with_chunks(n, fwd_bwd(current), q, k, v, do),
                                             (q, k, v, do))
            calls[f"fp8 kernels n={n}"] = (traced_with_chunks(n, fwd_bwd(explicit), q8, k8, v8, do8),
                                           (q8, k8, v8, do8))
        flops = AttnConfig(batch=b, s_q=s, s_kv=s, h_q=h, h_kv=h, d_qk=d, d_v=d, dtype="bfloat16",
                           mask="causal").flops(backward=True)
        print(f"b{b} s{s} h{h} d{d} causal fwd+bwd", flush=True)
        for name, sec in time_interleaved(calls).items():
            print(f"  {flops / sec / 1e12:7.1f} TFLOP/s  {sec * 1e3:7.3f} ms  {name}", flush=True)


if __name__ == "__main__":
    main()
