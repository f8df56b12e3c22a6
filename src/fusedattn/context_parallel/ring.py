"""Ring context parallelism: kv blocks travel around the mesh axis with `ppermute`, the
next transfer issued before this block's kernel; the backward sends kv around again with
the kv gradients travelling along."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .blocks import (F32, Block, Static, block_backward, block_forward, merge, prefix_len, ring_case,
                     ring_cases, score_args, shift)


def switch(st: Static, index, fn, *arrays):
    """fn(blocks, st, *arrays) for the ring case `index` selects."""
    cases = ring_cases(st)
    if len(cases) == 1:
        return fn(cases[0], st, *arrays)
    return jax.lax.switch(index, [functools.partial(fn, case, st) for case in cases], *arrays)


def ring_forward(st: Static, q, k, v, q_len, kv_len, extra):
    r = jax.lax.axis_index(st.axis)
    acc = None
    for t in range(st.n):
        # Issue the next block's transfer before this block's kernel: XLA overlaps them.
        nxt = shift((k, v), st) if t < st.n - 1 else None
        src = (r - t) % st.n
        part = switch(st, ring_case(st, r, src), ring_case_fwd, q, k, v, q_len, kv_len, r, src,
                       extra)
        acc = part if acc is None else merge(acc, part)
        if nxt is not None:
            k, v = nxt
    return acc


def ring_block_args(st, block, q_len, kv_len, r, src, extra):
    """A ring block's padding lengths (my rows, src's keys) and score_mod arguments."""
    return (prefix_len(st, q_len, r, block.q_rows), prefix_len(st, kv_len, src, block.kv_rows),
            score_args(st, block, r, src, extra))


def ring_case_fwd(blocks, st, q, k, v, q_len, kv_len, r, src, extra):
    """(out in q's dtype, lse) of one case's blocks, merged."""
    parts = [block_forward(st, block, q, k, v,
                            *ring_block_args(st, block, q_len, kv_len, r, src, extra))
             for block in blocks]
    if len(parts) == 1:
        return parts[0]
    out, lse = functools.reduce(merge, parts)
    return out.astype(q.dtype), lse


def ring_case_bwd(blocks, st, q, k, v, out, lse, d_out, q_len, kv_len, r, src, extra):
    """(dq, dk, dv) of one case's blocks, summed."""
    grads = [block_backward(st, block, q, k, v, out, lse, d_out,
                             *ring_block_args(st, block, q_len, kv_len, r, src, extra))
             for block in blocks]
    if len(grads) == 1:
        return grads[0]
    return tuple(functools.reduce(lambda a, b: a + b.astype(F32), parts[1:],
                                  parts[0].astype(F32)).astype(parts[0].dtype)
                 for parts in zip(*grads))


def ring_backward(st: Static, q, k, v, out, lse, d_out, q_len, kv_len, extra):
    r = jax.lax.axis_index(st.axis)
    dq = jnp.zeros(q.shape, F32)
    dk, dv = jnp.zeros_like(k), jnp.zeros_like(v)
    for t in range(st.n):
        nxt = shift((k, v), st) if t < st.n - 1 else None
        src = (r - t) % st.n
        g = switch(st, ring_case(st, r, src), ring_case_bwd, q, k, v, out, lse, d_out,
                    q_len, kv_len, r, src, extra)
        dq = dq + g[0].astype(F32)
        # The kv gradients travel with their block, in k's dtype (half the bytes of
        # fp32; one rounding per hop, n in all); after the last step one more hop
        # takes them home (device r holds block r + 1's then).
        dk = (dk.astype(F32) + g[1].astype(F32)).astype(k.dtype)
        dv = (dv.astype(F32) + g[2].astype(F32)).astype(v.dtype)
        dk, dv = shift((dk, dv), st)
        if nxt is not None:
            k, v = nxt
    return dq, dk, dv
