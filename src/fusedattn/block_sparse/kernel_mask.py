"""The element mask in the form a kernel evaluates inside a partial block.

A kernel cannot gather, so each term of an `ElementMask` becomes per-row arrays
(read once per query tile), per-column arrays (read with each key block), a
dense tile, or a pure function of positions. A mask_mod that reads arrays gives
the values it reads per row or per column (see `hoisting`). ``fn(b, h, q, kv,
q_vals, kv_vals, dense)`` then works on any broadcasting shapes: 2-D position
tiles inside the Mosaic kernels, ``[R, 1]`` / ``[1, C]`` in the jnp reference.
"""
from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .dependence import specs_of
from .hoisting import Unsupported, hoist  # (Unsupported: this module's error too)
from .kernel_parts import WORD, whole
from .terms import Dense, ElementMask, InSegments, Intervals, MaskMod, Segments


class KernelMask(NamedTuple):
    q_arrays: Optional[jnp.ndarray]   # int32 [B|1, n, s_q] or None
    kv_arrays: Optional[jnp.ndarray]  # int32 [B|1, n, s_kv] or None
    dense: Optional[jnp.ndarray]      # int32 bits [B|1, H|1, whole s_kv / 32, whole s_q] or None
    fn: Callable                      # (b, h, q, kv, q_vals, kv_vals, dense) -> bool


def pack_bits(mask, s_q_whole: int, s_kv_whole: int):
    """A boolean mask ``[B|1, H|1, s_q, s_kv]`` as int32 words ``[B|1, H|1, s_kv_whole
    / 32, s_q_whole]`` (padding not visible; the layout: `kernel_parts.WORD`)."""
    B, H, s_q, s_kv = mask.shape
    m = jnp.pad(jnp.asarray(mask, bool),
                ((0, 0), (0, 0), (0, s_q_whole - s_q), (0, s_kv_whole - s_kv)))
    # Bytes of 8 keys, then 4 bytes a word (bitcast: the first byte is the low one):
    # XLA reduces 8 bytes a step faster than 32 words.
    m = m.reshape(B, H, s_q_whole, s_kv_whole // 8, 8).astype(jnp.uint8)
    octets = (m << jnp.arange(8, dtype=jnp.uint8)).sum(-1, dtype=jnp.uint8)
    words = jax.lax.bitcast_convert_type(
        octets.reshape(B, H, s_q_whole, s_kv_whole // WORD, WORD // 8), jnp.int32)
    return jnp.swapaxes(words, -1, -2)


def with_bits(element: ElementMask) -> ElementMask:
    """`element` with its dense mask terms packed once: a device map reduces the
    words (`kinds_of_bits`) and the kernels read the same words, so the ``s_q x
    s_kv`` mask is read once per step, not once for the map and once to pack."""
    terms = [Dense(t.mask, pack_bits(t.mask, whole(element.s_q), whole(element.s_kv)))
             if isinstance(t, Dense) and t.bits is None else t for t in element.terms]
    return ElementMask(terms, element.s_q, element.s_kv)


def kinds_of_bits(words, n_q: int, n_kv: int, block):
    """(any, all) visible per (query block, key block), ``[B|1, H|1, n_q, n_kv]``, of
    packed words; None where the blocks do not cover whole words inside them."""
    bq, bk = block
    if bk % WORD or n_kv * bk > words.shape[2] * WORD or n_q * bq > words.shape[3]:
        return None
    w = words[:, :, :n_kv * bk // WORD, :n_q * bq]
    w = w.reshape(w.shape[0], w.shape[1], n_kv, bk // WORD, n_q, bq)
    any_, all_ = (w != 0).any(axis=(3, 5)), (w == -1).all(axis=(3, 5))
    return jnp.swapaxes(any_, 2, 3), jnp.swapaxes(all_, 2, 3)


def kernel_mask(element: ElementMask) -> KernelMask:
    q_arrays: List = []
    kv_arrays: List = []
    parts: List[Callable] = []
    dense = None
    for term in element.terms:
        if isinstance(term, Intervals):
            a = len(q_arrays)
            q_arrays += [term.lo, term.hi]
            parts.append(lambda b, h, q, kv, qv, kvv, d, a=a: (kv >= qv[a]) & (kv <= qv[a + 1]))
        elif isinstance(term, Segments):
            a, c, pad = len(q_arrays), len(kv_arrays), term.pad_id
            q_arrays.append(term.q_ids)
            kv_arrays.append(term.kv_ids)

            def seg(b, h, q, kv, qv, kvv, d, a=a, c=c, pad=pad):
                same = qv[a] == kvv[c]
                return same if pad is None else same & (qv[a] != pad)
            parts.append(seg)
        elif isinstance(term, MaskMod):
            if term.reads.args:
                parts.append(_hoisted(term, element, q_arrays, kv_arrays))
                continue
            fn, args = term.fn, term.without_args().args
            if term.q_pos is None:
                parts.append(lambda b, h, q, kv, qv, kvv, d, fn=fn, args=args:
                             fn(b, h, q, kv, *args))
            else:
                a, c = len(q_arrays), len(kv_arrays)
                q_arrays.append(term.q_pos)
                kv_arrays.append(term.kv_pos)
                parts.append(lambda b, h, q, kv, qv, kvv, d, fn=fn, args=args, a=a, c=c:
                             fn(b, h, qv[a], kvv[c], *args))
        elif isinstance(term, Dense):
            if dense is not None:
                raise Unsupported("more than one dense mask term")
            dense = term.bits if term.bits is not None else \
                pack_bits(term.mask, whole(element.s_q), whole(element.s_kv))
            parts.append(lambda b, h, q, kv, qv, kvv, d: d)
        else:
            raise Unsupported(f"no in-kernel form for mask term {type(term).__name__}")

    def fn(b, h, q, kv, qv, kvv, d):
        visible = None
        for p in parts:
            x = p(b, h, q, kv, qv, kvv, d)
            visible = x if visible is None else visible & x
        return jnp.ones(jnp.broadcast_shapes(jnp.shape(q), jnp.shape(kv)), bool) \
            if visible is None else visible
    return KernelMask(_stack(q_arrays), _stack(kv_arrays), dense, fn)


def _hoisted(term: MaskMod, element: ElementMask, q_arrays: List, kv_arrays: List):
    """The part of a mask_mod that reads arrays: the values it reads appended to
    q_arrays / kv_arrays, the rest evaluated on tiles."""
    fn, args = term.fn, term.args
    if term.q_pos is not None:
        # packed positions are per-row / per-column reads too: hoisted with the rest
        fn, args = InSegments(fn), args + (term.q_pos, term.kv_pos)
    split = hoist(fn, specs_of(args), term.batch, term.heads, element.s_q, element.s_kv)
    rows, cols = split.values(args)
    a, c = len(q_arrays), len(kv_arrays)
    q_arrays += rows
    kv_arrays += cols

    def part(b, h, q, kv, qv, kvv, d):
        return split(b, h, q, kv, qv[a:a + split.n_rows], kvv[c:c + split.n_cols])
    return part


def _stack(arrays):
    """int32 [B|1, n, s] (batch broadcast to the largest), or None."""
    if not arrays:
        return None
    batch = max(np.shape(a)[0] for a in arrays)
    rows = [jnp.broadcast_to(jnp.asarray(a, jnp.int32), (batch, np.shape(a)[1])) for a in arrays]
    return jnp.stack(rows, axis=1)
