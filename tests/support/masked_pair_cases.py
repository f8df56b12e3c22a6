"""Score_mods whose derivative is non-finite at masked pairs, and their safe twins.

``s * sqrt(i - j + 1)`` under a causal mask is NaN (its derivative too) where j > i + 1,
pairs every backend masks; its twin clamps the root's argument there and equals it on
every visible pair, so its gradients are the ones the first must give
(`score_mods.zero_where_unseen`). The tests run both through `fused_attn` and compare.
"""
import jax
import jax.numpy as jnp
import numpy as np

import fusedattn

B, S, H, D = 2, 256, 2, 64


def root_distance(s, b, h, i, j):
    return s * jnp.sqrt((i - j + 1).astype(jnp.float32))


def root_distance_safe(s, b, h, i, j):
    return s * jnp.sqrt(jnp.maximum(i - j + 1, 1).astype(jnp.float32))


def causal(b, h, i, j):
    return j <= i


# (options of fused_attn, with the score_mod to fill in)
CASES = {"causal mask": dict(mask="causal"),
         "causal mask_mod": dict(mask_mod=causal),
         "window mask_mod": dict(mask_mod=lambda b, h, i, j: (j <= i) & (i - j < 40))}


def inputs(dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return tuple(jax.random.normal(k, (B, S, H, D), dtype) for k in keys)


def grads(opts, score_mod, q, k, v, do, backend):
    """Output and (dq, dk, dv) of `fused_attn` with `score_mod`."""
    def loss(q, k, v):
        out = fusedattn.fused_attn(q, k, v, score_mod=score_mod, backend=backend, **opts)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out
    (_, out), g = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return [np.asarray(x, np.float32) for x in (out, *g)]


def check(opts, backend, dtype=jnp.float32, tol=1e-5):
    """The NaN-at-masked-pairs score_mod gives finite results equal to its safe twin's."""
    q, k, v, do = inputs(dtype)
    got = grads(opts, root_distance, q, k, v, do, backend)
    want = grads(opts, root_distance_safe, q, k, v, do, backend)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert np.isfinite(g).all(), f"{name}: non-finite"
        err = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)
        assert err <= tol, f"{name}: relative error {err:.2e} against the safe score_mod"
