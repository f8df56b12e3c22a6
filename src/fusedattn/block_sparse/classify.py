"""Block kinds (empty / partial / full) of an `ElementMask`, on the host or the device.

Static masks are classified with numpy at trace time (the mask_mod runs eagerly on
the host CPU backend, never on an accelerator, and nothing enters the traced
program). Others run on the device, a group of query blocks at a time
(`lax.map`), so the largest intermediate is a few query blocks by all keys,
never the whole ``s_q x s_kv`` grid. Three shapes skip the element-wise work:
per-row key intervals (the built-in masks) need O(s_q x key blocks); documents
masks (segment ids, or a mask_mod equal to them: `documents`) need a per-block count
of each id, reduced mod ``s_q + s_kv`` (`_segments`), also when ANDed with static
terms, whose cut blocks alone are evaluated pair by pair (`_counted`); and a
dense mask is reduced as it is (it is already ``s_q x s_kv``).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from .block_map import EMPTY, FULL, PARTIAL
from .kernel_mask import kinds_of_bits
from .documents import Documents, documents
from .terms import Dense, ElementMask, Intervals

# Booleans per step of the block loop (host chunks and device lax.map batches).
CHUNK_ELEMENTS = 1 << 24
# Segment ids are counted per block and id in a [batch, blocks, ids] table up to this size.
MAX_SEGMENT_TABLE = 1 << 26
# Element-wise evaluation on the host beyond this many pairs (about 1 s at 16k x 16k)
# is slower than a trace should be: such static masks are classified on the device.
MAX_HOST_ELEMENTS = 1 << 28


def on_host(element: ElementMask) -> bool:
    """Whether `element`'s map is computed on the host (static and cheap enough)."""
    if not element.static:
        return False
    if len(element.terms) == 1 and isinstance(element.terms[0], (Dense, Intervals)):
        return True  # no element-wise evaluation (a dense mask is already on the host)
    return element.batch * element.heads * element.s_q * element.s_kv <= MAX_HOST_ELEMENTS


