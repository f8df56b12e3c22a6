"""Which (query, key) pairs are visible, and which survive dropout, for the XLA backend.

Masks are never materialised for a whole sequence: the backend keeps a few
per-token arrays (`TokenInfo`) and builds the boolean mask of one
(query block, key block) tile at a time from them. Dropout draws its keep
decisions from a counter-based hash of the global (batch, head, query, key)
indices, so any tiling (forward, backward, tests) sees the same mask.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from ...config import AttnConfig
from ...sequence import SequenceDescriptor

_INT = jnp.int32
# A query that is not a real token gets segment -1 and a key 0, so equal
# segments mean "both real and in the same sequence".
_Q_NONE, _KV_NONE = -1, 0


class TokenInfo(NamedTuple):
    """Per-token facts the mask needs; first axis is batch (or 1 when shared)."""
    q_pos: jax.Array                 # [b|1, s_q] position inside the sequence/segment
    kv_pos: jax.Array                # [b|1, s_kv]
    q_seg: Optional[jax.Array]       # [b, s_q] segment id, -1 = not a real query
    kv_seg: Optional[jax.Array]      # [b, s_kv] segment id, 0 = not a real key
    q_offset: Optional[jax.Array]    # [b|1, s_q] len_kv - len_q of the query's sequence


def token_info(config: AttnConfig, sequence: Optional[SequenceDescriptor]) -> TokenInfo:
    """Positions, segments and bottom-right offsets for `config.sequence`."""
    s_q, s_kv = config.s_q, config.s_kv
    ar_q = jnp.arange(s_q, dtype=_INT)[None, :]
    ar_kv = jnp.arange(s_kv, dtype=_INT)[None, :]
    if config.sequence == "dense" or sequence is None:
        offset = jnp.full((1, s_q), s_kv - s_q, _INT) if config.bottom_right else None
        return TokenInfo(ar_q, ar_kv, None, None, offset)
    if config.is_padded:
        q_len = sequence.q_lengths.astype(_INT)
        kv_len = sequence.kv_lengths.astype(_INT)
        q_seg = jnp.where(ar_q < q_len[:, None], 1, _Q_NONE).astype(_INT)
        kv_seg = jnp.where(ar_kv < kv_len[:, None], 1, _KV_NONE).astype(_INT)
        offset = None
        if config.bottom_right:
            offset = jnp.broadcast_to((kv_len - q_len)[:, None], q_seg.shape).astype(_INT)
        return TokenInfo(ar_q, ar_kv, q_seg, kv_seg, offset)
    # Packed: segment ids are 1-based, 0 marks padding.
    q_ids = sequence.q_segment_ids.astype(_INT)
    kv_ids = sequence.kv_segment_ids.astype(_INT)
    q_seg = jnp.where(q_ids > 0, q_ids, _Q_NONE)
    offset = None
    if config.bottom_right:
        per_segment = (sequence.kv_lengths - sequence.q_lengths).astype(_INT)  # [b, S]
        index = jnp.clip(q_ids - 1, 0, per_segment.shape[1] - 1)
        offset = jnp.take_along_axis(per_segment, index, axis=1)
    return TokenInfo(sequence.q_positions.astype(_INT), sequence.kv_positions.astype(_INT),
                     q_seg, kv_ids, offset)


def pad_token_info(info: TokenInfo, s_q_pad: int, s_kv_pad: int, batch: int) -> TokenInfo:
    """Extend to block-aligned lengths; the added tokens are never visible."""
    s_q, s_kv = info.q_pos.shape[1], info.kv_pos.shape[1]
    if (s_q, s_kv) == (s_q_pad, s_kv_pad):
        return info
    q_seg, kv_seg = info.q_seg, info.kv_seg
    if q_seg is None:  # dense: every real token is segment 1
        q_seg = jnp.ones((batch, s_q), _INT)
        kv_seg = jnp.ones((batch, s_kv), _INT)

    def pad(x, n, value):
        return None if x is None else jnp.pad(x, ((0, 0), (0, n - x.shape[1])),
                                              constant_values=value)
    return TokenInfo(pad(info.q_pos, s_q_pad, 0), pad(info.kv_pos, s_kv_pad, 0),
                     pad(q_seg, s_q_pad, _Q_NONE), pad(kv_seg, s_kv_pad, _KV_NONE),
                     pad(info.q_offset, s_q_pad, 0))


def has_mask(config: AttnConfig, info: TokenInfo) -> bool:
    """Whether any pair can be invisible (static)."""
    left, right = config.window_bounds()
    return info.q_seg is not None or left >= 0 or right >= 0


def tile_mask(config: AttnConfig, q: TokenInfo, kv: TokenInfo) -> Optional[jax.Array]:
    """Visible pairs of one tile, [b|1, bq, bk] bool (None: all visible).

    `q` and `kv` are `TokenInfo` slices for the tile's queries and keys (only
    the q_* fields of `q` and the kv_* fields of `kv` are read).
    """
    left, right = config.window_bounds()
    visible = None

    def both(a, b):
        return b if a is None else a & b
    if q.q_seg is not None:
        visible = q.q_seg[:, :, None] == kv.kv_seg[:, None, :]
    if left >= 0 or right >= 0:
        centre = q.q_pos
        if config.bottom_right:
            centre = centre + q.q_offset
        centre = centre[:, :, None]
        kv_pos = kv.kv_pos[:, None, :]
        if right >= 0:
            visible = both(visible, kv_pos <= centre + right)
        if left >= 0:
            visible = both(visible, kv_pos >= centre - left)
    return visible


# ---- dropout ---------------------------------------------------------------
def _mix(x: jax.Array) -> jax.Array:
    """A 32-bit avalanche mix (xor-shift-multiply); uint32 in, uint32 out."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def dropout_seed(rng: jax.Array) -> jax.Array:
    """Two uint32 words from a JAX PRNG key (raw or typed); the hash's key."""
    return jax.random.bits(rng, (2,), jnp.uint32)


def keep_tile(seed: jax.Array, rate: float, batch, head, q_idx, kv_idx) -> jax.Array:
    """Keep decisions for global indices (broadcastable int arrays) -> bool.

    A key is kept with probability 1 - rate. Indices are the tensor's own
    (batch, query head, query row, key row), so the decision for a pair does
    not depend on how the backend tiles the computation.
    """
    u = jnp.uint32
    row = _mix(seed[0] ^ _mix(batch.astype(u) * u(0x9E3779B1) + head.astype(u) + seed[1]))
    row = _mix(row ^ (q_idx.astype(u) * u(0x85EBCA77)))
    bits = _mix(row + kv_idx.astype(u) * u(0xC2B2AE3D))
    threshold = min(int(round(rate * 2.0 ** 32)), 2 ** 32 - 1)
    return bits >= u(threshold)


def dropout_keep_mask(config: AttnConfig, rng: jax.Array) -> jax.Array:
    """The whole keep mask ``[b, h_q, s_q, s_kv]`` the backend uses for `rng`.

    For tests and debugging (it materialises s_q x s_kv); the backend computes
    the same decisions tile by tile with `keep_tile`.
    """
    ar = lambda n: jnp.arange(n, dtype=_INT)  # noqa: E731
    return keep_tile(dropout_seed(rng), config.dropout,
                     ar(config.batch)[:, None, None, None], ar(config.h_q)[None, :, None, None],
                     ar(config.s_q)[None, None, :, None], ar(config.s_kv)[None, None, None, :])
