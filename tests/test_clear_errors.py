"""Plausible mistakes get a ValueError / TypeError naming the argument and the rule,
before any kernel runs (issue: a true drop-in)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import fusedattn
from fusedattn import SequenceDescriptor, fp8


def test_rng_must_be_a_prng_key():
    q = jnp.ones((2, 8, 2, 4))
    with pytest.raises(TypeError, match=r"rng must be a JAX PRNG key .* got int 42"):
        fusedattn.fused_attn(q, q, q, dropout=0.1, rng=42)
    with pytest.raises(TypeError, match="rng must be a JAX PRNG key"):
        fusedattn.fused_attn(q, q, q, dropout=0.1, rng=jnp.zeros((3,), jnp.uint32))
    for rng in (jax.random.PRNGKey(0), jax.random.key(0)):
        assert fusedattn.fused_attn(q, q, q, dropout=0.1, rng=rng).shape == q.shape


def test_segment_ids_must_be_2d():
    with pytest.raises(ValueError, match=r"q_segment_ids must be \[batch, seq_len\]"):
        SequenceDescriptor.from_segment_ids(jnp.array([1, 1, 2, 0]), max_segments=2)
    with pytest.raises(TypeError, match="q_segment_ids must be an integer array"):
        SequenceDescriptor.from_segment_ids(jnp.ones((1, 4)), max_segments=2)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_fp8_scales_must_be_finite_and_positive(bad):
    q8 = jnp.ones((1, 16, 2, 16), jnp.float8_e4m3fn)
    scales = fp8.Fp8Scales(*(jnp.float32(1.0) for _ in fp8.Fp8Scales._fields))
    with pytest.raises(ValueError, match="scales.k must be finite and > 0"):
        fp8.attention(q8, q8, q8, scales._replace(k=jnp.float32(bad)))
