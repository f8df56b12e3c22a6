"""Built-in score_mods: ALiBi and soft-capping.

Each is an ordinary score_mod, ``f(score, batch, head, q_idx, kv_idx) -> score``,
so every backend that runs score_mods (the XLA backend, the float64 oracle in
tests) runs it as written. They are also frozen dataclasses, hashable and
compared by value: two ``alibi(16)`` instances are equal, so configs that use
them share plans, graph caches and jit caches, and the cuDNN backend recognises
them and lowers them to cuDNN's own graph operations instead of refusing a
score_mod it cannot trace (``backends/cudnn.py`` says when it cannot).

    out = fusedattn.fused_attn(q, k, v, mask="causal", score_mod=score_mods.alibi(h_q))
    out = fusedattn.fused_attn(q, k, v, score_mod=score_mods.softcap(30.0))
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

__all__ = ["Alibi", "Masked", "SoftCap", "alibi", "alibi_slopes", "softcap", "t5_bucket"]


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The standard ALiBi slopes, float32 ``[num_heads]``, as cuDNN computes them.

    With ``n`` the largest power of two ``<= num_heads``: head ``i < n`` gets
    ``2 ** (-8 (i + 1) / n)``; the remaining heads ``n + k`` (``k = 0, 1, ...``) get
    ``2 ** (-4 (2k + 1) / n)``, i.e. the odd-numbered slopes of the ``2n``-head
    sequence. This is cudnn-frontend's ``detail::get_alibi_slope``
    (cudnn_frontend_utils.h), whose slopes cuDNN copies into the workspace at
    execute. The exponents are exact in float32 (``n`` is a power of two); the
    powers here are computed in float64 and rounded once to float32 (correctly
    rounded), which is what glibc's ``powf`` returns for them: the values are
    bitwise those of the frontend's function (checked for 1 to 128 heads).
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
        raise ValueError(f"alibi num_heads must be a positive int, got {num_heads!r}")
    h = int(num_heads)
    n = 1 << (h.bit_length() - 1)  # largest power of two <= h
    exponents = [-8.0 * (i + 1) / n for i in range(n)]
    exponents += [-4.0 * (2 * k + 1) / n for k in range(h - n)]
    return np.asarray([2.0 ** e for e in exponents], np.float64).astype(np.float32)


def t5_bucket(q_idx, kv_idx, num_buckets: int = 32, max_distance: int = 128,
              bidirectional: bool = True):
    """T5's relative-position bucket of each (query, key) pair, int32.

    The distance ``kv_idx - q_idx`` gets one bucket per value below half the buckets
    (of one direction), then buckets spaced logarithmically up to `max_distance`, past
    which all distances share the last one. Bidirectional: half the buckets for keys
    after the query. Otherwise keys after the query share bucket 0. A bias table read
    through it, ``s + table[h, t5_bucket(q_idx, kv_idx)]``, runs in the block-sparse
    kernels (a read by ``q_idx - kv_idx``) with the table's gradient.
    """
    rel = kv_idx - q_idx
    n = num_buckets
    if bidirectional:
        n //= 2
        base = jnp.where(rel > 0, n, 0)
        rel = jnp.abs(rel)
    else:
        base = 0
        rel = -jnp.minimum(rel, 0)
    exact = n // 2
    # (the logarithm at 0 is never taken: those distances are exact buckets)
    far = exact + (jnp.log(jnp.maximum(rel, exact).astype(jnp.float32) / exact)
                   / math.log(max_distance / exact) * (n - exact)).astype(jnp.int32)
    return (base + jnp.where(rel < exact, rel, jnp.minimum(far, n - 1))).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Alibi:
    """``score + slope[head] * (kv_idx - q_idx)`` with `alibi_slopes(num_heads)`.

    Positions are inside the sequence (for packed rows: inside the segment), as
    for every score_mod. Under a causal mask ``kv_idx <= q_idx``, so the term is a
    penalty growing linearly with distance. ``num_heads`` must equal the query
    head count of the call (the slopes are per query head).
    """
    num_heads: int

    def __post_init__(self):
        alibi_slopes(self.num_heads)  # validates
        object.__setattr__(self, "num_heads", int(self.num_heads))

    @property
    def __name__(self) -> str:  # what config.short() and test ids print
        return f"alibi{self.num_heads}"

    def slopes(self) -> np.ndarray:
        return alibi_slopes(self.num_heads)

    def __call__(self, score, batch, head, q_idx, kv_idx):
        slopes = jnp.asarray(self.slopes()).astype(score.dtype)
        distance = (jnp.asarray(kv_idx) - jnp.asarray(q_idx)).astype(score.dtype)
        return score + slopes[head] * distance


@dataclasses.dataclass(frozen=True)
class SoftCap:
    """``cap * tanh(score / cap)``: logits squashed smoothly into ``(-cap, cap)``."""
    cap: float

    def __post_init__(self):
        cap = self.cap
        if isinstance(cap, bool) or not isinstance(cap, (int, float, np.floating, np.integer)) \
                or not math.isfinite(cap) or cap <= 0:
            raise ValueError(f"softcap cap must be a finite positive number, got {cap!r}")
        object.__setattr__(self, "cap", float(cap))

    @property
    def __name__(self) -> str:
        return f"softcap{self.cap:g}"

    def __call__(self, score, batch, head, q_idx, kv_idx):
        cap = jnp.asarray(self.cap, score.dtype)
        return cap * jnp.tanh(score / cap)


def alibi(num_heads: int) -> Alibi:
    """The ALiBi score_mod for `num_heads` query heads (see `Alibi`)."""
    return Alibi(num_heads)


def softcap(cap: float) -> SoftCap:
    """The soft-capping score_mod ``cap * tanh(score / cap)`` (see `SoftCap`)."""
    return SoftCap(cap)


@dataclasses.dataclass(frozen=True)
class Masked:
    """A score_mod with a mask_mod (PyTorch FlexAttention's other half): the pairs
    ``mask_mod(batch, head, q_idx, kv_idx, *args)`` rejects get -inf after
    ``score_mod`` (or the plain score). `fused_attn(..., mask_mod=)` builds it, so
    every backend sees one score_mod; compared by the two functions."""
    score_mod: object
    mask_mod: object

    @property
    def __name__(self) -> str:
        inner = getattr(self.score_mod, "__name__", "score_mod") if self.score_mod else None
        mask = getattr(self.mask_mod, "__name__", "mask_mod")
        return f"{inner}+mask_mod={mask}" if inner else f"mask_mod={mask}"

    def __call__(self, score, batch, head, q_idx, kv_idx, *args):
        s = score if self.score_mod is None else self.score_mod(score, batch, head, q_idx,
                                                                kv_idx, *args)
        keep = self.mask_mod(batch, head, q_idx, kv_idx, *args)
        return jnp.where(keep, s, -jnp.inf)


@dataclasses.dataclass(frozen=True)
class Reindexed:
    """A score_mod (or, with ``mask``, a mask_mod) that sees other batch, head and
    position numbers than its caller passes: a piece of a call (a shard, a
    context-parallel block) computes with its own 0.. numbering, and the function
    must see the call's. ``indices(batch, head, q_idx, kv_idx, *extra)`` gives the
    call's numbers, `extra` being the last ``indices.n_extra`` score_mod_args (traced
    values such as a shard's first head). Built by fusedattn's own splitting, never by
    users; `reindexed` wraps a `Masked` part by part."""
    fn: object
    indices: "Starts"
    mask: bool = False

    @property
    def __name__(self) -> str:
        return f"{getattr(self.fn, '__name__', 'score_mod')}@{self.indices}"

    def __call__(self, *a):
        n = self.indices.n_extra
        extra, a = a[len(a) - n:], a[:len(a) - n]
        if self.mask:  # (batch, head, q_idx, kv_idx, *args)
            return self.fn(*self.indices(*a[:4], *extra), *a[4:])
        return self.fn(a[0], *self.indices(*a[1:5], *extra), *a[5:])


def reindexed(score_mod, indices: "Starts"):
    """`score_mod` seeing `indices`' numbers (see `Reindexed`); a `Masked` stays one, so
    a lowering still tells its mask from its score_mod."""
    if isinstance(score_mod, Masked):
        inner = None if score_mod.score_mod is None else Reindexed(score_mod.score_mod, indices)
        return Masked(inner, Reindexed(score_mod.mask_mod, indices, mask=True))
    return Reindexed(score_mod, indices)


@dataclasses.dataclass(frozen=True)
class Starts:
    """Indices of a piece of a call: its first batch row and query head come as two
    extra arguments; with `positions` (a context-parallel block) also the call's
    positions of its first query and key, as two more."""
    positions: bool = False

    @property
    def n_extra(self) -> int:
        return 4 if self.positions else 2

    def __call__(self, batch, head, q_idx, kv_idx, batch_start, head_start, *position_starts):
        if self.positions:
            q_start, kv_start = position_starts
            q_idx, kv_idx = q_idx + q_start, kv_idx + kv_start
        return batch + batch_start, head + head_start, q_idx, kv_idx

    def __str__(self) -> str:
        return "cp-block" if self.positions else "shard"


def reindexed_config(config, indices: Starts):
    """`config` (an AttnConfig) whose score_mod sees `indices`' numbers, its extra
    arguments added to the score_mod_args as int32 scalars."""
    return dataclasses.replace(config, score_mod=reindexed(config.score_mod, indices),
                               score_mod_arg_specs=tuple(config.score_mod_arg_specs)
                               + (((), "int32"),) * indices.n_extra)
