"""block_sparse_xla on a CUDA GPU: masks that neither the Mosaic GPU kernels nor a vendor
kernel run (a documents mask_mod from ids at d 256, or in float32; a float32 window)
run as the block map's list walks in XLA, against the float64 oracle (output and
gradients); a mask cuDNN runs every tile (a window of positions at d 256) stays with
cuDNN."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn
from support.block_sparse_cases import doc_ids, jax_nn_oracle, rel_error

pytestmark = pytest.mark.gpu

B, S, H, H_KV = 2, 1024, 8, 2


def same_doc(b, h, i, j, doc):
    return doc[b, i] == doc[b, j]


def window(b, h, i, j):
    return (j <= i) & (i - j < 256)


def _inputs(d, dtype):
    keys = jax.random.split(jax.random.key(d), 4)
    shapes = ((B, S, H, d), (B, S, H_KV, d), (B, S, H_KV, d), (B, S, H, d))
    return [jax.random.normal(k, shape, dtype) for k, shape in zip(keys, shapes)]


@pytest.mark.parametrize("d, dtype, tol", [(256, jnp.bfloat16, (2e-2, 4e-2)),
                                           (128, jnp.float32, (2e-3, 4e-3))])
def test_documents_from_ids(d, dtype, tol):
    q, k, v, do = _inputs(d, dtype)
    doc = jnp.asarray(doc_ids(B, S, [100, 300, 200]))
    plan = fusedattn.explain(q, k, v, mask_mod=same_doc, score_mod_args=(doc,))
    assert plan.chosen == "block_sparse_xla", str(plan)
    call = jax.jit(lambda q, k, v: fusedattn.fused_attn(q, k, v, mask_mod=same_doc,
                                                        score_mod_args=(doc,)))
    out, vjp = jax.vjp(call, q, k, v)
    visible = np.asarray(doc[:, None, :, None] == doc[:, None, None, :])
    want = jax_nn_oracle(q, k, v, do, visible)
    for name, got, ref, t in zip(("out", "dq", "dk", "dv"), (out, *vjp(do)), want,
                                 (tol[0],) + (tol[1],) * 3):
        assert rel_error(np.asarray(got, np.float32), ref) < t, name


def test_a_float32_window_in_two_runs():
    """A float32 window whose scores XLA would tile runs on its static map, each (batch,
    head)'s tiles in two runs by list length (b4 h16 s2048: 512 lanes a run)."""
    b, s, h = 4, 2048, 16
    keys = jax.random.split(jax.random.key(5), 4)
    q, k, v, do = (jax.random.normal(kk, (b, s, h, 64), jnp.float32) for kk in keys)
    plan = fusedattn.explain(q, k, v, mask="causal", window=(300, 0))
    assert plan.chosen == "block_sparse_xla", str(plan)
    call = jax.jit(lambda q, k, v: fusedattn.fused_attn(q, k, v, mask="causal",
                                                        window=(300, 0)))
    out, vjp = jax.vjp(call, q, k, v)
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    want = jax_nn_oracle(q, k, v, do, ((j <= i) & (i - j <= 300))[None, None])
    for name, got, ref, t in zip(("out", "dq", "dk", "dv"), (out, *vjp(do)), want,
                                 (2e-3, 4e-3, 4e-3, 4e-3)):
        assert rel_error(np.asarray(got, np.float32), ref) < t, name


def test_a_window_of_positions_stays_with_cudnn():
    q = jnp.zeros((B, S, H, 256), jnp.bfloat16)
    plan = fusedattn.explain(q, q, q, mask_mod=window)
    assert plan.chosen == "cudnn", str(plan)
