"""Float64 NumPy reference attention: forward and gradients, dense and direct.

Independent of every backend: it materialises the full score matrix, builds
the mask from the sequence description itself, and differentiates by hand
(closed-form softmax backward). score_mod, a JAX function by contract, runs in
float64 under `jax.enable_x64` and is differentiated with `jax.vjp`.

Inputs are NumPy arrays in bshd order (`q [b, s_q, h_q, d_qk]`, `k [b, s_kv, h_kv,
d_qk]`, `v [b, s_kv, h_kv, d_v]`); anything else (layouts, packed qkv) is the
caller's to unpack.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import numpy as np


class Reference(NamedTuple):
    out: np.ndarray                  # [b, s_q, h_q, d_v]
    lse: np.ndarray                  # [b, h_q, s_q] (sink included; -inf for empty rows)
    dq: Optional[np.ndarray] = None
    dk: Optional[np.ndarray] = None
    dv: Optional[np.ndarray] = None
    dbias: Optional[np.ndarray] = None
    d_offset: Optional[np.ndarray] = None
    d_score_mod_args: Tuple[np.ndarray, ...] = ()


def _tokens_from_lengths(lengths: np.ndarray, s: int):
    """Padding: (segment [b, s] with 0 for padding, position [b, s], sequence length [b, s])."""
    idx = np.arange(s)[None, :]
    seg = (idx < lengths[:, None]).astype(np.int64)
    return seg, np.broadcast_to(idx, seg.shape).copy(), np.broadcast_to(lengths[:, None], seg.shape).copy()


def _tokens_from_segment_ids(ids: np.ndarray):
    """Packing: positions count tokens of the same segment before this one; lengths count all."""
    b, s = ids.shape
    pos = np.zeros((b, s), np.int64)
    length = np.zeros((b, s), np.int64)
    for row in range(b):
        for t in range(s):
            same = ids[row] == ids[row, t]
            pos[row, t] = np.count_nonzero(same[:t])
            length[row, t] = np.count_nonzero(same)
    return ids.astype(np.int64), pos, length


def visibility(b: int, s_q: int, s_kv: int, *, mask: str = "none",
               window: Optional[Tuple[int, int]] = None,
               q_lengths=None, kv_lengths=None, q_segment_ids=None, kv_segment_ids=None):
    """Visible pairs [b, s_q, s_kv] plus (q positions [b, s_q], kv positions [b, s_kv])."""
    if q_segment_ids is not None:
        q_seg, q_pos, q_len = _tokens_from_segment_ids(np.asarray(q_segment_ids))
        kv_ids = q_segment_ids if kv_segment_ids is None else kv_segment_ids
        kv_seg, kv_pos, _ = _tokens_from_segment_ids(np.asarray(kv_ids))
        # Per query: the length of its segment on the key side.
        kv_len = np.zeros_like(q_len)
        for row in range(b):
            for t in range(s_q):
                kv_len[row, t] = np.count_nonzero(kv_seg[row] == q_seg[row, t])
    else:
        ql = np.full(b, s_q) if q_lengths is None else np.asarray(q_lengths)
        kl = np.full(b, s_kv) if kv_lengths is None else np.asarray(kv_lengths)
        q_seg, q_pos, q_len = _tokens_from_lengths(ql, s_q)
        kv_seg, kv_pos, _ = _tokens_from_lengths(kl, s_kv)
        kv_len = np.broadcast_to(kl[:, None], q_seg.shape)
    vis = (q_seg[:, :, None] > 0) & (q_seg[:, :, None] == kv_seg[:, None, :])
    left, right = window if window is not None else (-1, -1)
    if mask != "none":
        right = 0
    shift = (kv_len - q_len) if mask == "causal_bottom_right" else np.zeros_like(q_len)
    i = (q_pos + shift)[:, :, None]
    j = kv_pos[:, None, :]
    if right >= 0:
        vis &= j <= i + right
    if left >= 0:
        vis &= j >= i - left
    return vis, q_pos, kv_pos


def _apply_score_mod(score_mod: Callable, s: np.ndarray, q_pos, kv_pos, args: Sequence):
    """score_mod in float64 and its vjp with respect to the score and float args."""
    import jax
    import jax.numpy as jnp
    with jax.enable_x64(True):
        b, h = s.shape[:2]
        batch = jnp.arange(b)[:, None, None, None]
        head = jnp.arange(h)[None, :, None, None]
        q_idx = jnp.asarray(q_pos)[:, None, :, None]
        kv_idx = jnp.asarray(kv_pos)[:, None, None, :]
        args = [jnp.asarray(a) for a in args]
        float_at = [n for n, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating)]
        float_args = [args[n].astype(jnp.float64) for n in float_at]

        def mod(score, *fargs):
            full = list(args)
            for n, a in zip(float_at, fargs):
                full[n] = a
            return jnp.broadcast_to(score_mod(score, batch, head, q_idx, kv_idx, *full), score.shape)
        out, vjp = jax.vjp(mod, jnp.asarray(s, jnp.float64), *float_args)

    def backward(ds):
        with jax.enable_x64(True):
            grads = vjp(jnp.asarray(ds, jnp.float64))
        return np.asarray(grads[0]), tuple(np.asarray(g) for g in grads[1:])
    return np.asarray(out, np.float64), backward


def attention(q, k, v, *, bias=None, mask="none", window=None, scale=None, softmax="vanilla",
              softmax_offset=None, dropout=0.0, keep=None, q_lengths=None, kv_lengths=None,
              q_segment_ids=None, kv_segment_ids=None, score_mod=None, score_mod_args=(),
              d_out=None, d_lse=None) -> Reference:
    """Reference output, lse and (when `d_out` is given) gradients, all float64.

    `keep` is the dropout keep mask ``[b, h_q, s_q, s_kv]`` (bool); kept
    probabilities are scaled by ``1 / (1 - dropout)``. `d_lse` (``[b, h_q, s_q]``)
    is an optional cotangent on the log-sum-exp.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, s_q, h_q, d_qk = q.shape
    s_kv, h_kv = k.shape[1], k.shape[2]
    group = h_q // h_kv
    scale = 1.0 / np.sqrt(d_qk) if scale is None else scale
    k_h = np.repeat(k, group, axis=2)  # query head h reads kv head h // group
    v_h = np.repeat(v, group, axis=2)

    s = scale * np.einsum("bihd,bjhd->bhij", q, k_h)
    if bias is not None:
        s = s + np.asarray(bias, np.float64)
    vis, q_pos, kv_pos = visibility(b, s_q, s_kv, mask=mask, window=window, q_lengths=q_lengths,
                                    kv_lengths=kv_lengths, q_segment_ids=q_segment_ids,
                                    kv_segment_ids=kv_segment_ids)
    mod_backward = None
    if score_mod is not None:
        s, mod_backward = _apply_score_mod(score_mod, s, q_pos, kv_pos, score_mod_args)
    s = np.where(vis[:, None], s, -np.inf)

    if softmax == "vanilla":
        sink = None
    elif softmax == "off_by_one":
        sink = np.zeros((1, h_q, 1))
    else:
        sink = np.asarray(softmax_offset, np.float64).reshape(1, h_q, 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        row_max = s.max(axis=-1)
        if sink is not None:
            row_max = np.maximum(row_max, sink)
        safe_max = np.where(np.isfinite(row_max), row_max, 0.0)
        e = np.exp(s - safe_max[..., None])
        total = e.sum(axis=-1) + (np.exp(sink - safe_max) if sink is not None else 0.0)
        p = np.where(total[..., None] > 0, e / np.where(total > 0, total, 1.0)[..., None], 0.0)
        lse = np.where(total > 0, safe_max + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    drop = np.ones_like(p) if keep is None else np.asarray(keep, np.float64) / (1.0 - dropout)
    p_drop = p * drop
    out = np.einsum("bhij,bjhd->bihd", p_drop, v_h)
    if d_out is None:
        return Reference(out, lse)

    d_out = np.asarray(d_out, np.float64)
    dv_h = np.einsum("bhij,bihd->bjhd", p_drop, d_out)
    dp = np.einsum("bihd,bjhd->bhij", d_out, v_h) * drop
    row = np.sum(p * dp, axis=-1)  # d(loss)/d(normaliser) term
    if d_lse is not None:  # d lse / d s_ij = p_ij and d lse / d sink = p_sink
        row = row - np.where(np.isfinite(lse), np.asarray(d_lse, np.float64), 0.0)
    ds = p * (dp - row[..., None])
    d_offset = None
    if softmax == "learnable":
        p_sink = np.exp(sink - np.where(np.isfinite(lse), lse, np.inf))
        d_offset = -np.sum(p_sink * row, axis=(0, 2))
    d_args = ()
    if mod_backward is not None:
        ds, d_args = mod_backward(ds)
    dbias = None
    if bias is not None:
        axes = tuple(a for a in (0, 1) if np.shape(bias)[a] == 1)
        dbias = ds.sum(axis=axes, keepdims=True) if axes else ds
    dq = scale * np.einsum("bhij,bjhd->bihd", ds, k_h)
    dk_h = scale * np.einsum("bhij,bihd->bjhd", ds, q)

    def fold(x):  # sum the query heads of each kv group
        return x.reshape(x.shape[0], x.shape[1], h_kv, group, x.shape[-1]).sum(axis=3)
    return Reference(out, lse, dq, fold(dk_h), fold(dv_h), dbias, d_offset, d_args)
