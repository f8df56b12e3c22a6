"""Drop-in masks built in the jitted step from per-row and per-column arrays run as
mask_mods over those arrays (`tracing.mask_program`) on the block-sparse kernels of a
Hopper GPU: Flax's padding mask ANDed with its causal mask, and its document mask from
ids in any order, with a padding id and without (every row then sees a key). The output and every gradient against the float64
oracle with jax.nn's rule (a row that sees no key averages all values), at lengths of
whole blocks (the kernel writes that mean) and not (the drop-in does). Also under a
`lax.scan` of `jax.checkpoint`ed layers that close over the step's mask.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn
from support import attn_cases as ac
from support.block_sparse_cases import jax_nn_oracle

pytestmark = pytest.mark.gpu


def _arrays(b, s, kind):
    rng = np.random.default_rng(s)
    if kind != "padding_causal":   # ids in any order (0 a padding id for "documents")
        ids = rng.integers(0, 4, (b, 8))
        ids[:, 2] = 0
        a = np.repeat(ids, -(-s // 8), axis=1)[:, :s]
    else:           # tokens with trailing padding and a gap
        a = np.ones((b, s), np.int32)
        a[0, s - s // 5:] = 0
        a[-1, s // 4:s // 4 + 37] = 0
    return jnp.asarray(a.astype(np.int32))


def _mask(a, kind):
    if kind == "packed":   # every row sees its own key: no mean of the values
        return nn.make_attention_mask(a, a, jnp.equal)
    if kind == "documents":
        return nn.combine_masks(nn.make_attention_mask(a, a, jnp.equal),
                                nn.make_attention_mask(a != 0, a != 0))
    return nn.combine_masks(nn.make_attention_mask(a > 0, a > 0), nn.make_causal_mask(a))


def _assert_oracle(got, q, k, v, do, mask):
    """(out, dq, dk, dv) within bf16 tolerance of the float64 oracle with jax.nn's rule;
    the oracle's results."""
    want = jax_nn_oracle(q, k, v, do, np.asarray(mask).astype(bool))
    tol = ac.TOLERANCE["bfloat16"]
    for name, x, y in zip(("out", "dq", "dk", "dv"), got, want):
        err = ac.rel_error(np.asarray(x, np.float64), y)
        assert err < tol, (name, err)
    return want


@pytest.mark.parametrize("kind", ["padding_causal", "documents", "packed"])
@pytest.mark.parametrize("b,s,h,d", [(2, 512, 4, 128), (1, 1000, 2, 64)])
def test_flax_masks_run_as_mask_mods(kind, b, s, h, d):
    ks = jax.random.split(jax.random.key(1), 4)
    q, k, v, do = (jax.random.normal(key, (b, s, h, d), jnp.bfloat16) for key in ks)
    a = _arrays(b, s, kind)
    plans = []

    def step(q, k, v, do, a):
        def f(q, k, v):
            mask = _mask(a, kind)
            plans.append(fusedattn.flax.explain(q, k, v, mask=mask))
            return fusedattn.flax.attention_fn(q, k, v, mask=mask)
        out, vjp = jax.vjp(f, q, k, v)
        return (out,) + vjp(do)
    got = jax.jit(step)(q, k, v, do, a)
    plan = plans[0]
    assert plan.chosen == "block_sparse" and not plan.config.has_dense_mask, str(plan)
    assert "mask_program" in plan.rewritten, str(plan)
    want = _assert_oracle(got, q, k, v, do, _mask(a, kind))
    # (padded rows see nothing: jax.nn's rule is exercised)
    assert (~np.isfinite(want[4])).any() == (kind != "packed")


def test_a_mask_closed_over_by_scanned_checkpointed_layers():
    """The step builds the mask; a `lax.scan` of one `jax.checkpoint`ed layer closes over
    it (the walk follows it into the step's trace): still a mask_mod on the kernels."""
    b, s, h, d = 2, 512, 4, 128
    ks = jax.random.split(jax.random.key(2), 4)
    q, k, v, do = (jax.random.normal(key, (b, s, h, d), jnp.bfloat16) for key in ks)
    a = _arrays(b, s, "documents")
    plans = []

    def step(q, k, v, do, a):
        mask = _mask(a, "documents")

        def layers(q, k, v):
            @jax.checkpoint
            def layer(c):
                plans.append(fusedattn.flax.explain(c, k, v, mask=mask))
                return fusedattn.flax.attention_fn(c, k, v, mask=mask)
            return jax.lax.scan(lambda c, _: (layer(c), None), q, None, length=1)[0]
        out, vjp = jax.vjp(layers, q, k, v)
        return (out,) + vjp(do)
    got = jax.jit(step)(q, k, v, do, a)
    assert plans and all("mask_program" in p.rewritten and p.chosen == "block_sparse"
                         for p in plans), str(plans[0])
    _assert_oracle(got, q, k, v, do, _mask(a, "documents"))
