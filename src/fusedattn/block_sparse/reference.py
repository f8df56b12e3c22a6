"""The block-sparse kernels' maths in plain JAX: the same list walks, block by
block, with the same signatures as `kernel_fwd.forward`, `kernel_bwd.dq` and
`kernel_bwd.dkv`. It runs anywhere (CPU CI tests the list logic with it) and is
the path used where the Mosaic GPU kernels do not run.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .kernel_mask import KernelMask
from .kernel_parts import BLOCK, F32, LOG2E, WORD, bh_index, side_index, unpack_bits
from .kernel_score import apply


def _walk(lists, b, h, t):
    cp, ip, cf, if_ = (x[b if x.shape[0] > 1 else 0, h if x.shape[1] > 1 else 0, t]
                       for x in lists)

    def entry(i):
        w = ip.shape[-1]
        j = jnp.where(i < cp, ip[jnp.minimum(i, w - 1)], if_[jnp.clip(i - cp, 0, w - 1)])
        return j, i < cp
    return cp + cf, entry


def _side(arrays, b, h, start, axis, tile=False):
    """Mask arrays ``[B|1, n, s]`` or a score's values ``[B|1, H|1, n, s]`` of (b, h) at
    BLOCK positions from `start`, as rows (axis 0) or columns: vectors, or whole tiles
    with `tile` (a score's values)."""
    if arrays is None:
        return []
    a = lax.dynamic_slice_in_dim(arrays[side_index(arrays, b, h)], start, BLOCK, axis=1)
    vecs = [x[:, None] if axis == 0 else x[None, :] for x in a]
    return [jnp.broadcast_to(x, (BLOCK, BLOCK)) for x in vecs] if tile else vecs


def diagonal_tiles(runs, words, b, h, d):
    """A score's values by q_idx - kv_idx (`words` ``[B|1, H|1, l, K]`` per `runs`) at
    (b, h) and the diagonals `d` (a tile), as l tiles: the gather form of what a kernel
    rebuilds run by run (`kernel_diagonal.Diagonal`). Not private: the score fuzz
    tests build their tiles with it."""
    if words is None:
        return []
    return list(runs.tile(words[side_index(words, b, h)], d))   # [l, *d.shape]


def _positions(q0, k0):
    """The query and key positions of the block pair at (q0, k0), as a column and a row."""
    return q0 + jnp.arange(BLOCK)[:, None], k0 + jnp.arange(BLOCK)[None, :]


def _logits(qt, kt, *, kmask, scale, score, values, b, h, q0, k0, partial, sides=()):
    """Base-2 logits of one (query block, key block) pair, -inf where masked, and the
    score's pullback (`kernel_score.apply`; None without a score)."""
    q, kv = _positions(q0, k0)
    s = jnp.dot(qt, kt.T, preferred_element_type=F32) * scale
    pull = None
    if score is not None:
        tiles = (_side(values[0], b, h, q0, 0, tile=True), _side(values[1], b, h, k0, 1, tile=True),
                 diagonal_tiles(score.runs, values[2], b, h, q - kv))
        s, pull = apply(score, s, b, h, q, kv, tiles, with_grad=True, sides=sides)
    qv, kvv = _side(kmask.q_arrays, b, h, q0, 0), _side(kmask.kv_arrays, b, h, k0, 1)
    dense = None
    if kmask.dense is not None:
        m = kmask.dense[bh_index(kmask.dense, b, h)]
        words = lax.dynamic_slice(m, (k0 // WORD, q0), (BLOCK // WORD, BLOCK))
        dense = unpack_bits([w[:, None] for w in words], kv - k0)
    visible = kmask.fn(b, h, q, kv, qv, kvv, dense) | jnp.logical_not(partial)
    return jnp.where(visible, s * LOG2E, -jnp.inf), pull


# Vmapped, a list walk runs as many steps as the longest list among its lanes, and on a
# GPU each step of XLA's loop costs a fixed launch and predicate read as well as its
# lanes' work. So each (batch, head)'s tiles are sorted by their lists' lengths and
# walked in GROUPS runs, each as long as its own longest list, where a run keeps at least
# MIN_LANES lanes (fewer steps, not fewer lanes, pay then). The sort stays within a
# (batch, head): a batch / head split of the walks needs no collective. Measured
# (`benchmarks/tune/walk_fallback.py`, docs/decisions.md): causal maps gain most, maps
# whose lists are all alike lose a few percent.
GROUPS = 2
MIN_LANES = 512


def _grid(fn, lists, B, H, T):
    """`fn(b, h, t)` of every tile, stacked ``[B, H, T, ...]``; `lists` (the map's four
    ``[B|1, H|1, T, ...]`` lists) give each tile's walk length."""
    groups = GROUPS if (T % GROUPS == 0 and T >= 2 * GROUPS
                        and B * H * T // GROUPS >= MIN_LANES) else 1
    if groups == 1:
        return jax.vmap(jax.vmap(jax.vmap(fn, (None, None, 0)), (None, 0, None)),
                        (0, None, None))(jnp.arange(B), jnp.arange(H), jnp.arange(T))
    # (each run's tiles differ by (batch, head): t is batched along both)
    each = jax.vmap(jax.vmap(jax.vmap(fn, (None, None, 0)), (None, 0, 0)), (0, None, 0))
    counts = jnp.broadcast_to(lists[0] + lists[2], (B, H, T))
    order = jnp.argsort(counts, axis=-1, stable=True)                # [B, H, T]
    runs = [each(jnp.arange(B), jnp.arange(H), order[:, :, i:i + T // groups])
            for i in range(0, T, T // groups)]
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs, axis=2), *runs)
    back = jnp.argsort(order, axis=-1)                               # tile -> its place

    def unsort(x):
        return jnp.take_along_axis(x, back.reshape(back.shape + (1,) * (x.ndim - 3)), axis=2)
    return jax.tree_util.tree_map(unsort, stacked)


def forward(q, k, v, lists, kmask: KernelMask, *, scale, score=None,
            score_values=(None, None, None), fill=None):
    B, S, H, D = q.shape
    group = H // k.shape[2]

    def tile(b, h, t):
        n, entry = _walk(lists, b, h, t)
        q0 = t * BLOCK
        qt = lax.dynamic_slice_in_dim(q[b, :, h], q0, BLOCK)

        def step(i, carry):
            acc, m, l = carry
            j, partial = entry(i)
            kt = lax.dynamic_slice_in_dim(k[b, :, h // group], j * BLOCK, BLOCK)
            vt = lax.dynamic_slice_in_dim(v[b, :, h // group], j * BLOCK, BLOCK)
            s, _ = _logits(qt, kt, kmask=kmask, scale=scale, score=score, values=score_values,
                           b=b, h=h, q0=q0, k0=j * BLOCK, partial=partial)
            m_new = jnp.maximum(m, s.max(1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2(m - m_safe)
            p = jnp.exp2(s - m_safe[:, None])
            acc = acc * alpha[:, None] + jnp.dot(p.astype(q.dtype), vt, preferred_element_type=F32)
            return acc, m_new, l * alpha + p.sum(1)

        acc, m, l = lax.fori_loop(0, n, step, (jnp.zeros((BLOCK, D), F32),
                                               jnp.full((BLOCK,), -jnp.inf, F32),
                                               jnp.zeros((BLOCK,), F32)))
        empty = l == 0
        l_safe = jnp.where(empty, 1.0, l)
        out = acc / l_safe[:, None]
        if fill is not None:
            out = jnp.where(empty[:, None], fill[b, h][None], out)
        return out.astype(q.dtype), jnp.where(empty, -jnp.inf, m + jnp.log2(l_safe))

    out, lse = _grid(tile, lists, B, H, S // BLOCK)   # [B, H, T, BLOCK, D], [B, H, T, BLOCK]
    return out.reshape(B, H, S, D).transpose(0, 2, 1, 3), lse.reshape(B, H, S)


def _probs(qt, kt, dot, vt, lse, delta, **kw):
    """(P, dS, the score's float q values' gradients summed over keys, its float kv
    values' summed over queries, its float diagonal values' summed per run)."""
    s, pull = _logits(qt, kt, **kw)
    p = jnp.exp2(s - lse[:, None])
    dp = jnp.dot(dot, vt.T, preferred_element_type=F32)
    ds = p * (dp - delta[:, None])
    if pull is None:
        return p, ds, [], [], []
    ds, g_q, g_kv, g_d = pull(ds)
    q, kv = _positions(kw["q0"], kw["k0"])
    return (p, ds, [g.sum(1) for g in g_q], [g.sum(0) for g in g_kv],
            [kw["score"].runs.sums(g, q - kv) for g in g_d])


def _scatter(floats, grads, n, width=BLOCK):
    """Per-slot gradients [n, width] (zeros where a value is not a float)."""
    grads = iter(grads)
    return jnp.stack([next(grads) if yes else jnp.zeros((width,), F32) for yes in floats]) \
        if floats else jnp.zeros((n, width), F32)


def dq(q, k, v, do, lse_delta, lists, kmask: KernelMask, *, scale, score=None,
       score_values=(None, None, None)):
    """(dq, the float q values' gradient [B, H, n, S] or None, the float diagonal
    values' [B, H, l, K] or None), like the kernel."""
    B, S, H, D = q.shape
    group = H // k.shape[2]
    sq, _, sd = score_values
    floats = score.q_floats if sq is not None else ()
    d_floats = score.d_floats if sd is not None else ()
    runs = sd.shape[-1] if sd is not None else 0

    def tile(b, h, t):
        n, entry = _walk(lists, b, h, t)
        q0 = t * BLOCK
        rows = lambda x: lax.dynamic_slice_in_dim(x, q0, BLOCK)
        qt, dot = rows(q[b, :, h]), rows(do[b, :, h])
        lse, delta = rows(lse_delta[b, h, 0]), rows(lse_delta[b, h, 1])

        def step(i, carry):
            acc, dv, dd = carry
            j, partial = entry(i)
            kt = lax.dynamic_slice_in_dim(k[b, :, h // group], j * BLOCK, BLOCK)
            vt = lax.dynamic_slice_in_dim(v[b, :, h // group], j * BLOCK, BLOCK)
            _, ds, g_q, _, g_d = _probs(qt, kt, dot, vt, lse, delta, kmask=kmask, scale=scale,
                                        score=score, values=score_values, b=b, h=h, q0=q0,
                                        k0=j * BLOCK, partial=partial, sides=("q", "d"))
            acc = acc + jnp.dot(ds.astype(q.dtype), kt, preferred_element_type=F32)
            return (acc, dv + _scatter(floats, g_q, len(floats)),
                    dd + _scatter(d_floats, g_d, len(d_floats), runs))

        init = (jnp.zeros((BLOCK, D), F32), jnp.zeros((len(floats), BLOCK), F32),
                jnp.zeros((len(d_floats), runs), F32))
        acc, dv, dd = lax.fori_loop(0, n, step, init)
        return (acc * scale).astype(q.dtype), dv, dd

    dq_, dv, dd = _grid(tile, lists, B, H, S // BLOCK)
    dv = dv.transpose(0, 1, 3, 2, 4).reshape(B, H, len(floats), S) if any(floats) else None
    dd = dd.sum(2) if any(d_floats) else None
    return dq_.reshape(B, H, S, D).transpose(0, 2, 1, 3), dv, dd


def dkv(q, k, v, do, lse_delta, lists, kmask: KernelMask, *, scale, score=None,
        score_values=(None, None, None), dv_add=None):
    """(dk, dv, the float kv values' gradient [B, H, m, S_kv] or None) per query head,
    like the kernel; `kmask` is the forward's (not transposed)."""
    B, S, H, D = q.shape
    S_kv = k.shape[1]
    group = H // k.shape[2]
    skv = score_values[1]
    floats = score.kv_floats if skv is not None else ()

    def tile(b, h, t):
        n, entry = _walk(lists, b, h, t)
        k0 = t * BLOCK
        kt = lax.dynamic_slice_in_dim(k[b, :, h // group], k0, BLOCK)
        vt = lax.dynamic_slice_in_dim(v[b, :, h // group], k0, BLOCK)

        def step(i, carry):
            dk, dv, dw = carry
            j, partial = entry(i)
            rows = lambda x: lax.dynamic_slice_in_dim(x, j * BLOCK, BLOCK)
            qt, dot = rows(q[b, :, h]), rows(do[b, :, h])
            p, ds, _, g_kv, _ = _probs(qt, kt, dot, vt, rows(lse_delta[b, h, 0]),
                                    rows(lse_delta[b, h, 1]), kmask=kmask, scale=scale,
                                    score=score, values=score_values, b=b, h=h,
                                    q0=j * BLOCK, k0=k0, partial=partial, sides=("kv",))
            dv = dv + jnp.dot(p.T.astype(q.dtype), dot, preferred_element_type=F32)
            dk = dk + jnp.dot(ds.T.astype(q.dtype), qt, preferred_element_type=F32)
            return dk, dv, dw + _scatter(floats, g_kv, len(floats))

        zero = jnp.zeros((BLOCK, D), F32)
        dk, dv, dw = lax.fori_loop(0, n, step, (zero, zero, jnp.zeros((len(floats), BLOCK), F32)))
        if dv_add is not None:
            dv = dv + dv_add[b, h][None]
        return (dk * scale).astype(q.dtype), dv.astype(q.dtype), dw

    dk, dv, dw = _grid(tile, lists, B, H, S_kv // BLOCK)
    fix = lambda x: x.reshape(B, H, S_kv, D).transpose(0, 2, 1, 3)
    dw = dw.transpose(0, 1, 3, 2, 4).reshape(B, H, len(floats), S_kv) if any(floats) else None
    return fix(dk), fix(dv), dw
