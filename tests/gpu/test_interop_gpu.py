"""cupy on the GPU: fused_attn_small_seq on cupy buffers through DLPack with no copy
(examples/small_seq_cupy.py), and cupy as an independent float64 reference for a shape
too large for the NumPy oracle (fp16 inputs; relative tolerance 1e-2, the project's
fp16 standard)."""
from __future__ import annotations

import os
import sys
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy", reason="cupy is the fusedattn[cuda] extra")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))


def _reference(q, k, v, lengths=None, causal=False):
    """Attention in float64 with cupy: q [b, t, h, d], k / v [b, s, h, d]."""
    q64, k64, v64 = (x.astype(cupy.float64) for x in (q, k, v))
    scores = cupy.einsum("bthd,bshd->bhts", q64, k64) / np.sqrt(q.shape[-1])
    t, s = q.shape[1], k.shape[1]
    if causal:
        scores = cupy.where(cupy.tril(cupy.ones((t, s), bool))[None, None], scores, -cupy.inf)
    if lengths is not None:
        keep = cupy.arange(s)[None, :] < lengths[:, None]
        scores = cupy.where(keep[:, None, None, :], scores, -cupy.inf)
    scores -= scores.max(-1, keepdims=True)
    p = cupy.exp(scores)
    p /= p.sum(-1, keepdims=True)
    return cupy.einsum("bhts,bshd->bthd", p, v64)


def _rel(x, ref):
    return float(cupy.linalg.norm(x.astype(cupy.float64) - ref) / cupy.linalg.norm(ref))


def test_small_seq_on_cupy_buffers_without_copies():
    from small_seq_cupy import attend
    n, h, d = 2048, 8, 128
    rng = cupy.random.default_rng(0)
    q = rng.standard_normal((n, 1, h, d), dtype=cupy.float32).astype(cupy.float16)
    k = rng.standard_normal((n, 16, h, d), dtype=cupy.float32).astype(cupy.float16)
    v = rng.standard_normal((n, 16, h, d), dtype=cupy.float32).astype(cupy.float16)
    lengths = rng.integers(1, 17, size=n, dtype=cupy.int32)
    assert jax.dlpack.from_dlpack(q).unsafe_buffer_pointer() == q.data.ptr  # no copy in
    out = attend(q, k, v, lengths)
    assert isinstance(out, cupy.ndarray) and out.shape == q.shape
    plan = fusedattn.small_seq_api.plan_small_seq(*(jax.ShapeDtypeStruct(x.shape, jnp.float16)
                                                    for x in (q, k, v)))
    assert plan.chosen == "small_seq"
    assert _rel(out, _reference(q, k, v, lengths)) <= 1e-2


def test_cudnn_against_the_cupy_float64_reference_at_8k():
    b, s, h, d = 1, 8192, 8, 128
    key = jax.random.PRNGKey(0)
    q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(jnp.float16)
               for kk in jax.random.split(key, 3))
    out = fusedattn.fused_attn(q, k, v, mask="causal", backend="cudnn")
    ref = _reference(*(cupy.from_dlpack(x) for x in (q, k, v)), causal=True)
    assert _rel(cupy.from_dlpack(out), ref) <= 1e-2
