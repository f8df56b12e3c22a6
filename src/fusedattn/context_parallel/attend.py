"""The differentiable per-device function of context parallelism: tokens into zig-zag
order, the strategy's forward (ring or all-gather), and its backward."""
from __future__ import annotations

import functools

import jax

from . import allgather, ring
from .blocks import Static, from_zigzag, to_zigzag


def forward(st: Static, q, k, v, q_len, kv_len, extra):
    """(out in q's dtype, lse [b, h, c]) in natural order, and the residuals."""
    zq = to_zigzag(st, q)
    if st.strategy == "ring":
        zk, zv = to_zigzag(st, k), to_zigzag(st, v)
        out, lse = ring.ring_forward(st, zq, zk, zv, q_len, kv_len, extra)
    else:
        zk, zv = (allgather.gathered_in_natural_order(st, x) for x in (k, v))
        out, lse = allgather.gather_forward(st, zq, zk, zv, q_len, kv_len, extra)
    out = out.astype(q.dtype)
    return out, lse, (zq, zk, zv, out, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attend(st: Static, q, k, v, q_len, kv_len, extra):
    """`extra`: () without a score_mod, else (its integer arguments, this device's first
    batch row, first head); they take no gradient (floating ones are refused)."""
    out, _, _ = forward(st, q, k, v, q_len, kv_len, extra)
    return from_zigzag(st, out)


def attend_fwd(st, q, k, v, q_len, kv_len, extra):
    out, _, res = forward(st, q, k, v, q_len, kv_len, extra)
    return from_zigzag(st, out), (res, q_len, kv_len, extra)


def attend_bwd(st, residuals, d_out):
    (zq, zk, zv, out, lse), q_len, kv_len, extra = residuals
    zd = to_zigzag(st, d_out.astype(out.dtype))
    if st.strategy == "ring":
        dq, dk, dv = ring.ring_backward(st, zq, zk, zv, out, lse, zd, q_len, kv_len, extra)
        dk, dv = from_zigzag(st, dk), from_zigzag(st, dv)
    else:
        dq, dk, dv = allgather.gather_backward(st, zq, zk, zv, out, lse, zd, q_len, kv_len, extra)
    dq = from_zigzag(st, dq)
    return (dq.astype(zq.dtype), dk.astype(zk.dtype), dv.astype(zv.dtype), None, None, None)


attend.defvjp(attend_fwd, attend_bwd)
