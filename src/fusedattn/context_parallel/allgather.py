"""All-gather context parallelism: kv gathered once along the mesh axis; the backward
reduce-scatters the kv gradients."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .blocks import (F32, Block, Static, block_backward, block_forward, merge, prefix_len,
                     score_args, shift, zigzag_order)


def gather_blocks(st: Static, r):
    """Per local segment: (rows, its causal kv prefix length or None for no mask)."""
    if not st.config.causal:
        return [((0, st.config.s_q), None)]
    return [((a, b), st.segment_start(r, i) + (b - a)) for i, (a, b) in enumerate(st.segments)]


def gather_forward(st: Static, q, k_all, v_all, q_len, kv_len, extra):
    r = jax.lax.axis_index(st.axis)
    outs, lses = [], []
    total = k_all.shape[1]
    for rows, prefix in gather_blocks(st, r):
        block = Block(rows, (0, total), "none" if prefix is None else "causal_bottom_right")
        ql = prefix_len(st, q_len, r, rows)
        kl = jnp.clip(kv_len, 0, total) if prefix is None else jnp.broadcast_to(prefix, ql.shape)
        out, lse = block_forward(st, block, q, k_all, v_all, ql, kl.astype(jnp.int32),
                                  score_args(st, block, r, None, extra))
        outs.append(out)
        lses.append(lse)
    return functools.reduce(merge, zip(outs, lses))


def gather_backward(st: Static, q, k_all, v_all, out, lse, d_out, q_len, kv_len, extra):
    r = jax.lax.axis_index(st.axis)
    dq = jnp.zeros(q.shape, F32)
    dk, dv = jnp.zeros(k_all.shape, F32), jnp.zeros(v_all.shape, F32)
    total = k_all.shape[1]
    for rows, prefix in gather_blocks(st, r):
        block = Block(rows, (0, total), "none" if prefix is None else "causal_bottom_right")
        ql = prefix_len(st, q_len, r, rows)
        kl = jnp.clip(kv_len, 0, total) if prefix is None else jnp.broadcast_to(prefix, ql.shape)
        g = block_backward(st, block, q, k_all, v_all, out, lse, d_out, ql, kl.astype(jnp.int32),
                            score_args(st, block, r, None, extra))
        dq, dk, dv = dq + g[0], dk + g[1], dv + g[2]
    if st.zigzag and not st.reorder:  # back to the callers' (zig-zag) token order
        order = zigzag_order(k_all.shape[1], st.n)
        dk, dv = jnp.take(dk, order, axis=1), jnp.take(dv, order, axis=1)
    return dq, reduce_scatter(dk, st, r), reduce_scatter(dv, st, r)


def gathered_in_natural_order(st: Static, x):
    """All-gather along the sequence; tokens given in zig-zag order are put back in
    natural order (a local gather), since the blocks address kv by position."""
    full = jax.lax.all_gather(x, st.axis, axis=1, tiled=True)
    if st.zigzag and not st.reorder:
        full = jnp.take(full, np.argsort(zigzag_order(full.shape[1], st.n)), axis=1)
    return full


def reduce_scatter(x, st: Static, r):
    """Sum over the ring of x [b, n * c, ..]; device r keeps chunk r. A ring of n - 1
    ppermutes (the bandwidth of a reduce-scatter; lax.psum_scatter fails to lower
    inside a shard_map over part of an Explicit mesh in JAX 0.10)."""
    c = x.shape[1] // st.n
    chunk = lambda i: jax.lax.dynamic_slice_in_dim(x, (i % st.n) * c, c, axis=1)  # noqa: E731
    buf = chunk(r - 1)
    for t in range(st.n - 1):
        buf = shift(buf, st) + chunk(r - t - 2)
    return buf
