"""Tiled attention in plain JAX: online-softmax forward, FlashAttention-2 backward.

Layouts inside this module (already block-aligned by the caller):

* ``q``  ``[b, h_kv, g, S_q, d_qk]`` (query head ``h = kv_head * g + j``), so a
  GQA group shares its key/value tile without copying it;
* ``k``  ``[b, h_kv, S_kv, d_qk]``, ``v`` ``[b, h_kv, S_kv, d_v]``;
* ``bias`` ``[1|b, 1|h_q, S_q, S_kv]``; scores of one tile ``[b, h_kv, g, bq, bk]``.

The forward keeps only a running max, normaliser and fp32 accumulator per
query row and saves the fp32 log-sum-exp; the backward recomputes each tile's
probabilities from it. Memory is O(tile) beyond the inputs and outputs, never
O(S_q x S_kv). Tiles whose mask is empty are skipped with `lax.cond`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Tuple

import jax
import jax.numpy as jnp
from jax import lax

from ...config import AttnConfig
from .masks import TokenInfo, has_mask, keep_tile, tile_mask

F32 = jnp.float32
NEG_INF = -jnp.inf

# Scores of one tile, in fp32 elements (b * h_q * bq * bk). A call whose whole
# score matrix fits SINGLE_TILE runs as one tile (no loop: fastest for short
# sequences); otherwise tiles of at most TILE elements, sides in [MIN_BLOCK, MAX_BLOCK].
SINGLE_TILE = 1 << 24   # 64 MiB of fp32 scores
TILE = 1 << 21          # 8 MiB: larger tiles fall out of cache (measured on CPU)
MAX_BLOCK, MIN_BLOCK = 1024, 128


@dataclasses.dataclass(frozen=True)
class Tiling:
    block_q: int
    block_kv: int
    s_q: int      # padded to a multiple of block_q
    s_kv: int     # padded to a multiple of block_kv

    @property
    def n_q(self) -> int:
        return self.s_q // self.block_q

    @property
    def n_kv(self) -> int:
        return self.s_kv // self.block_kv

    @classmethod
    def from_blocks(cls, s_q: int, s_kv: int, block_q: int, block_kv: int) -> "Tiling":
        """Blocks of at most the given sizes, evened out so padding stays small."""
        def even(s, block):
            n = _ceil_div(s, block)
            if n == 1:
                return s
            return min(block, _ceil_div(_ceil_div(s, n), 8) * 8)  # s / n rounded up to 8
        bq, bk = even(s_q, block_q), even(s_kv, block_kv)
        return cls(bq, bk, _ceil_div(s_q, bq) * bq, _ceil_div(s_kv, bk) * bk)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def one_tile(config: AttnConfig) -> bool:
    """Whether the call's scores fit SINGLE_TILE (one tile, no loop)."""
    return config.batch * config.h_q * config.s_q * config.s_kv <= SINGLE_TILE


