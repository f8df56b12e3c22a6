"""`inputs.token_sum` / `value_mean` (jax.nn's value for rows that see no key) against
float64 numpy, at lengths the two-stage sum splits and at ones it does not."""
import jax.numpy as jnp
import numpy as np
import pytest

from fusedattn.inputs import token_sum, value_mean


@pytest.mark.parametrize("s", [1, 16, 48, 300, 512])
def test_token_sum_matches_float64(s):
    x = np.random.default_rng(s).normal(size=(2, s, 3, 8)).astype(np.float32)
    got = np.asarray(token_sum(jnp.asarray(x, jnp.bfloat16)))
    want = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64).sum(1)
    assert got.dtype == np.float32 and got.shape == (2, 3, 8)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * s)


def test_value_mean_repeats_each_kv_head_over_its_group():
    v = np.random.default_rng(0).normal(size=(2, 64, 2, 4)).astype(np.float32)
    got = np.asarray(value_mean(jnp.asarray(v), 6))
    want = np.repeat(v.astype(np.float64).mean(1), 3, axis=1)
    assert got.shape == (2, 6, 4)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
