"""`fusedattn.dot_product_attention` against `jax.nn.dot_product_attention(implementation=
"xla")` on the cases of JAX's own tests (tests/nn_test.py: testDotProductAttention,
testDotProductAttentionMask, testDotProductAttentionBiasGradient and the local-window
case), forward and vjp, with JAX's tolerances (bf16 / fp16: 0.01, mask gradients 0.02,
bias gradient 0.1), plus argument errors and jax.nn's edge cases (rows that see no key,
rank < 4, an empty batch).

ci/conformance.sh runs this file again with ``jax.nn.dot_product_attention`` replaced by
fusedattn's (tests/conformance/jax_dropin.py); the reference stays jax.nn's own function.
"""
from __future__ import annotations

import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

import fusedattn

# jax.nn's own function, also when a conformance run has replaced the name by fusedattn's.
JAX_NN = getattr(sys.modules.get("jax_dropin"), "ORIGINAL", jax.nn.dot_product_attention)
B, S, T, N, H = 2, 128, 128, 4, 32
# float32: on a GPU XLA multiplies f32 in TF32 by default, so both jax.nn's own function
# and ours sit about 1e-3 from float64 there (measured on an H200, ours the closer).
F32_TOL = 1e-5 if jax.default_backend() == "cpu" else 5e-3