def choose_tiling(config: AttnConfig) -> Tiling:
    """One tile when the scores fit SINGLE_TILE, else the largest tiles within TILE."""
    rows = config.batch * config.h_q
    s_q, s_kv = config.s_q, config.s_kv
    if one_tile(config):
        return Tiling(s_q, s_kv, s_q, s_kv)
    bq, bk = min(s_q, MAX_BLOCK), min(s_kv, MAX_BLOCK)
    while rows * bq * bk > TILE and max(bq, bk) > MIN_BLOCK:
        if bq >= bk:
            bq = max(MIN_BLOCK, bq // 2)
        else:
            bk = max(MIN_BLOCK, bk // 2)
    return Tiling.from_blocks(s_q, s_kv, bq, bk)


# ---- one tile -------------------------------------------------------------
def _slice(x, start, size, axis):
    if x is None or (x.shape[axis] == size):
        return x
    return lax.dynamic_slice_in_dim(x, start, size, axis)


def _token_slice(info: TokenInfo, q0, bq, kv0, bk) -> Tuple[TokenInfo, TokenInfo]:
    q = TokenInfo(_slice(info.q_pos, q0, bq, 1), None, _slice(info.q_seg, q0, bq, 1), None,
                  _slice(info.q_offset, q0, bq, 1))
    kv = TokenInfo(None, _slice(info.kv_pos, kv0, bk, 1), None,
                   _slice(info.kv_seg, kv0, bk, 1), None)
    return q, kv


def _bias_tile(bias, q0, bq, kv0, bk, h_kv):
    """A [B, H, bq, bk] slice of the bias as fp32 [B, h_kv|1, g|1, bq, bk]."""
    t = _slice(_slice(bias, q0, bq, 2), kv0, bk, 3).astype(F32)
    if t.shape[1] == 1:
        return t[:, :, None]
    return t.reshape(t.shape[0], h_kv, -1, bq, bk)


def _reduce_bias_grad(ds, bias_shape):
    """Sum a [b, h_kv, g, bq, bk] gradient over the bias's broadcast dims."""
    b, h_kv, g, bq, bk = ds.shape
    ds = ds.reshape(b, h_kv * g, bq, bk)
    axes = tuple(a for a in (0, 1) if bias_shape[a] == 1)
    return ds.sum(axis=axes, keepdims=True) if axes else ds


class _Tile:
    """Everything about tile (q block at q0, kv block at kv0) that fwd and bwd share."""

    def __init__(self, config: AttnConfig, shape, info: TokenInfo, q0, kv0, bq, bk):
        self.config, self.shape = config, shape  # shape: (b, h_kv, g)
        self.q0, self.kv0, self.bq, self.bk = q0, kv0, bq, bk
        self.q_info, self.kv_info = _token_slice(info, q0, bq, kv0, bk)
        self.mask = tile_mask(config, self.q_info, self.kv_info) if has_mask(config, info) else None

    def any_visible(self):
        return None if self.mask is None else jnp.any(self.mask)

    def logits(self, q, k, bias, args, with_vjp=False):
        """Scaled, biased, score_mod'ed, masked fp32 logits; and score_mod's vjp."""
        cfg = self.config
        s = jnp.einsum("bhgqd,bhkd->bhgqk", q, k, preferred_element_type=F32) * F32(cfg.scale)
        if bias is not None:
            s = s + _bias_tile(bias, self.q0, self.bq, self.kv0, self.bk, self.shape[1])
        mod_vjp = None
        if cfg.score_mod is not None:
            s, mod_vjp = self._score_mod(s, args, with_vjp)
        if self.mask is not None:
            s = jnp.where(self.mask[:, None, None], s, NEG_INF)
        return s, mod_vjp

    def _score_mod(self, s, args, with_vjp):
        """Apply score_mod on the [b, h_q, bq, bk] view; vjp w.r.t. s and float args."""
        b, h_kv, g = self.shape
        shape5 = s.shape
        batch = jnp.arange(b, dtype=jnp.int32)[:, None, None, None]
        head = jnp.arange(h_kv * g, dtype=jnp.int32)[None, :, None, None]
        q_idx = self.q_info.q_pos[:, None, :, None]
        kv_idx = self.kv_info.kv_pos[:, None, None, :]
        float_at = [i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.inexact)]

        def mod(s5, *float_args):
            full = list(args)
            for i, a in zip(float_at, float_args):
                full[i] = a
            s4 = s5.reshape(b, h_kv * g, *shape5[3:])
            out = self.config.score_mod(s4, batch, head, q_idx, kv_idx, *full)
            return jnp.broadcast_to(out, s4.shape).astype(F32).reshape(shape5)
        if not with_vjp:
            return mod(s), None
        out, vjp = jax.vjp(mod, s, *(args[i] for i in float_at))
        return out, vjp

    def keep_scale(self, seed):
        """Dropout: fp32 factor per probability (0 or 1/(1-p)), [b, h_kv, g, bq, bk]."""
        b, h_kv, g = self.shape
        ar = lambda n: jnp.arange(n, dtype=jnp.int32)  # noqa: E731
        keep = keep_tile(seed, self.config.dropout, ar(b)[:, None, None, None],
                         ar(h_kv * g)[None, :, None, None],
                         (self.q0 + ar(self.bq))[None, None, :, None],
                         (self.kv0 + ar(self.bk))[None, None, None, :])
        factor = jnp.where(keep, F32(1.0 / (1.0 - self.config.dropout)), F32(0))
        return factor.reshape(b, h_kv, g, self.bq, self.bk)


def _mm_dtype(x_dtype):
    """Probabilities enter the second matmul in the inputs' precision (as flash kernels do)."""
    return F32 if x_dtype == F32 else x_dtype


def _sink(config: AttnConfig, offset, h_kv: int):
    """The extra logit of off-by-one / learnable softmax, [1, h_kv, g|1, 1]; None for vanilla."""
    if config.softmax == "off_by_one":
        return jnp.zeros((1, 1, 1, 1), F32)
    if config.softmax == "learnable":
        return offset.astype(F32).reshape(1, h_kv, -1, 1)
    return None


def _maybe_cond(pred, compute, skip, operand):
    return compute(operand) if pred is None else lax.cond(pred, compute, skip, operand)


def _loop(n, body, carry):
    """`lax.scan` over range(n) that collects per-step outputs; unrolled when n == 1."""
    if n == 1:
        carry, y = body(carry, jnp.int32(0))
        return carry, jax.tree_util.tree_map(lambda a: a[None], y)
    return lax.scan(body, carry, jnp.arange(n, dtype=jnp.int32))


# ---- forward --------------------------------------------------------------
def forward(config: AttnConfig, tiling: Tiling, q, k, v, bias, offset, info, seed, args):
    """-> out [b, h_kv, g, S_q, d_v] in q's dtype, lse [b, h_kv, g, S_q] fp32."""
    b, h_kv, g, _, _ = q.shape
    d_v = v.shape[-1]
    bq, bk = tiling.block_q, tiling.block_kv
    sink = _sink(config, offset, h_kv)

    def q_block(_, i):
        q0 = i * bq
        qb = _slice(q, q0, bq, 3)

        def kv_block(carry, j):
            kv0 = j * bk
            tile = _Tile(config, (b, h_kv, g), info, q0, kv0, bq, bk)

            def compute(carry):
                m, l, acc = carry
                kb, vb = _slice(k, kv0, bk, 2), _slice(v, kv0, bk, 2)
                s, _ = tile.logits(qb, kb, bias, args)
                m_new = jnp.maximum(m, s.max(axis=-1))
                m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # empty rows: no -inf - -inf
                p = jnp.exp(s - m_safe[..., None])
                alpha = jnp.exp(m - m_safe)
                l = alpha * l + p.sum(axis=-1)
                if config.has_dropout:
                    p = p * tile.keep_scale(seed)
                pv = jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(_mm_dtype(v.dtype)), vb,
                                preferred_element_type=F32)
                return m_new, l, alpha[..., None] * acc + pv
            pred = tile.any_visible() if tiling.n_kv > 1 else None
            return _maybe_cond(pred, compute, lambda c: c, carry), None

        init = (jnp.full((b, h_kv, g, bq), NEG_INF, F32), jnp.zeros((b, h_kv, g, bq), F32),
                jnp.zeros((b, h_kv, g, bq, d_v), F32))
        (m, l, acc), _ = _loop(tiling.n_kv, kv_block, init)
        if sink is not None:
            m_tot = jnp.maximum(m, sink)
            kept = jnp.exp(m - m_tot)
            l_tot = l * kept + jnp.exp(sink - m_tot)
            out = acc * (kept / l_tot)[..., None]
            lse = m_tot + jnp.log(l_tot)
        else:
            empty = l == 0.0
            l_safe = jnp.where(empty, 1.0, l)
            out = acc / l_safe[..., None]
            lse = jnp.where(empty, NEG_INF, m + jnp.log(l_safe))
        return None, (out.astype(q.dtype), lse)

    _, (out, lse) = _loop(tiling.n_q, q_block, None)
    # [n_q, b, h_kv, g, bq, ..] -> [b, h_kv, g, n_q * bq, ..]
    out = jnp.moveaxis(out, 0, 3).reshape(b, h_kv, g, tiling.s_q, d_v)
    lse = jnp.moveaxis(lse, 0, 3).reshape(b, h_kv, g, tiling.s_q)
    return out, lse


