"""The public API composes with jit, vmap, grad and export, and keeps its contracts."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn
from fusedattn import SequenceDescriptor

B, S, H, D = 2, 24, 4, 16


def randn(key, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(key), shape, dtype)


@pytest.fixture
def qkv():
    return randn(0, (B, S, H, D)), randn(1, (B, S, 2, D)), randn(2, (B, S, 2, D))


def test_output_shape_and_dtype():
    q, k, v = randn(0, (B, S, H, D), jnp.bfloat16), randn(1, (B, 40, 2, D), jnp.bfloat16), \
        randn(2, (B, 40, 2, 8), jnp.bfloat16)
    out = fusedattn.fused_attn(q, k, v)
    assert out.shape == (B, S, H, 8) and out.dtype == jnp.bfloat16
    out_sb = fusedattn.fused_attn(*(jnp.swapaxes(x, 0, 1) for x in (q, k, v)), layout="sbhd")
    assert out_sb.shape == (S, B, H, 8)
    np.testing.assert_allclose(np.asarray(jnp.swapaxes(out_sb, 0, 1), np.float32),
                               np.asarray(out, np.float32), rtol=2e-2, atol=2e-2)


def test_jit_matches_eager(qkv):
    eager = fusedattn.fused_attn(*qkv, mask="causal")
    jitted = jax.jit(lambda q, k, v: fusedattn.fused_attn(q, k, v, mask="causal"))(*qkv)
    np.testing.assert_allclose(jitted, eager, rtol=1e-5, atol=1e-6)


def test_vmap_matches_a_loop(qkv):
    stack = [jnp.stack([x, 2 * x]) for x in qkv]  # an extra leading axis of 2
    f = lambda q, k, v: fusedattn.fused_attn(q, k, v, mask="causal")
    batched = jax.vmap(f)(*stack)
    for i in range(2):
        np.testing.assert_allclose(batched[i], f(*(x[i] for x in stack)), rtol=1e-5, atol=1e-6)


def test_grad_of_jit_and_jit_of_grad_agree(qkv):
    loss = lambda q, k, v: jnp.sum(fusedattn.fused_attn(q, k, v, mask="causal") ** 2)
    g1 = jax.grad(jax.jit(loss), argnums=(0, 1, 2))(*qkv)
    g2 = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*qkv)
    for a, b in zip(g1, g2):
        assert a.shape == b.shape and np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)  # fp32 rounding, two fusions


def test_sequence_descriptor_is_a_traced_pytree(qkv):
    """Lengths are traced: one compilation serves different lengths."""
    traces = []

    @jax.jit
    def f(q, k, v, seq):
        traces.append(1)
        return fusedattn.fused_attn(q, k, v, sequence=seq)

    a = f(*qkv, SequenceDescriptor.from_lengths(jnp.array([5, 24]), jnp.array([7, 20])))
    b = f(*qkv, SequenceDescriptor.from_lengths(jnp.array([9, 1]), jnp.array([3, 3])))
    assert len(traces) == 1
    assert np.all(np.asarray(a)[0, 5:] == 0) and np.all(np.asarray(b)[1, 1:] == 0)


def test_vmap_over_sequence_descriptors(qkv):
    lengths = jnp.array([[5, 24], [9, 1]])
    f = lambda lq: fusedattn.fused_attn(*qkv, sequence=SequenceDescriptor.from_lengths(lq))
    batched = jax.vmap(f)(lengths)
    for i in range(2):
        np.testing.assert_allclose(batched[i], f(lengths[i]), rtol=1e-5, atol=1e-6)


def test_lowering_needs_no_device(qkv):
    """Tracing and lowering go through jax.export with no device data."""
    from jax import export
    f = jax.jit(lambda q, k, v: fusedattn.fused_attn(q, k, v, mask="causal"))
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in qkv]
    exported = export.export(f)(*shapes)
    np.testing.assert_allclose(exported.call(*qkv), f(*qkv), rtol=1e-5, atol=1e-6)


def test_explain_accepts_shapes_and_prints_a_table():
    q = jax.ShapeDtypeStruct((B, S, H, D), jnp.float16)
    plan = fusedattn.explain(q, q, q, mask="causal", window=(8, 0))
    assert plan.chosen == "xla"
    text = str(plan)
    assert "causal" in text and "window(8, 0)" in text and "xla" in text