def _close(a, b, tol):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("use_vmap", [False, True])
@pytest.mark.parametrize("group_num", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gqa_forward_vjp_and_residual(dtype, group_num, use_vmap):
    keys = random.split(random.PRNGKey(0), 5)
    G = group_num
    q = random.normal(keys[0], (B, T, N, H), dtype)
    k = random.normal(keys[1], (B, S, N // G, H), dtype)
    v = random.normal(keys[2], (B, S, N // G, H), dtype)
    grad = random.normal(keys[3], (B, T, N, H), dtype)
    ours = fusedattn.dot_product_attention
    if use_vmap:
        ours = jax.vmap(ours, in_axes=(0, 0, 0, None, None), out_axes=0)
    k_ref, v_ref = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    out_ref, vjp_ref = jax.vjp(partial(JAX_NN, implementation="xla"),
                               q, k_ref, v_ref, None, None)
    out, vjp = jax.vjp(ours, q, k, v, None, None)
    dq_ref, dk_ref, dv_ref = vjp_ref(grad)[:3]
    dq, dk, dv = vjp(grad)[:3]
    _close(out, out_ref, .01)
    _close(dq, dq_ref, .01)
    _close(dk, dk_ref.reshape(B, S, N // G, G, H).sum(3), .01)
    _close(dv, dv_ref.reshape(B, S, N // G, G, H).sum(3), .01)
    (o_lse, lse), _ = jax.vjp(partial(fusedattn.dot_product_attention, return_residual=True),
                              q, k, v)
    (o_lse_ref, lse_ref), _ = jax.vjp(partial(JAX_NN, return_residual=True),
                                      q, k_ref, v_ref)
    _close(o_lse, o_lse_ref, .01)
    _close(lse, lse_ref, .01)


@pytest.mark.parametrize("mask_mode", [
    ("bias",), ("causal",), ("padding",), ("custom",), ("causal", "padding"),
    ("custom", "padding"), ("bias", "causal"), ("causal", "sliding_window")])
def test_masks_forward_and_gradients(mask_mode):
    dtype = jnp.bfloat16
    keys = random.split(random.PRNGKey(0), 5)
    q = random.normal(keys[0], (B, T, N, H), dtype)
    k = random.normal(keys[1], (B, S, N, H), dtype)
    v = random.normal(keys[2], (B, S, N, H), dtype)
    grad = random.normal(keys[3], (B, T, N, H), dtype)
    bias = mask = q_len = kv_len = window = None
    causal = "causal" in mask_mode
    if "padding" in mask_mode:
        q_len = jnp.array([T // 2, T // 4], jnp.int32)
        kv_len = jnp.array([S // 4, S // 2], jnp.int32)
    if "custom" in mask_mode:
        mask = jnp.tril(jnp.ones((T, S), jnp.bool_))[None, None]
    if "bias" in mask_mode:
        bias = random.normal(keys[4], (1, N, T, S), dtype)
    if "sliding_window" in mask_mode:
        window = (3, 2) if causal else (3, 0)

    def call(fn, q, k, v, b, m):
        return fn(q, k, v, b, m, is_causal=causal, query_seq_lengths=q_len,
                  key_value_seq_lengths=kv_len, local_window_size=window)
    out_ref, vjp_ref = jax.vjp(partial(call, partial(JAX_NN,
                                                     implementation="xla")), q, k, v, bias, mask)
    out, vjp = jax.vjp(partial(call, fusedattn.dot_product_attention), q, k, v, bias, mask)
    _close(out, out_ref, .01)
    got, ref = vjp(grad), vjp_ref(grad)
    for name, i, tol in (("dq", 0, .02), ("dk", 1, .02), ("dv", 2, .01), ("dbias", 3, .02)):
        if got[i] is None or ref[i] is None:
            assert got[i] is None and ref[i] is None, name
            continue
        _close(got[i], ref[i], tol)


@pytest.mark.parametrize("use_vmap", [False, True])
@pytest.mark.parametrize("batch_size", [1, 16])
def test_bias_gradient(batch_size, use_vmap):
    keys = random.split(random.PRNGKey(0), 2)
    x = random.normal(keys[0], (batch_size, S, N, H), jnp.bfloat16)
    bias = random.normal(keys[1], (batch_size, N, S, S), jnp.bfloat16)
    mask = jnp.ones((1, 1, S), jnp.bool_)

    def attention(fn, x, bias, mask):
        return fn(x, x, x, bias, mask, is_causal=False)
    ref = partial(attention, partial(JAX_NN, implementation="xla"))
    ours = partial(attention, fusedattn.dot_product_attention)
    if use_vmap:
        ref, ours = (jax.vmap(f, in_axes=(0, 0, None)) for f in (ref, ours))
    _close(jax.jit(ours)(x, bias, mask), jax.jit(ref)(x, bias, mask), .01)
    d_ref = jax.jit(lambda x, b, m: jax.vjp(ref, x, b, m)[1](x))(x, bias, mask)[1]
    d_ours = jax.jit(lambda x, b, m: jax.vjp(ours, x, b, m)[1](x))(x, bias, mask)[1]
    _close(d_ours, d_ref, .1)


def test_local_window_without_mask_matters():
    keys = random.split(random.PRNGKey(0), 3)
    q, k, v = (random.normal(kk, (B, S, N, H), jnp.float32) for kk in keys)
    large = fusedattn.dot_product_attention(q, k, v, local_window_size=(32, 32))
    small = fusedattn.dot_product_attention(q, k, v, local_window_size=(1, 1))
    assert not np.allclose(large, small)
    _close(small, JAX_NN(q, k, v, local_window_size=(1, 1)), F32_TOL)


def test_unbatched_and_fully_masked_rows_match_jax():
    """3-d inputs; rows a boolean mask hides entirely average the values, as jax.nn does."""
    keys = random.split(random.PRNGKey(1), 3)
    q, k, v = (random.normal(kk, (16, 2, 8), jnp.float32) for kk in keys)
    mask = jnp.ones((16, 16), jnp.bool_).at[3].set(False)[None]
    _close(fusedattn.dot_product_attention(q, k, v, mask=mask),
           JAX_NN(q, k, v, mask=mask), F32_TOL)


def test_argument_errors_name_the_argument():
    q = jnp.ones((2, 8, 2, 4))
    with pytest.raises(TypeError, match="mask must be a boolean"):
        fusedattn.dot_product_attention(q, q, q, mask=jnp.ones((1, 1, 8, 8)))
    with pytest.raises(ValueError, match="implementation"):
        fusedattn.dot_product_attention(q, q, q, implementation="triton")
    with pytest.raises(ValueError, match="query_seq_lengths"):
        fusedattn.dot_product_attention(q, q, q, query_seq_lengths=jnp.ones((3,), jnp.int32))
    with pytest.raises(ValueError, match="does not broadcast"):
        fusedattn.dot_product_attention(q, q, q, bias=jnp.ones((1, 3, 8, 8)))


def test_float64_runs_jax_nn_itself_without_inf_warnings():
    """JAX's float64 mask case: no fusedattn backend computes in float64, so jax.nn's
    own XLA path runs it (debug_infs stays quiet, as in JAX's test); naming a fusedattn
    backend still refuses it."""
    with jax.enable_x64(True):
        t, s, k, n, h = 5, 7, 3, 6, 11
        mask = jnp.arange(s) <= s // 2
        args = (jnp.zeros((t, n, h), jnp.float64), jnp.zeros((s, k, h), jnp.float64),
                jnp.zeros((s, k, h), jnp.float64))
        with jax.debug_infs(True):
            out = fusedattn.dot_product_attention(*args, mask=mask)
        assert out.dtype == jnp.float64 and out.shape == (t, n, h)
        with pytest.raises(TypeError, match="dtype must be one of"):
            fusedattn.dot_product_attention(*args, mask=mask, implementation="cudnn")


def test_monkeypatched_jax_nn_float64_does_not_recurse(monkeypatch):
    monkeypatch.setattr(jax.nn, "dot_product_attention", fusedattn.dot_product_attention)
    with jax.enable_x64(True):
        x = jnp.ones((3, 2, 4), jnp.float64)
        out = jax.nn.dot_product_attention(x, x, x)
        assert out.dtype == jnp.float64 and out.shape == x.shape
    assert "float64" in fusedattn.jax_nn.fallback_reason(x, x, x)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_rows_that_see_no_key_average_all_values(dtype, causal):
    """S1 / S2: a row the boolean mask hides entirely, in every dtype and with is_causal,
    and rows past a zero key length or a window, average all values as in jax.nn, and
    their residual is jax.nn's."""
    keys = random.split(random.PRNGKey(2), 3)
    q, k, v = (random.normal(kk, (2, 8, 4, 16), dtype) for kk in keys)
    mask = jnp.ones((2, 1, 8, 8), jnp.bool_).at[:, :, 3].set(False).at[1, :, :, :5].set(False)
    tol = F32_TOL if dtype == jnp.float32 else .01
    lengths = dict(query_seq_lengths=jnp.array([8, 6], jnp.int32),
                   key_value_seq_lengths=jnp.array([0, 5], jnp.int32))
    for args, options in (((q, k, v), dict(mask=mask, is_causal=causal)),
                          ((q, k, v), dict(is_causal=causal, **lengths)),
                          ((q, k[:, :3], v[:, :3]), dict(local_window_size=(1, 0)))):
        _close(fusedattn.dot_product_attention(*args, **options), JAX_NN(*args, **options),
               tol)
        # the residual too: jax.nn's log-sum-exp where a row sees no key (a padded
        # query row included), however the backend marks such rows
        (_, lse), (_, want) = (fn(*args, return_residual=True, **options)
                               for fn in (fusedattn.dot_product_attention, JAX_NN))
        assert lse.dtype == want.dtype
        unseen = np.asarray(want, np.float32) < -1e30
        assert unseen.any()
        np.testing.assert_array_equal(np.asarray(lse)[unseen], np.asarray(want)[unseen])
        _close(np.asarray(lse, np.float32)[~unseen], np.asarray(want, np.float32)[~unseen],
               tol)


def test_rank_below_4_and_empty_batch_as_jax_nn():
    x = jnp.ones((2, 8))
    assert fusedattn.dot_product_attention(x, x, x).shape == JAX_NN(x, x, x).shape == (2, 8)
    e = jnp.ones((0, 4, 2, 8))
    assert fusedattn.dot_product_attention(e, e, e).shape == JAX_NN(e, e, e).shape