# ---- backward -------------------------------------------------------------
def backward(config: AttnConfig, tiling: Tiling, residuals, d_out, d_lse):
    """FlashAttention-2 backward: loop over kv blocks, then q blocks inside.

    Returns grads for (q, k, v, bias, offset, float score_mod args).
    """
    q, k, v, bias, offset, info, seed, args, out, lse = residuals
    b, h_kv, g, _, d_qk = q.shape
    bq, bk = tiling.block_q, tiling.block_kv
    # D = rowsum(dO * O); a cotangent on the lse adds P * dlse to dS, i.e. D -= dlse.
    delta = jnp.sum(d_out.astype(F32) * out.astype(F32), axis=-1)
    if d_lse is not None:
        delta = delta - d_lse.astype(F32)
    lse_bwd = jnp.where(lse == NEG_INF, jnp.inf, lse)  # empty rows: P = exp(s - inf) = 0
    float_at = [i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.inexact)]
    mm = _mm_dtype(q.dtype)

    def tile_grads(tile: _Tile, qb, kb, vb, dob, lse_b, delta_b):
        s, mod_vjp = tile.logits(qb, kb, bias, args, with_vjp=True)
        p = jnp.exp(s - lse_b[..., None])
        dp = jnp.einsum("bhgqd,bhkd->bhgqk", dob, vb, preferred_element_type=F32)
        p_used = p
        if config.has_dropout:
            keep = tile.keep_scale(seed)
            p_used, dp = p * keep, dp * keep
        dv = jnp.einsum("bhgqk,bhgqd->bhkd", p_used.astype(mm), dob, preferred_element_type=F32)
        ds = p * (dp - delta_b[..., None])
        d_args = ()
        if mod_vjp is not None:
            ds, *d_args = mod_vjp(ds)
        d_bias = _reduce_bias_grad(ds, bias.shape) if bias is not None else None
        ds_mm = ds.astype(mm)
        scale = F32(config.scale)
        dq = jnp.einsum("bhgqk,bhkd->bhgqd", ds_mm, kb, preferred_element_type=F32) * scale
        dk = jnp.einsum("bhgqk,bhgqd->bhkd", ds_mm, qb, preferred_element_type=F32) * scale
        return dq, dk, dv, d_bias, tuple(a.astype(F32) for a in d_args)

    def kv_block(carry, j):
        kv0 = j * bk
        kb, vb = _slice(k, kv0, bk, 2), _slice(v, kv0, bk, 2)

        def q_block(carry, i):
            dk_acc, dv_acc, dq_acc, dbias_acc, dargs_acc = carry
            q0 = i * bq
            tile = _Tile(config, (b, h_kv, g), info, q0, kv0, bq, bk)
            qb, dob = _slice(q, q0, bq, 3), _slice(d_out, q0, bq, 3)
            lse_b, delta_b = _slice(lse_bwd, q0, bq, 3), _slice(delta, q0, bq, 3)

            def compute(_):
                return tile_grads(tile, qb, kb, vb, dob, lse_b, delta_b)

            def skip(_):  # a tile with no visible pair contributes nothing
                return jax.tree_util.tree_map(
                    jnp.zeros_like, jax.eval_shape(compute, None))
            pred = tile.any_visible() if tiling.n_q * tiling.n_kv > 1 else None
            dq, dk, dv, d_bias, d_args = _maybe_cond(pred, compute, skip, None)
            dq_acc = _add_at(dq_acc, dq, q0, 3)
            if dbias_acc is not None:
                dbias_acc = _add_at(dbias_acc, d_bias, (q0, kv0), (2, 3))
            dargs_acc = tuple(a + d for a, d in zip(dargs_acc, d_args))
            return (dk_acc + dk, dv_acc + dv, dq_acc, dbias_acc, dargs_acc), None

        dq_acc, dbias_acc, dargs_acc = carry
        init = (jnp.zeros_like(kb, F32), jnp.zeros_like(vb, F32), dq_acc, dbias_acc, dargs_acc)
        (dk, dv, dq_acc, dbias_acc, dargs_acc), _ = _loop(tiling.n_q, q_block, init)
        return (dq_acc, dbias_acc, dargs_acc), (dk, dv)

    init = (jnp.zeros(q.shape, F32), None if bias is None else jnp.zeros(bias.shape, F32),
            tuple(jnp.zeros(args[i].shape, F32) for i in float_at))
    (dq, dbias, dargs), (dk, dv) = _loop(tiling.n_kv, kv_block, init)
    # [n_kv, b, h_kv, bk, d] -> [b, h_kv, n_kv * bk, d]
    dk = jnp.moveaxis(dk, 0, 2).reshape(k.shape)
    dv = jnp.moveaxis(dv, 0, 2).reshape(v.shape)

    d_offset = None
    if config.softmax == "learnable":
        sink = _sink(config, offset, h_kv)
        p_sink = jnp.exp(sink - lse_bwd)  # [b, h_kv, g, S_q]
        d_offset = -jnp.sum(p_sink * delta, axis=(0, 3)).reshape(offset.shape).astype(offset.dtype)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None if bias is None else dbias.astype(bias.dtype), d_offset,
            tuple(d.astype(args[i].dtype) for i, d in zip(float_at, dargs)))


