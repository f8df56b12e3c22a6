"""The element mask of a block map: an AND of terms, each a small pytree.

A kernel re-evaluates the element mask in partial blocks, so the map keeps the
terms themselves (the mask_mod and its arguments, the dense mask, the segment
ids, the per-row key intervals of the built-in masks). Every term answers
``term(b, h, q, kv)`` for index arrays shaped ``[B,1,1,1]``, ``[1,H,1,1]``,
``[1,1,R,1]``, ``[1,1,1,C]`` (global batch, query head, raw row and key indices)
with a boolean array broadcastable to ``[B, H, R, C]``. Indices past the
sequence are allowed (blocks overhang it); `ElementMask` masks them out.

`batch` / `heads` are the sizes of the map's axes the term varies over (1 when
it does not); `static` says its value is known at trace time (no array leaves
that could be traced), so its map is computed on the host.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from .dependence import Reads, mask_mod_reads

_pytree = jax.tree_util.register_pytree_node_class


def is_host(x) -> bool:
    """A concrete host array (numpy or a Python number): usable at trace time."""
    return isinstance(x, (np.ndarray, np.generic, int, float, bool))


def row_at(a, b, i):
    """``a[b, i]`` for a ``[B|1, n]`` array, index clipped so overhanging blocks are safe."""
    xp = np if all(is_host(x) for x in (a, b, i)) else jnp   # (NumPy on host arrays alone)
    a = xp.asarray(a)
    b = b if a.shape[0] > 1 else xp.zeros_like(b)
    return a[b, xp.clip(i, 0, a.shape[1] - 1)]


class InSegments:
    """`fn` (a mask_mod, or with `score` a score_mod taking the score first) seeing
    positions inside packed segments: it is called with raw positions, and the
    segments' positions come as its last two args (``[B|1, s_q]``, ``[B|1, s_kv]``), read
    per row and per column like any array. Equal for equal functions, so caches keyed
    on it hold."""

    def __init__(self, fn, score: bool = False):
        self.fn, self.score = fn, score

    def __call__(self, *a):
        k = 1 if self.score else 0
        (b, h, i, j), (*args, q_pos, kv_pos) = a[k:k + 4], a[k + 4:]
        return self.fn(*a[:k], b, h, row_at(q_pos, b, i), row_at(kv_pos, b, j), *args)

    def __eq__(self, other):
        return isinstance(other, InSegments) and (other.fn, other.score) == (self.fn, self.score)

    def __hash__(self):
        return hash((InSegments, self.fn, self.score))


@_pytree
class MaskMod:
    """``fn(b, h, q_idx, kv_idx, *args)``; with `q_pos` / `kv_pos` ``[B|1, s]`` the
    function sees those positions (inside packed segments) instead of raw indices."""

    def __init__(self, fn, args: Sequence = (), q_pos=None, kv_pos=None, *,
                 reads: Reads, batch: int, heads: int):
        self.fn, self.args, self.q_pos, self.kv_pos = fn, tuple(args), q_pos, kv_pos
        self.reads = reads
        self.batch = batch if reads.batch else 1
        self.heads = heads if reads.head else 1
        if q_pos is not None:
            self.batch = max(self.batch, q_pos.shape[0], kv_pos.shape[0])

    @classmethod
    def build(cls, fn, args, batch, heads, s_q, s_kv, q_pos=None, kv_pos=None) -> "MaskMod":
        reads = mask_mod_reads(fn, args, batch, heads, s_q, s_kv)
        return cls(fn, args, q_pos, kv_pos, reads=reads, batch=batch, heads=heads)

    @property
    def static(self) -> bool:
        return self.reads.positions_only and self.q_pos is None

    def without_args(self) -> "MaskMod":
        """The same function with zeros for its arguments: what a static map is
        evaluated with at trace time (the arguments may be tracers it never reads)."""
        zeros = tuple(np.zeros(np.shape(a), np.result_type(a) if is_host(a) else a.dtype)
                      for a in self.args)
        return MaskMod(self.fn, zeros, self.q_pos, self.kv_pos, reads=self.reads,
                       batch=self.batch, heads=self.heads)

    def __call__(self, b, h, q, kv):
        if self.q_pos is not None:
            return InSegments(self.fn)(b, h, q, kv, *self.args, self.q_pos, self.kv_pos)
        return self.fn(b, h, q, kv, *self.args)

    def tree_flatten(self):
        return (self.args, self.q_pos, self.kv_pos), (self.fn, self.reads, self.batch, self.heads)

    @classmethod
    def tree_unflatten(cls, aux, children):
        fn, reads, batch, heads = aux
        obj = cls.__new__(cls)
        obj.fn, obj.reads, obj.batch, obj.heads = fn, reads, batch, heads
        obj.args, obj.q_pos, obj.kv_pos = tuple(children[0]), children[1], children[2]
        return obj


@_pytree
class Dense:
    """A boolean mask ``[B|1, H|1, s_q, s_kv]`` (True: visible). `bits`: the same mask
    packed as the kernels read it (`kernel_mask.pack_bits`), once a device map made them."""

    def __init__(self, mask, bits=None):
        self.mask, self.bits = mask, bits

    @property
    def batch(self) -> int:
        return self.mask.shape[0]

    @property
    def heads(self) -> int:
        return self.mask.shape[1]

    @property
    def static(self) -> bool:
        return is_host(self.mask)

    def __call__(self, b, h, q, kv):
        m = self.mask
        # (NumPy on host positions: a static mask's evaluation is a plain index)
        xp = np if all(is_host(x) for x in (m, b, h, q, kv)) else jnp
        b = b if m.shape[0] > 1 else xp.zeros_like(b)
        h = h if m.shape[1] > 1 else xp.zeros_like(h)
        return xp.asarray(m)[b, h, xp.clip(q, 0, m.shape[2] - 1), xp.clip(kv, 0, m.shape[3] - 1)]

    def tree_flatten(self):
        return (self.mask, self.bits), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


@_pytree
class Segments:
    """Query ``i`` sees key ``j`` of the same row when their ids are equal and not
    `pad_id` (None: every id is a real segment). Ids ``[B|1, s]`` in any order."""

    def __init__(self, q_ids, kv_ids, pad_id: Optional[int] = 0):
        self.q_ids, self.kv_ids, self.pad_id = q_ids, kv_ids, pad_id

    @property
    def batch(self) -> int:
        return max(self.q_ids.shape[0], self.kv_ids.shape[0])

    heads = 1

    @property
    def static(self) -> bool:
        return is_host(self.q_ids) and is_host(self.kv_ids)

    def __call__(self, b, h, q, kv):
        qi, ki = row_at(jnp.asarray(self.q_ids), b, q), row_at(jnp.asarray(self.kv_ids), b, kv)
        same = qi == ki
        return same if self.pad_id is None else same & (qi != self.pad_id)

    def tree_flatten(self):
        return (self.q_ids, self.kv_ids), self.pad_id

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, pad_id=aux)


@_pytree
class Intervals:
    """Query row ``i`` sees the keys ``lo[i] <= j <= hi[i]`` (raw indices; lo > hi:
    none). Causal masks of both alignments, windows, padding lengths and sorted
    packed segments are each one interval per row, and so is their AND, so the
    built-in masks compose into one term whose map needs no S² work."""

    def __init__(self, lo, hi):
        self.lo, self.hi = lo, hi  # [B|1, s_q] int32

    @property
    def batch(self) -> int:
        return self.lo.shape[0]

    heads = 1

    @property
    def static(self) -> bool:
        return is_host(self.lo) and is_host(self.hi)

    def __call__(self, b, h, q, kv):
        lo, hi = row_at(self.lo, b, q), row_at(self.hi, b, q)
        return (kv >= lo) & (kv <= hi)

    def intersect(self, other: "Intervals") -> "Intervals":
        xp = np if self.static and other.static else jnp
        return Intervals(xp.maximum(self.lo, other.lo), xp.minimum(self.hi, other.hi))

    def tree_flatten(self):
        return (self.lo, self.hi), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


@_pytree
class ElementMask:
    """The AND of `terms` over a ``s_q x s_kv`` grid: what a kernel applies in a
    partial block. Pairs past either length are never visible."""

    def __init__(self, terms: Tuple, s_q: int, s_kv: int):
        self.terms, self.s_q, self.s_kv = tuple(terms), s_q, s_kv

    @property
    def batch(self) -> int:
        return max([t.batch for t in self.terms] + [1])

    @property
    def heads(self) -> int:
        return max([t.heads for t in self.terms] + [1])

    @property
    def static(self) -> bool:
        return all(t.static for t in self.terms)

    def for_host(self) -> "ElementMask":
        """This mask with mask_mods' unread arguments replaced (see `MaskMod.without_args`)."""
        return ElementMask([t.without_args() if isinstance(t, MaskMod) else t
                            for t in self.terms], self.s_q, self.s_kv)

    def __call__(self, b, h, q, kv):
        visible = (q < self.s_q) & (kv < self.s_kv)
        for t in self.terms:
            visible = visible & t(b, h, q, kv)
        return visible

    def tree_flatten(self):
        return (self.terms,), (self.s_q, self.s_kv)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)
