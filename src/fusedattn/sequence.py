"""`SequenceDescriptor`: which tokens of a [b, s, h, d] batch are real.

Two kinds, both pytrees (the arrays are traced; only the kind and the maximum
number of segments per row are static, so a descriptor passes through `jit`,
`vmap` and `shard_map` like any array argument):

* ``padding``: one sequence per row, ``q_lengths[b]`` / ``kv_lengths[b]`` valid
  tokens at the start of the row.
* ``packed`` (THD): up to ``max_segments`` sequences per row, back to back.
  Built from segment ids (1-based, 0 marks trailing padding) with optional
  positions, or from per-segment lengths and start offsets. Either way the
  descriptor carries both forms, since the XLA backend masks with ids and
  cuDNN addresses with ragged offsets.

Query segment ``n`` attends only to key segment ``n`` of the same row.

A third kind, ``ragged``, serves `fused_attn_small_seq` only: keys packed as
``[total_kv_tokens, h, d]`` with offsets ``[b + 1]`` (`from_kv_offsets`).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

_INT = jnp.int32


def _ids_to_lengths_offsets(ids: jax.Array, max_segments: int):
    """Segment ids [b, s] (1-based, sorted, 0 = padding) -> lengths, offsets [b, S]."""
    seg = jnp.arange(1, max_segments + 1, dtype=_INT)
    onehot = ids[:, :, None] == seg[None, None, :]  # [b, s, S]
    lengths = onehot.sum(axis=1).astype(_INT)
    # Segments are contiguous and sorted, so a segment starts after all earlier ones.
    offsets = (jnp.cumsum(lengths, axis=1) - lengths).astype(_INT)
    return lengths, offsets


def _lengths_offsets_to_ids(lengths: jax.Array, offsets: jax.Array, seq_len: int):
    """Per-segment lengths/offsets [b, S] -> segment ids and positions [b, s]."""
    t = jnp.arange(seq_len, dtype=_INT)[None, :, None]  # [1, s, 1]
    start = offsets[:, None, :]
    inside = (t >= start) & (t < start + lengths[:, None, :])  # [b, s, S]
    seg = jnp.arange(1, lengths.shape[1] + 1, dtype=_INT)
    ids = jnp.sum(jnp.where(inside, seg, 0), axis=-1).astype(_INT)
    pos = jnp.sum(jnp.where(inside, t - start, 0), axis=-1).astype(_INT)
    return ids, pos


@jax.tree_util.register_pytree_node_class
class SequenceDescriptor:
    """Describes padding or packing; build it with one of the classmethods."""

    _FIELDS = ("q_lengths", "kv_lengths", "q_segment_ids", "kv_segment_ids",
               "q_positions", "kv_positions", "q_offsets", "kv_offsets")

    def __init__(self, kind: str, max_segments: int = 1, shared_segments: bool = False,
                 **arrays):
        self.kind = kind
        self.max_segments = max_segments
        # Packed: the kv segments are the query segments (built from one set of ids or
        # lengths), so a segment's causal mask aligns alike top-left and bottom-right.
        self.shared_segments = shared_segments
        for name in self._FIELDS:
            setattr(self, name, arrays.get(name))
        # User-given packed positions, kept (outside the pytree) only so that
        # validation can check them against the derived ones.
        self._given_positions = (None, None)

    # ---- constructors ----------------------------------------------------
    @classmethod
    def from_lengths(cls, q_lengths, kv_lengths=None) -> "SequenceDescriptor":
        """Padding: row b holds ``q_lengths[b]`` queries and ``kv_lengths[b]`` keys."""
        q_lengths = jnp.asarray(q_lengths)
        kv_lengths = q_lengths if kv_lengths is None else jnp.asarray(kv_lengths)
        return cls("padding", q_lengths=q_lengths, kv_lengths=kv_lengths)

    @classmethod
    def from_segment_ids(cls, q_segment_ids, kv_segment_ids=None, *, q_positions=None,
                         kv_positions=None, max_segments: int) -> "SequenceDescriptor":
        """Packing from 1-based segment ids ``[b, s]`` (0 = padding at the end of a row).

        Positions default to the offset inside each segment; if given they must
        equal it (cuDNN addresses segments by offsets), which is checked when
        the arrays are concrete.
        """
        if not isinstance(max_segments, int) or max_segments < 1:
            raise ValueError(f"max_segments must be a positive int, got {max_segments!r}")
        q_ids = jnp.asarray(q_segment_ids)
        kv_ids = q_ids if kv_segment_ids is None else jnp.asarray(kv_segment_ids)
        for name, ids in (("q_segment_ids", q_ids), ("kv_segment_ids", kv_ids)):
            if ids.ndim != 2:
                raise ValueError(f"{name} must be [batch, seq_len] (one row per batch entry; "
                                 f"a single sequence is ids[None]), got shape {ids.shape}")
            if not jnp.issubdtype(ids.dtype, jnp.integer):
                raise TypeError(f"{name} must be an integer array, got {ids.dtype}")
        q_len, q_off = _ids_to_lengths_offsets(q_ids.astype(_INT), max_segments)
        kv_len, kv_off = _ids_to_lengths_offsets(kv_ids.astype(_INT), max_segments)
        q_pos_derived = _lengths_offsets_to_ids(q_len, q_off, q_ids.shape[-1])[1]
        kv_pos_derived = _lengths_offsets_to_ids(kv_len, kv_off, kv_ids.shape[-1])[1]
        desc = cls("packed", max_segments, kv_segment_ids is None,
                   q_lengths=q_len, kv_lengths=kv_len, q_offsets=q_off, kv_offsets=kv_off,
                   q_segment_ids=q_ids.astype(_INT), kv_segment_ids=kv_ids.astype(_INT),
                   q_positions=q_pos_derived, kv_positions=kv_pos_derived)
        # Kept for validation only: user positions must match the derived ones.
        desc._given_positions = (q_positions, q_positions if kv_segment_ids is None else kv_positions)
        return desc

    @classmethod
    def from_seqlens_offsets(cls, q_seqlens, q_offsets, kv_seqlens=None,
                             kv_offsets=None, *, q_len: int, kv_len: Optional[int] = None
                             ) -> "SequenceDescriptor":
        """Packing from per-segment lengths and start offsets, both ``[b, S]``.

        ``q_len``/``kv_len`` are the row lengths (the tensors' s dimension),
        needed statically to derive segment ids. Unused segments have length 0.
        """
        shared = kv_seqlens is None and kv_offsets is None and kv_len is None
        q_seqlens = jnp.asarray(q_seqlens).astype(_INT)
        q_offsets = jnp.asarray(q_offsets).astype(_INT)
        kv_seqlens = q_seqlens if kv_seqlens is None else jnp.asarray(kv_seqlens).astype(_INT)
        kv_offsets = q_offsets if kv_offsets is None else jnp.asarray(kv_offsets).astype(_INT)
        kv_len = q_len if kv_len is None else kv_len
        if q_seqlens.ndim != 2:
            raise ValueError(f"q_seqlens must be [batch, max_segments], got shape {q_seqlens.shape}")
        q_ids, q_pos = _lengths_offsets_to_ids(q_seqlens, q_offsets, q_len)
        kv_ids, kv_pos = _lengths_offsets_to_ids(kv_seqlens, kv_offsets, kv_len)
        return cls("packed", q_seqlens.shape[1], shared,
                   q_lengths=q_seqlens, kv_lengths=kv_seqlens, q_offsets=q_offsets,
                   kv_offsets=kv_offsets, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                   q_positions=q_pos, kv_positions=kv_pos)

    @classmethod
    def from_kv_offsets(cls, kv_offsets) -> "SequenceDescriptor":
        """Small-seq packed keys: sequence ``b`` owns rows ``[kv_offsets[b], kv_offsets[b+1])``
        of ``k, v [total_kv_tokens, h, d]``; one query per sequence (kind ``ragged``)."""
        kv_offsets = jnp.asarray(kv_offsets)
        if kv_offsets.ndim != 1 or kv_offsets.shape[0] < 2:
            raise ValueError(f"kv_offsets must be [num_sequences + 1], got shape {kv_offsets.shape}")
        if not jnp.issubdtype(kv_offsets.dtype, jnp.integer):
            raise TypeError(f"kv_offsets must be an integer array, got {kv_offsets.dtype}")
        kv_offsets = kv_offsets.astype(_INT)
        return cls("ragged", kv_offsets=kv_offsets, kv_lengths=kv_offsets[1:] - kv_offsets[:-1])

    # ---- pytree ------------------------------------------------------------
    def tree_flatten(self):
        return (tuple(getattr(self, n) for n in self._FIELDS),
                (self.kind, self.max_segments, self.shared_segments))

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*aux, **dict(zip(cls._FIELDS, children)))

    def __repr__(self) -> str:
        shapes = {n: getattr(getattr(self, n), "shape", None) for n in self._FIELDS
                  if getattr(self, n) is not None}
        return f"SequenceDescriptor({self.kind}, max_segments={self.max_segments}, {shapes})"

    # ---- helpers backends use ---------------------------------------------
    def padding_masks(self, s_q: int, s_kv: int):
        """Boolean [b, s_q], [b, s_kv] masks of real tokens, for either kind."""
        if self.kind == "packed":
            return self.q_segment_ids > 0, self.kv_segment_ids > 0
        q = jnp.arange(s_q)[None, :] < self.q_lengths[:, None]
        kv = jnp.arange(s_kv)[None, :] < self.kv_lengths[:, None]
        return q, kv
