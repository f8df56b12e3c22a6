"""Small-seq views of the float64 oracle (tests/oracle.py): padded keys
``[n, s, h_kv, d]`` with per-sequence kv lengths; packed inputs are converted
with `pack` / `unpack_grads`."""
from __future__ import annotations

import numpy as np

from . import oracle
from .attn_cases import TOLERANCE, rel_error as rel_err  # noqa: F401 - re-exported for the tests


def attention(q, k, v, lengths, scale, d_o=None):
    """q [n, 1, h_q, d], k/v [n, s, h_kv, d], kv lengths [n] -> out (and dq, dk, dv if d_o),
    from the project's float64 oracle."""
    r = oracle.attention(np.asarray(q, np.float64), np.asarray(k, np.float64),
                         np.asarray(v, np.float64), scale=scale,
                         kv_lengths=np.asarray(lengths), d_out=None if d_o is None
                         else np.asarray(d_o, np.float64))
    return r.out if d_o is None else (r.out, r.dq, r.dk, r.dv)


def lse(q, k, lengths, scale):
    """Float64 log-sum-exp [n, h_q] (-inf for no keys)."""
    return oracle.attention(np.asarray(q, np.float64), np.asarray(k, np.float64),
                            np.asarray(k, np.float64), scale=scale,
                            kv_lengths=np.asarray(lengths)).lse[..., 0]


def pack(k_padded, lengths):
    """Padded [n, s, h, d] + lengths -> packed [sum(lengths), h, d] and offsets [n + 1]."""
    lengths = np.asarray(lengths)
    rows = [np.asarray(k_padded)[b, :lengths[b]] for b in range(len(lengths))]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return np.concatenate(rows, axis=0), offsets


def unpack_grads(dk_padded, lengths):
    """Padded gradients [n, s, h, d] -> packed [sum(lengths), h, d] (drops padding)."""
    return pack(dk_padded, lengths)[0]