def _add_at(acc, update, starts, axes):
    """acc[..., start:start+n, ...] += update along `axes` (in place inside loops)."""
    if not isinstance(axes, tuple):
        starts, axes = (starts,), (axes,)
    if all(acc.shape[a] == update.shape[a] for a in axes):
        return acc + update
    index = [0] * acc.ndim
    for s, a in zip(starts, axes):
        index[a] = s
    index = [jnp.asarray(i, jnp.int32) for i in index]
    current = lax.dynamic_slice(acc, index, update.shape)
    return lax.dynamic_update_slice(acc, current + update, index)


# ---- custom_vjp -----------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def tiled_attention(config, tiling, q, k, v, bias, offset, info, seed, args):
    """(out, lse) of block-aligned inputs; differentiable w.r.t. q, k, v, bias,
    offset, the lse cotangent included, and float score_mod args."""
    return forward(config, tiling, q, k, v, bias, offset, info, seed, args)


def _fwd(config, tiling, q, k, v, bias, offset, info, seed, args):
    out, lse = forward(config, tiling, q, k, v, bias, offset, info, seed, args)
    return (out, lse), (q, k, v, bias, offset, info, seed, args, out, lse)


def _bwd(config, tiling, residuals, cotangents):
    d_out, d_lse = cotangents
    dq, dk, dv, dbias, d_offset, d_float_args = backward(config, tiling, residuals, d_out, d_lse)
    args = residuals[7]
    d_args, it = [], iter(d_float_args)
    for a in args:
        d_args.append(next(it) if jnp.issubdtype(a.dtype, jnp.inexact) else None)
    # Token info and the dropout seed are integer data: no cotangent.
    return dq, dk, dv, dbias, d_offset, None, None, tuple(d_args)


tiled_attention.defvjp(_fwd, _bwd)
