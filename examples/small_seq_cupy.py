"""Serving with cupy arrays: fused_attn_small_seq on buffers a cupy pipeline owns,
with no copy either way (DLPack). Runs on a CUDA GPU with cupy installed
(``pip install fusedattn[cuda]``); on ROCm the same code runs with cupy's ROCm build.

    python examples/small_seq_cupy.py
"""
from __future__ import annotations

import cupy
import jax

import fusedattn


def attend(q, k, v, lengths):
    """q [n, 1, h, d], k / v [n, 16, h_kv, d], lengths [n] int32: cupy arrays in, a cupy
    array out; JAX reads and writes the same device memory (DLPack)."""
    as_jax = jax.dlpack.from_dlpack
    out = fusedattn.fused_attn_small_seq(as_jax(q), as_jax(k), as_jax(v), sequence=as_jax(lengths))
    return cupy.from_dlpack(out)


if __name__ == "__main__":
    n, h, d = 30720, 8, 128
    rng = cupy.random.default_rng(0)
    q = rng.standard_normal((n, 1, h, d), dtype=cupy.float32).astype(cupy.float16)
    k = rng.standard_normal((n, 16, h, d), dtype=cupy.float32).astype(cupy.float16)
    v = rng.standard_normal((n, 16, h, d), dtype=cupy.float32).astype(cupy.float16)
    lengths = rng.integers(1, 17, size=n, dtype=cupy.int32)
    out = attend(q, k, v, lengths)
    print(type(out).__name__, out.shape, out.dtype, "finite:", bool(cupy.isfinite(out).all()))
