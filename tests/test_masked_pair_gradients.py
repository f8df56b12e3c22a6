"""A score_mod whose derivative is non-finite at masked pairs (``s * sqrt(i - j + 1)``
under causal) gives finite gradients equal to those of a twin that is finite there,
on the XLA backend and on the block-sparse route (its list walks on the CPU): the
score's gradient is selected to 0 at pairs of zero probability after the score_mod's
pullback (`score_mods.zero_where_unseen`), as flex_attention does."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import masked_pair_cases as mp


@pytest.mark.parametrize("case", sorted(mp.CASES))
def test_xla_backend_drops_the_masked_pairs_pullback(case):
    mp.check(mp.CASES[case], "xla", tol=0)


@pytest.mark.parametrize("case", ["causal mask_mod", "window mask_mod"])
def test_block_sparse_route_drops_the_masked_pairs_pullback(hopper_reference, case):
    mp.check(mp.CASES[case], "block_sparse", jnp.bfloat16, tol=0)


def test_without_the_select_the_pullback_is_nan():
    """The case is one that needs the select: JAX's own derivative of the score_mod
    at a masked pair, times the zero dS there, is NaN."""
    d = jax.grad(lambda s: mp.root_distance(s, 0, 0, jnp.int32(0), jnp.int32(5)))(1.0)
    assert np.isnan(float(d) * 0.0)
