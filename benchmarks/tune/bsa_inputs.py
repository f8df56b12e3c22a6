"""The block-sparse backward kernels' inputs for a map, as the backward step builds
them: the forward's output and lse, lse_delta, and the map's query- and key-major lists
(shared by the tune scripts that call `kernel_bwd` directly)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fusedattn.block_sparse.attention import block_sparse_attention_with_lse
from fusedattn.block_sparse.kernel_mask import kernel_mask


def backward_inputs(bm, q, k, v, do):
    """((q, k, v, do, lse_delta), query-major lists, key-major lists, kernel mask)."""
    out, lse = jax.jit(lambda q, k, v: block_sparse_attention_with_lse(q, k, v, bm))(q, k, v)
    lse2 = lse / math.log(2.0)
    delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), do.astype(jnp.float32))
    lse_delta = jnp.stack([jnp.where(lse2 == -jnp.inf, jnp.inf, lse2), delta], axis=2)
    by_q = tuple(jnp.asarray(x, jnp.int32) for x in
                 (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices))
    by_kv = tuple(jnp.asarray(x, jnp.int32) for x in
                  (bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices))
    return (q, k, v, do, lse_delta), by_q, by_kv, kernel_mask(bm.element)
