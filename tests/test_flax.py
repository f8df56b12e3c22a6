"""fusedattn.flax: the attention_fn inside Flax's attention layers (linen and nnx) gives
Flax's own numbers (fp32, 1e-5), the modules init / apply / grad / jit, and a small
transformer block trains on the CPU (its loss falls over a few Adam steps)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax", reason="the flax extra: pip install fusedattn[flax]")
optax = pytest.importorskip("optax")
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import fusedattn  # noqa: E402
from fusedattn import flax as fa  # noqa: E402

TOL = 1e-5


def _x(seed=0, shape=(2, 16, 32)):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def test_linen_multihead_attention_fn_matches_flax():
    x = _x()
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    ours = nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=fa.attention_fn)
    ref = nn.MultiHeadDotProductAttention(num_heads=4)
    params = ref.init(jax.random.PRNGKey(1), x, mask=mask)
    np.testing.assert_allclose(jax.jit(ours.apply)(params, x, mask=mask),
                               ref.apply(params, x, mask=mask), rtol=TOL, atol=TOL)
    g_ours = jax.grad(lambda p: ours.apply(p, x, mask=mask).sum())(params)
    g_ref = jax.grad(lambda p: ref.apply(p, x, mask=mask).sum())(params)
    for a, b in zip(jax.tree_util.tree_leaves(g_ours), jax.tree_util.tree_leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_nnx_multihead_attention_fn_matches_flax():
    x = _x(2)
    ours = nnx.MultiHeadAttention(num_heads=4, in_features=32, decode=False,
                                  attention_fn=fa.attention_fn, rngs=nnx.Rngs(0))
    ref = nnx.MultiHeadAttention(num_heads=4, in_features=32, decode=False, rngs=nnx.Rngs(0))
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
    np.testing.assert_allclose(ours(x, mask=mask), ref(x, mask=mask), rtol=TOL, atol=TOL)


def test_attention_fn_falls_back_to_flax_for_what_no_kernel_serves(caplog, monkeypatch):
    """Never refuses what Flax accepts: such calls run Flax's own function (the same
    numbers, dropout mask included), say why in fallback_reason and log it once."""
    q, k, v = (_x(i, shape=(2, 8, 2, 4)) for i in range(3))
    rng = jax.random.PRNGKey(0)
    cases = [(dict(dropout_rate=0.1, dropout_rng=rng), "broadcast_dropout"),
             (dict(precision=jax.lax.Precision.HIGHEST), "precision"),
             (dict(precision="highest"), "precision"),
             (dict(force_fp32_for_softmax=True, dtype=jnp.bfloat16), "force_fp32_for_softmax")]
    monkeypatch.setattr(fusedattn.jax_nn, "_LOGGED", set())  # forget earlier tests' logs
    for kwargs, why in cases:
        assert why in fa.fallback_reason(q, k, v, **kwargs)
        caplog.clear()
        with caplog.at_level("WARNING", logger="fusedattn"):
            for _ in range(2):
                np.testing.assert_array_equal(fa.attention_fn(q, k, v, **kwargs),
                                              nn.dot_product_attention(q, k, v, **kwargs))
        assert sum(why in r.getMessage() for r in caplog.records) == 1
    for precision in (None, "default", jax.lax.Precision.DEFAULT):
        assert fa.fallback_reason(q, k, v, precision=precision) is None
    out = fa.attention_fn(q, k, v, dropout_rate=0.1, dropout_rng=rng, broadcast_dropout=False)
    assert out.shape == q.shape
    with jax.enable_x64(True):
        q64 = q.astype(jnp.float64)
        assert "float64" in fa.fallback_reason(q64, q64, q64)
        assert fa.attention_fn(q64, q64, q64).dtype == jnp.float64


def test_attention_weights_through_flax():
    """sow_weights (module=) runs Flax's function, which sows them, for linen and nnx."""
    x = _x()
    layer = nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=fa.attention_fn)
    params = layer.init(jax.random.PRNGKey(1), x)
    _, state = layer.apply(params, x, sow_weights=True, mutable=["intermediates"])
    (weights,) = state["intermediates"]["attention_weights"]
    assert weights.shape == (2, 4, 16, 16)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
    mha = nnx.MultiHeadAttention(num_heads=4, in_features=32, decode=False,
                                 attention_fn=fa.attention_fn, rngs=nnx.Rngs(0))
    _, captured = nnx.capture(lambda m: m(x, sow_weights=True), nnx.Intermediate)(mha)
    assert "attention_weights" in str(jax.tree_util.tree_structure(captured))


def test_mask_and_is_causal_rows_that_see_nothing_average_all_values():
    """A row the mask hides entirely averages all values under is_causal, as in Flax."""
    q, k, v = (_x(i, shape=(1, 4, 2, 8)) for i in range(3))
    mask = jnp.ones((1, 1, 4, 4), bool).at[..., 2, :].set(False)
    ref = nnx.dot_product_attention(q, k, v, mask=mask, is_causal=True)
    np.testing.assert_allclose(fa.attention_fn(q, k, v, mask=mask, is_causal=True), ref,
                               rtol=TOL, atol=TOL)
    np.testing.assert_allclose(ref[0, 2], v[0].mean(0), rtol=TOL, atol=TOL)


def test_linen_module_options_params_and_dropout():
    q, k, v = (_x(i, (2, 16, 4, 8)) for i in range(3))
    mod = fa.DotProductAttention(mask="causal", softmax="learnable", dropout=0.2)
    variables = mod.init(jax.random.PRNGKey(0), q, k, v, deterministic=True)
    assert variables["params"]["softmax_offset"].shape == (4,)
    det = mod.apply(variables, q, k, v, deterministic=True)
    ref = fusedattn.fused_attn(q, k, v, mask="causal", softmax="learnable",
                               softmax_offset=jnp.zeros((4,)))
    np.testing.assert_allclose(det, ref, rtol=TOL, atol=TOL)
    dropped = mod.apply(variables, q, k, v, rngs={"dropout": jax.random.PRNGKey(3)})
    assert not np.allclose(dropped, det)
    grads = jax.grad(lambda p: mod.apply({"params": p}, q, k, v, deterministic=True).sum())(
        variables["params"])
    assert np.all(np.isfinite(grads["softmax_offset"])) and np.any(grads["softmax_offset"] != 0)


def test_nnx_module():
    q, k, v = (_x(i, (2, 16, 4, 8)) for i in range(3))
    mod = fa.NnxDotProductAttention(num_heads=4, mask="causal", softmax="learnable")
    out = nnx.jit(lambda m, q, k, v: m(q, k, v))(mod, q, k, v)
    ref = fusedattn.fused_attn(q, k, v, mask="causal", softmax="learnable",
                               softmax_offset=jnp.zeros((4,)))
    np.testing.assert_allclose(out, ref, rtol=TOL, atol=TOL)
    grads = nnx.grad(lambda m: m(q, k, v).sum())(mod)
    assert grads.softmax_offset[...].shape == (4,)


class _Block(nn.Module):
    """A pre-norm transformer block with fusedattn attention."""

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=fa.attention_fn)(
            h, mask=mask)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(4 * x.shape[-1])(h)))


def test_transformer_block_trains():
    x = _x(5, (4, 16, 32))
    target = jnp.roll(x, 1, axis=1)
    block = _Block()
    params = block.init(jax.random.PRNGKey(0), x)
    opt = optax.adam(1e-2)
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((block.apply(p, x) - target) ** 2))(
            params)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(params, updates), state, loss
    losses = []
    for _ in range(8):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0], losses
