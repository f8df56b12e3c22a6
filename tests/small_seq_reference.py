"""Float64 NumPy reference for small-seq attention (forward and gradients).

Independent of JAX: written from the formulas, so it checks every backend.
Keys are padded ``[n, s, h_kv, d]`` with per-sequence lengths; packed inputs are
converted with `pack` / `unpack_grads`.
"""
from __future__ import annotations

import numpy as np


def attention(q, k, v, lengths, scale, d_o=None):
    """q [n, 1, h_q, d], k/v [n, s, h_kv, d], lengths [n] -> out (and dq, dk, dv if d_o)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    n, _, h_q, d = q.shape
    s, h_kv = k.shape[1], k.shape[2]
    g = h_q // h_kv
    kh = np.repeat(k, g, axis=2)  # [n, s, h_q, d]
    vh = np.repeat(v, g, axis=2)
    logits = scale * np.einsum("nhd,nshd->nhs", q[:, 0], kh)
    valid = np.arange(s)[None, None, :] < np.asarray(lengths)[:, None, None]
    logits = np.where(valid, logits, -np.inf)
    m = np.max(logits, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.where(valid, np.exp(logits - m), 0.0)
    total = p.sum(-1, keepdims=True)
    p = np.where(total > 0, p / np.where(total > 0, total, 1.0), 0.0)  # no keys -> 0
    out = np.einsum("nhs,nshd->nhd", p, vh)[:, None]
    if d_o is None:
        return out
    do = np.asarray(d_o, np.float64)[:, 0]  # [n, h_q, d]
    dv_h = np.einsum("nhs,nhd->nshd", p, do)
    dp = np.einsum("nhd,nshd->nhs", do, vh)
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
    dq = scale * np.einsum("nhs,nshd->nhd", ds, kh)[:, None]
    dk_h = scale * np.einsum("nhs,nhd->nshd", ds, q[:, 0])
    fold = lambda x: x.reshape(n, s, h_kv, g, d).sum(axis=3)  # sum over each group
    return out, dq, fold(dk_h), fold(dv_h)


def pack(k_padded, lengths):
    """Padded [n, s, h, d] + lengths -> packed [sum(lengths), h, d] and offsets [n + 1]."""
    lengths = np.asarray(lengths)
    rows = [np.asarray(k_padded)[b, :lengths[b]] for b in range(len(lengths))]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return np.concatenate(rows, axis=0), offsets


def unpack_grads(dk_padded, lengths):
    """Padded gradients [n, s, h, d] -> packed [sum(lengths), h, d] (drops padding)."""
    return pack(dk_padded, lengths)[0]


def rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


TOLERANCE = {"bfloat16": 4e-2, "float16": 1e-2, "float32": 1e-5}
