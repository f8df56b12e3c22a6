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


def test_checked_mode_raises_on_bad_traced_values(monkeypatch):
    """Under jit lengths, offsets and scales are traced: checked mode
    (FUSEDATTN_CHECK_TRACED=1) runs the eager checks when the program runs."""
    q = jnp.ones((1, 16, 2, 8))
    seqlens, offsets = jnp.array([[8, 8]]), jnp.array([[0, 4]])  # overlapping segments

    def packed(q, seqlens, offsets):
        seq = SequenceDescriptor.from_seqlens_offsets(seqlens, offsets, q_len=16)
        return fusedattn.fused_attn(q, q, q, sequence=seq)
    with pytest.raises(ValueError, match="back to back"):
        packed(q, seqlens, offsets)  # eager: checked now
    jax.jit(packed)(q, seqlens, offsets)  # traced: not checked by default
    monkeypatch.setenv("FUSEDATTN_CHECK_TRACED", "1")  # read when tracing: a new function
    with pytest.raises(Exception, match="back to back"):
        jax.block_until_ready(jax.jit(lambda *a: packed(*a))(q, seqlens, offsets))
    lengths = jnp.array([20], jnp.int32)
    with pytest.raises(Exception, match=r"q_lengths must lie in \[0, 16\]"):
        jax.block_until_ready(jax.jit(lambda q, n: fusedattn.fused_attn(
            q, q, q, sequence=SequenceDescriptor.from_lengths(n)))(q, lengths))
    q8 = jnp.ones((1, 16, 2, 16), jnp.float8_e4m3fn)
    scales = fp8.Fp8Scales(*(jnp.float32(1.0) for _ in fp8.Fp8Scales._fields))
    with pytest.raises(Exception, match="scales.v must be finite and > 0"):
        jax.block_until_ready(jax.jit(lambda s: fp8.attention(q8, q8, q8, s)[0])(
            scales._replace(v=jnp.float32(0.0))))