def classify(element: ElementMask, block: Tuple[int, int], host: bool):
    """``[B|1, H|1, n_q, n_kv]`` int32 kinds; numpy when `host`."""
    terms = element.terms
    if len(terms) == 1 and isinstance(terms[0], Dense):
        return _dense(terms[0], element, block, np if host else jnp)
    counted = _counted(element, block, np if host else jnp)
    if counted is not None:
        return counted
    if len(terms) == 1 and isinstance(terms[0], Intervals):
        fn = _interval_fn(terms[0], element, block, np if host else jnp)
    else:
        fn = _element_fn(element, block, host)
    n_q = -(-element.s_q // block[0])
    n_kv = -(-element.s_kv // block[1])
    per_block = element.batch * element.heads * block[0] * n_kv * block[1]
    any_, all_ = _over_q_blocks(fn, n_q, block[0], per_block, host)
    xp = np if host else jnp
    return xp.where(all_, FULL, xp.where(any_, PARTIAL, EMPTY)).astype(np.int32)


@contextlib.contextmanager
def host_eval():
    """Run jax code eagerly on the host CPU backend, as at trace time: a static map
    costs no accelerator work, whatever the default device or transfer guard."""
    with jax.ensure_compile_time_eval(), jax.default_device(jax.devices("cpu")[0]), \
            jax.transfer_guard("allow"):
        yield


def _over_q_blocks(fn: Callable, n_q: int, bq: int, per_block: int, host: bool):
    """Stack ``fn(rows) -> (any, all) [B, H, m, n_kv]`` over all query blocks, a
    group of blocks (their `rows`) at a time."""
    group = max(1, min(n_q, CHUNK_ELEMENTS // max(per_block, 1)))
    if host:
        parts = [fn(np.arange(i * bq, min(i + group, n_q) * bq, dtype=np.int32))
                 for i in range(0, n_q, group)]
        return tuple(np.concatenate([p[k] for p in parts], axis=2) for k in (0, 1))

    def one(i):
        a, b = fn(i * bq + jnp.arange(bq, dtype=jnp.int32))
        return a[:, :, 0], b[:, :, 0]
    any_, all_ = jax.lax.map(one, jnp.arange(n_q, dtype=jnp.int32), batch_size=group)
    return jnp.moveaxis(any_, 0, 2), jnp.moveaxis(all_, 0, 2)


def _element_fn(element: ElementMask, block, host: bool):
    """Evaluate the element mask on rows x all keys, reduce to blocks."""
    bq, bk = block
    B, H = element.batch, element.heads
    n_kv = -(-element.s_kv // bk)
    xp = np if host else jnp
    b = xp.arange(B, dtype=np.int32).reshape(B, 1, 1, 1)
    h = xp.arange(H, dtype=np.int32).reshape(1, H, 1, 1)
    kv = xp.arange(n_kv * bk, dtype=np.int32).reshape(1, 1, 1, -1)

    if host:
        element = element.for_host()

    def fn(rows):
        q = rows.reshape(1, 1, -1, 1)
        if host:
            with host_eval():
                vis = np.asarray(element(b, h, q, kv))
        else:
            vis = element(b, h, q, kv)
        vis = xp.broadcast_to(vis, (B, H, rows.shape[0], n_kv * bk))
        vis = vis.reshape(B, H, -1, bq, n_kv, bk)
        return vis.any(axis=(3, 5)), vis.all(axis=(3, 5))
    return fn


def _interval_fn(term: Intervals, element: ElementMask, block, xp):
    """Rows see ``[lo, hi]``: a key block is touched by a row when the intervals
    meet and covered when it lies inside (and does not overhang s_kv)."""
    bq, bk = block
    s_q, s_kv = element.s_q, element.s_kv
    n_kv = -(-s_kv // bk)
    start = xp.arange(n_kv, dtype=np.int32) * bk
    end = start + bk - 1                       # the block's last key, overhang included
    last = xp.minimum(end, s_kv - 1)           # its last real key
    lo, hi = xp.asarray(term.lo), xp.asarray(term.hi)

    def fn(rows):
        real = rows < s_q
        r = xp.minimum(rows, s_q - 1)
        lo_r = xp.where(real, xp.take(lo, r, axis=1), 1)[:, :, None]   # [B, R, 1]
        hi_r = xp.where(real, xp.take(hi, r, axis=1), 0)[:, :, None]
        touched = (lo_r <= hi_r) & (lo_r <= last) & (hi_r >= start)
        covered = (lo_r <= start) & (hi_r >= end) & (end < s_kv)
        shape = (lo.shape[0], 1, -1, bq, n_kv)
        return touched.reshape(shape).any(axis=3), covered.reshape(shape).all(axis=3)
    return fn


def _dense(term: Dense, element: ElementMask, block, xp):
    """Reduce a ``[B|1, H|1, s_q, s_kv]`` mask tile by tile (overhang is not visible),
    or its packed bits where it has them (1/8 of the bytes)."""
    bq, bk = block
    B, H, s_q, s_kv = term.mask.shape
    n_q, n_kv = -(-s_q // bq), -(-s_kv // bk)
    found = None if term.bits is None or xp is np else \
        kinds_of_bits(term.bits, n_q, n_kv, block)
    if found is not None:
        any_, all_ = found
        return xp.where(all_, FULL, xp.where(any_, PARTIAL, EMPTY)).astype(np.int32)
    m = xp.asarray(term.mask).astype(bool)
    m = xp.pad(m, ((0, 0), (0, 0), (0, n_q * bq - s_q), (0, n_kv * bk - s_kv)))
    m = m.reshape(B, H, n_q, bq, n_kv, bk)
    any_, all_ = m.any(axis=(3, 5)), m.all(axis=(3, 5))
    return xp.where(all_, FULL, xp.where(any_, PARTIAL, EMPTY)).astype(np.int32)


def _counted(element: ElementMask, block, xp):
    """The kinds of a documents mask (`documents`) alone, or ANDed with static terms of
    one batch row and head (``mask="causal"``, a window, the mask_mod's own factors of
    positions), from ids counted per block; None for any other mask, or a table past
    `MAX_SEGMENT_TABLE`. With static terms, a block they cover takes the documents'
    kind, one they miss is empty, and the few they cut (known at trace time) are
    evaluated pair by pair, so the AND stays exact."""
    terms = element.terms
    if any(not (t.static and t.batch == 1 and t.heads == 1) for t in terms[1:]):
        return None
    docs = documents(terms[0], element)
    n_ids = element.s_q + element.s_kv
    if docs is None or element.batch * n_ids * -(-max(element.s_q, element.s_kv) //
                                                 min(block)) > MAX_SEGMENT_TABLE:
        return None
    fixed = list(terms[1:]) + ([docs.positions] if docs.positions is not None else [])
    if not fixed:
        return _segments(docs, element, block, xp)
    fixed = ElementMask(fixed, element.s_q, element.s_kv)
    if not on_host(fixed):
        return None
    cut = classify(fixed, block, host=True)
    tiles = np.argwhere(cut[0, 0] == PARTIAL)                  # [n, 2]: (query, key block)
    if element.batch * len(tiles) * block[0] * block[1] > 4 * CHUNK_ELEMENTS:
        return None
    kinds = xp.where(cut == FULL, _segments(docs, element, block, xp), EMPTY)
    if len(tiles):
        exact = _tile_kinds(docs, fixed, tiles, block, xp)    # [B, n]
        if xp is np:
            kinds[:, 0, tiles[:, 0], tiles[:, 1]] = exact
        else:
            kinds = kinds.at[:, 0, tiles[:, 0], tiles[:, 1]].set(exact)
    return kinds.astype(np.int32)


def _tile_kinds(docs: Documents, fixed: ElementMask, tiles, block, xp):
    """The kinds of the listed (query block, key block) tiles of documents ANDed with
    the static mask `fixed`, every pair evaluated: ``[B, n]``."""
    bq, bk = block
    s_q, s_kv, B = fixed.s_q, fixed.s_kv, docs.batch
    rows = tiles[:, :1] * bq + np.arange(bq)                              # [n, bq]
    cols = tiles[:, 1:] * bk + np.arange(bk)                              # [n, bk]
    # the tiles along the batch axis (static terms of one row and head read no b)
    with host_eval():
        vis = np.asarray(fixed.for_host()(np.int32(0), np.int32(0),
                                          rows[:, None, :, None].astype(np.int32),
                                          cols[:, None, None, :].astype(np.int32)))
    vis = np.broadcast_to(vis, (len(tiles), 1, bq, bk))[:, 0]
    rows, cols = np.minimum(rows, s_q - 1), np.minimum(cols, s_kv - 1)

    def side(x, at):   # [B|1, s] -> [B, n, size]
        return xp.broadcast_to(xp.asarray(x), (B, np.shape(x)[1]))[:, at]
    same = side(docs.q_ids, rows)[:, :, :, None] == side(docs.kv_ids, cols)[:, :, None, :]
    if docs.q_valid is not None:
        same = same & side(docs.q_valid, rows)[:, :, :, None]
    if docs.kv_valid is not None:
        same = same & side(docs.kv_valid, cols)[:, :, None, :]
    vis = same & vis[None]
    any_, all_ = vis.any(axis=(2, 3)), vis.all(axis=(2, 3))
    return xp.where(all_, FULL, xp.where(any_, PARTIAL, EMPTY))


def _segments(docs: Documents, element: ElementMask, block, xp):
    """Kinds of a documents mask without its pairs. Each block counts its valid ids
    by rank ``id mod (s_q + s_kv)``, and a block pair is touched when the product
    of two blocks' counts is non-zero; full when both blocks hold one raw id, the
    same, all valid and with no overhang.

    Exact when ids lie in ``[0, s_q + s_kv)``, as segment ids are made (0..n_docs,
    0 the padding): the rank is then the id. Other ids may share a rank, so a pair
    of blocks sharing no id may be touched: partial instead of empty, which is safe
    (partial blocks apply the element mask). Full and validity read raw ids, so a
    block is never full, nor empty, wrongly."""
    bq, bk = block
    s_q, s_kv = element.s_q, element.s_kv
    B = docs.batch
    q = xp.broadcast_to(xp.asarray(docs.q_ids), (B, s_q))
    kv = xp.broadcast_to(xp.asarray(docs.kv_ids), (B, s_kv))
    # One promoted dtype for both sides, so raw ids compare as one array would.
    ids = xp.concatenate([q, kv], axis=1)
    q, kv = ids[:, :s_q], ids[:, s_q:]
    n_ids = s_q + s_kv
    # No sort: the rank is the id mod n_ids (non-negative), computed in at least
    # 32 bits so that n_ids fits the dtype.
    wide = ids if ids.dtype.itemsize >= 4 else ids.astype(np.int32)
    rank = xp.mod(wide, n_ids).astype(np.int32)

    def per_block(rank, ids, valid, size):
        s = ids.shape[1]
        n = -(-s // size)
        valid = xp.ones((B, s), bool) if valid is None else \
            xp.broadcast_to(xp.asarray(valid), (B, s))
        counts = _scatter_add(xp, (B, n, n_ids),
                              (xp.arange(B)[:, None], xp.arange(s)[None, :] // size, rank),
                              valid.astype(np.float32))
        pad = ((0, 0), (0, n * size - s))
        raw = xp.pad(ids, pad).reshape(B, n, size)  # overhang is excluded by `whole`
        whole = xp.pad(valid, pad).reshape(B, n, size).all(axis=2)
        one_id = whole & (raw.min(axis=2) == raw.max(axis=2))
        return counts, one_id, raw[:, :, 0]

    cq, q_one, q_id = per_block(rank[:, :s_q], q, docs.q_valid, bq)
    ck, kv_one, kv_id = per_block(rank[:, s_q:], kv, docs.kv_valid, bk)
    any_ = xp.einsum("bqr,bkr->bqk", cq, ck) > 0
    all_ = q_one[:, :, None] & kv_one[:, None, :] & (q_id[:, :, None] == kv_id[:, None, :])
    kinds = xp.where(all_, FULL, xp.where(any_, PARTIAL, EMPTY)).astype(np.int32)
    return kinds[:, None]


def _scatter_add(xp, shape, index, values):
    if xp is np:
        out = np.zeros(shape, np.float32)
        np.add.at(out, tuple(np.broadcast_arrays(*index)), values)
        return out
    # A scatter with a batch dimension, which XLA splits with a sharded batch (indexed
    # by an iota of batch rows, it gathered the rows). The rows' index is made from the
    # columns' so that both carry their sharding.
    _, rows, cols = index
    at = jnp.stack([jnp.zeros_like(cols) + rows, cols], axis=-1)
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(), inserted_window_dims=(1, 2), scatter_dims_to_operand_dims=(1, 2),
        operand_batching_dims=(0,), scatter_indices_batching_dims=(0,))
    return jax.lax.scatter_add(jnp.zeros(shape, jnp.float32), at, values, dims)
