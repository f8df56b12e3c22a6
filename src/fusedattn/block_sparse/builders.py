"""Builders of `BlockMap`s: from a mask_mod, a dense boolean mask, segment ids and
the built-in masks, and the AND of maps.

Every builder makes an `ElementMask` (the AND of its terms) and classifies it;
a map whose terms are all known at trace time is computed on the host, the
others on the device (see `classify`). Built-in masks (causal, window, padding)
fold into one per-row interval term, so adding them to any map is cheap.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from ..sequence import SequenceDescriptor
from . import builtin
from .block_map import BlockMap
from .classify import classify, on_host
from .kernel_mask import with_bits
from .terms import Dense, ElementMask, Intervals, MaskMod, Segments, is_host

DEFAULT_BLOCK = (128, 128)


def block_map(mask_mod=None, b: int = 1, h: int = 1, s_q: Optional[int] = None,
              s_kv: Optional[int] = None, *, args: Sequence = (),
              block: Tuple[int, int] = DEFAULT_BLOCK, mask: str = "none", window=None,
              sequence: Optional[SequenceDescriptor] = None) -> BlockMap:
    """The block map of ``mask_mod(b, h, q_idx, kv_idx, *args) -> bool`` (True: the
    pair is visible) over ``b`` batch rows, ``h`` query heads and ``s_q x s_kv``
    positions, ANDed with the built-in ``mask``, ``window`` and ``sequence``
    (as `fused_attn` takes them). Like torch's ``create_block_mask``: build it once
    per step and pass it to every layer.

    A mask_mod that reads only the positions (not ``b``, ``h`` or ``args``) gets a
    static map, computed on the host now. With a packed ``sequence`` the mask_mod
    sees positions inside each segment, as `fused_attn` gives them.
    """
    s_q, s_kv = _lengths(s_q, s_kv)
    block = _block(block)
    terms = []
    if mask_mod is not None:
        if not callable(mask_mod):
            raise TypeError(f"mask_mod must be a function (b, h, q_idx, kv_idx, *args) -> bool, "
                            f"got {type(mask_mod).__name__}")
        pos = (None, None)
        if sequence is not None and sequence.kind == "packed":
            pos = (sequence.q_positions, sequence.kv_positions)
        terms.append(MaskMod.build(mask_mod, tuple(args), _positive(b, "b"), _positive(h, "h"),
                                   s_q, s_kv, *pos))
    terms.append(builtin.intervals(s_q, s_kv, mask, window, sequence))
    element = ElementMask(terms, s_q, s_kv)
    key = None
    if element.static:  # the kinds are a function of these alone
        key = (mask_mod, s_q, s_kv, mask, None if window is None else tuple(window), block)
    return from_element(element, block, cache_key=key)


def from_builtin(s_q: int, s_kv: Optional[int] = None, *, mask: str = "none", window=None,
                 sequence: Optional[SequenceDescriptor] = None,
                 block: Tuple[int, int] = DEFAULT_BLOCK) -> BlockMap:
    """The map of the built-in masks alone (static without a sequence descriptor)."""
    return block_map(None, s_q=s_q, s_kv=s_kv, mask=mask, window=window, sequence=sequence,
                     block=block)


def from_dense_mask(mask, *, block: Tuple[int, int] = DEFAULT_BLOCK) -> BlockMap:
    """The map of a boolean mask ``[b|1, h|1, s_q, s_kv]`` (fewer leading axes are
    taken as 1), True where visible: jax.nn's and Flax's ``mask``. Static when the
    mask is a numpy array."""
    m = mask if is_host(mask) else jnp.asarray(mask)
    if m.dtype != np.bool_:
        raise TypeError(f"mask must be boolean (True: visible), got {m.dtype}")
    if not 2 <= m.ndim <= 4:
        raise ValueError(f"mask must be [b|1, h|1, s_q, s_kv], got shape {m.shape}")
    m = m.reshape((1,) * (4 - m.ndim) + m.shape)
    return from_element(ElementMask([Dense(m)], m.shape[2], m.shape[3]), _block(block))


def from_segment_ids(q_segment_ids, kv_segment_ids=None, *, pad_id: Optional[int] = 0,
                     mask: str = "none", window=None,
                     block: Tuple[int, int] = DEFAULT_BLOCK) -> BlockMap:
    """Documents: query ``i`` sees key ``j`` of its row when their ids ``[b, s]`` are
    equal and not ``pad_id`` (None: no id is padding). Ids may come in any order;
    q and kv ids may differ. ``mask`` / ``window`` apply to raw row indices.
    The map is exact when ids lie in ``[0, s_q + s_kv)`` (as segment ids are made:
    0..n_docs, 0 the padding); other ids may make a block partial that could be
    empty (never wrong: partial blocks apply the exact mask)."""
    q_ids = _ids(q_segment_ids)
    kv_ids = q_ids if kv_segment_ids is None else _ids(kv_segment_ids)
    s_q, s_kv = q_ids.shape[1], kv_ids.shape[1]
    terms = [Segments(q_ids, kv_ids, pad_id), builtin.intervals(s_q, s_kv, mask, window)]
    return from_element(ElementMask(terms, s_q, s_kv), _block(block))


def intersect(*maps: BlockMap) -> BlockMap:
    """The map of the AND of the maps' masks (same lengths and block sizes).
    Classified again from the combined element mask, so it is exact: two partial
    blocks whose visible pairs do not meet become empty."""
    if not maps:
        raise ValueError("intersect needs at least one map")
    first = maps[0]
    for m in maps[1:]:
        if (m.s_q, m.s_kv, m.block) != (first.s_q, first.s_kv, first.block):
            raise ValueError(f"maps differ: {(m.s_q, m.s_kv, m.block)} vs "
                             f"{(first.s_q, first.s_kv, first.block)}")
    terms = [t for m in maps for t in m.element.terms]
    return from_element(ElementMask(terms, first.s_q, first.s_kv), first.block)


def from_element(element: ElementMask, block: Tuple[int, int], cache_key=None) -> BlockMap:
    """Classify `element` (its interval terms merged into one) and list its blocks.
    A static map's kinds are kept under `cache_key` (hashable, or None), so a map
    rebuilt every step (or every trace) costs its host work once."""
    element = _merge_intervals(element)
    if on_host(element):
        return BlockMap.from_kind(_host_kind(element, block, cache_key), element, block)
    return _on_device(element, block)


_HOST_KINDS: dict = {}
_HOST_KINDS_SIZE = 64


def _host_kind(element: ElementMask, block, key):
    try:
        kind = _HOST_KINDS.get(key) if key is not None else None
    except TypeError:  # an unhashable mask_mod: no caching
        key = kind = None
    if kind is None:
        kind = classify(element, block, host=True)
        kind.flags.writeable = False
        if key is not None:
            if len(_HOST_KINDS) >= _HOST_KINDS_SIZE:
                _HOST_KINDS.pop(next(iter(_HOST_KINDS)))
            _HOST_KINDS[key] = kind
    return kind


def _on_device(element: ElementMask, block: Tuple[int, int]) -> BlockMap:
    # One compiled program per mask: eager op-by-op dispatch would compile each op. The
    # element's host arrays (the built-in masks' intervals, say) stay constants of that
    # program, so its classifier still sees them as known at trace time.
    # (Large host arrays, a dense mask say, stay arguments: not hashed, not embedded.)
    leaves, tree = jax.tree_util.tree_flatten(element)
    keep = [is_host(x) and np.size(x) <= _MAX_CONSTANT for x in leaves]
    host = _HostLeaves(tuple(x if k else None for x, k in zip(leaves, keep)))
    return _device_map(tuple(None if k else x for x, k in zip(leaves, keep)), tree, host, block)


_MAX_CONSTANT = 1 << 20   # elements of a host array kept as a constant of a device map


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _device_map(traced, tree, host, block):
    element = jax.tree_util.tree_unflatten(
        tree, [t if h is None else h for t, h in zip(traced, host.leaves)])
    element = with_bits(element)
    return BlockMap.from_kind(classify(element, block, host=False), element, block)


class _HostLeaves:
    """Host arrays as a static argument of `_device_map`: equal by value."""

    def __init__(self, leaves):
        self.leaves = leaves
        self._key = tuple(None if x is None else (np.shape(x), np.result_type(x).str,
                                                  np.asarray(x).tobytes()) for x in leaves)

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _HostLeaves) and self._key == other._key


def _merge_intervals(element: ElementMask) -> ElementMask:
    intervals = [t for t in element.terms if isinstance(t, Intervals)]
    others = [t for t in element.terms if not isinstance(t, Intervals)]
    if not intervals:
        return element
    merged = intervals[0]
    for t in intervals[1:]:
        merged = merged.intersect(t)
    # An all-visible interval adds nothing to another term's evaluation.
    if others and merged.static and builtin.covers_all(merged, element.s_kv):
        return ElementMask(others, element.s_q, element.s_kv)
    return ElementMask(others + [merged], element.s_q, element.s_kv)


def _ids(ids):
    a = ids if is_host(ids) else jnp.asarray(ids)
    if a.ndim != 2 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"segment ids must be integers [b, s], got {a.dtype} {a.shape}")
    return a


def _lengths(s_q, s_kv):
    s_q = _positive(s_q, "s_q")
    return s_q, (s_q if s_kv is None else _positive(s_kv, "s_kv"))


def _block(block):
    if (not isinstance(block, (tuple, list)) or len(block) != 2):
        raise TypeError(f"block must be a (block_q, block_kv) pair of ints, got {block!r}")
    return _positive(block[0], "block_q"), _positive(block[1], "block_kv")


def _positive(n, name) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{name} must be a positive int, got {n!r}")
    return int(n)
