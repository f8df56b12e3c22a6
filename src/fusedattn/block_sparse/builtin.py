"""The built-in masks (``mask``, ``window``, a padding or packed sequence
descriptor) as per-row key intervals, with the semantics of `fusedattn.config`
and the XLA backend's masks:

* positions are inside the sequence (packed: inside the segment); query
  segment ``n`` sees key segment ``n`` of its row only;
* ``causal``: ``j <= i``; ``causal_bottom_right``: ``j <= i + o`` with
  ``o = len_kv - len_q`` of the query's sequence (segment);
* ``window=(left, right)``: ``i + o - left <= j <= i + o + right`` (``-1``:
  unbounded; a causal mask forces ``right = 0``);
* padded queries see nothing; padded keys are never seen.

Every one of these leaves row ``i`` one interval of raw key indices (packed
segments are contiguous), so their AND is one `Intervals` term.
"""
from __future__ import annotations

from typing import Optional, Tuple

import jax.numpy as jnp
import numpy as np

from ..config import MASKS
from ..sequence import SequenceDescriptor
from .terms import Intervals


def check_window(window, mask: str) -> Tuple[int, int]:
    """(left, right), -1 unbounded, causal masks forcing right = 0 (as validation does)."""
    if mask not in MASKS:
        raise ValueError(f"mask must be one of {MASKS}, got {mask!r}")
    if window is None:
        left, right = -1, -1
    else:
        if (not isinstance(window, (tuple, list)) or len(window) != 2 or not all(
                isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in window)):
            raise TypeError(f"window must be a (left, right) pair of ints, got {window!r}")
        left, right = int(window[0]), int(window[1])
        if left < -1 or right < -1:
            raise ValueError(f"window sides must be >= 0, or -1 for unbounded, got {window!r}")
        if mask != "none" and right not in (0, -1):
            raise ValueError(f"window right side must be 0 (or -1) with mask={mask!r}, "
                             f"got window={window!r}")
    return left, (0 if mask != "none" else right)


def intervals(s_q: int, s_kv: int, mask: str = "none", window=None,
              sequence: Optional[SequenceDescriptor] = None) -> Intervals:
    """Per-row ``[lo, hi]`` of the built-in masks; numpy (static) without a descriptor."""
    left, right = check_window(window, mask)
    bottom_right = mask == "causal_bottom_right"
    if sequence is None or sequence.kind == "dense":
        i = np.arange(s_q, dtype=np.int64)[None, :]
        return _band(np, i, np.zeros((1, 1), np.int64), np.full((1, 1), s_kv, np.int64),
                     (s_kv - s_q) if bottom_right else 0, left, right)
    if sequence.kind == "padding":
        q_len = jnp.asarray(sequence.q_lengths, jnp.int32)[:, None]
        kv_len = jnp.asarray(sequence.kv_lengths, jnp.int32)[:, None]
        i = jnp.arange(s_q, dtype=jnp.int32)[None, :]
        iv = _band(jnp, i, jnp.zeros_like(kv_len), kv_len,
                   (kv_len - q_len) if bottom_right else 0, left, right)
        return Intervals(jnp.where(i < q_len, iv.lo, 1), jnp.where(i < q_len, iv.hi, 0))
    if sequence.kind == "packed":
        ids, per_row = _per_row(sequence)
        kv_len, kv_off = per_row(sequence.kv_lengths), per_row(sequence.kv_offsets)
        offset = (kv_len - per_row(sequence.q_lengths)) if bottom_right else 0
        iv = _band(jnp, jnp.asarray(sequence.q_positions, jnp.int32), kv_off, kv_off + kv_len,
                   offset, left, right, base=kv_off)
        return Intervals(jnp.where(ids > 0, iv.lo, 1), jnp.where(ids > 0, iv.hi, 0))
    raise ValueError(f"sequence.kind must be 'padding' or 'packed', got {sequence.kind!r}")


def covers_all(iv: Intervals, s_kv: int) -> bool:
    """Whether static intervals leave every key of every row visible."""
    return bool(np.all(np.asarray(iv.lo) <= 0) and np.all(np.asarray(iv.hi) >= s_kv - 1))


def narrows(s_q: int, s_kv: int, mask: str = "none", window=None) -> bool:
    """Whether ``mask`` and ``window`` (no sequence) hide a pair of the grid: a window as
    wide as the sequence hides none, and a map drops it."""
    return not covers_all(intervals(s_q, s_kv, mask, window), s_kv)


def in_segments(lo, hi, sequence: SequenceDescriptor) -> Intervals:
    """A mask of positions inside packed segments whose row at position ``r`` sees the
    keys at positions ``lo[r] .. hi[r]`` (host ``[s_q]``; lo > hi: none) as raw key
    intervals: row ``i`` of query segment ``n`` sees its row's key segment ``n`` from
    ``kv_offset + lo[q_position]``. AND it with `intervals` (the segments themselves),
    which keeps each row inside its segment and padded rows empty."""
    kv_off = _per_row(sequence)[1](sequence.kv_offsets)
    pos = jnp.clip(jnp.asarray(sequence.q_positions, jnp.int32), 0, len(lo) - 1)
    # (lo, hi lie in [-1, s_kv]: with an offset under s_kv they stay far inside int32)
    lo, hi = (jnp.asarray(a, jnp.int32)[pos] for a in (lo, hi))
    return Intervals(kv_off + lo, kv_off + hi)


def _per_row(sequence: SequenceDescriptor):
    """(query segment ids [b, s_q], a function taking a packed descriptor's per-segment
    array [b, S] to its value at each query row [b, s_q])."""
    ids = jnp.asarray(sequence.q_segment_ids, jnp.int32)
    seg = jnp.clip(ids - 1, 0, sequence.max_segments - 1)
    return ids, lambda a: jnp.take_along_axis(jnp.asarray(a, jnp.int32), seg, axis=1)


def _band(xp, pos, start, stop, offset, left, right, base=0) -> Intervals:
    """Keys ``[start, stop)`` narrowed to ``base + pos + offset - left .. + right``."""
    centre = base + pos + offset
    lo = xp.maximum(start, centre - left) if left >= 0 else start + 0 * pos
    hi = xp.minimum(stop - 1, centre + right) if right >= 0 else stop - 1 + 0 * pos
    # Clamp into int32 range before narrowing (huge windows); lo > hi means empty.
    lo = xp.clip(lo, -1, np.iinfo(np.int32).max).astype(np.int32)
    hi = xp.clip(hi, -1, np.iinfo(np.int32).max).astype(np.int32)
    return Intervals(lo, hi)
