"""`fusedattn.dot_product_attention`: `jax.nn.dot_product_attention`'s signature and
semantics, dispatched through fusedattn's plan.

Switching a model over is changing one import. The arguments map onto
`fused_attn` as follows:

* ``bias`` (broadcastable to ``[B, N, T, S]``) is broadcast over T and S
  (fusedattn's bias broadcasts over batch and heads only); its gradient flows.
* ``mask`` (bool, True = attend) becomes an additive term of
  ``-0.7 * finfo(q.dtype).max`` where False, added to the bias.
* ``is_causal`` is the top-left causal mask; ``local_window_size`` an int
  (symmetric) or ``(left, right)`` window around the diagonal (right is 0 under
  a causal mask, where it has no effect).
* ``query_seq_lengths`` / ``key_value_seq_lengths`` are padding lengths; padded
  query rows give 0, as in jax.nn.
* ``implementation``: None picks the best backend (jax.nn's None means XLA);
  ``"xla"`` / ``"cudnn"`` or any fusedattn backend name forces one.

A query row that sees no key at all (its mask, causal / window / key padding
combined hide every key) averages all values, as jax.nn does, in every dtype.
Inputs of rank below 4 get leading axes (jax.nn's rule); an empty batch gives an
empty result. Dtypes no fusedattn backend computes in (float64) run jax.nn's own
XLA path (captured when fusedattn is imported, so a monkeypatched jax.nn does not
recurse into this function), unless a fusedattn backend is named;
`fallback_reason` says whether a call falls back and why, and each reason is
logged once on the ``fusedattn`` logger.
"""
from __future__ import annotations

import logging
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from . import dispatch
from .config import DTYPES
from .sequence import SequenceDescriptor
from .validation import build_call

logger = logging.getLogger("fusedattn")
# jax.nn's function as it was at import: tests and users monkeypatch the name to this
# module's drop-in, and the fallback must not then call itself.
_JAX_NN_ATTENTION = jax.nn.dot_product_attention
_LOGGED = set()


def log_fallback(api: str, reason: str) -> None:
    """Log, once per (api, reason), that a drop-in ran the original's code instead."""
    if (api, reason) not in _LOGGED:
        _LOGGED.add((api, reason))
        logger.warning("%s: no fused kernel serves this call (%s); running the original's "
                       "own implementation", api, reason)


def fallback_reason(query, key, value, bias=None, mask=None, *,
                    implementation: Optional[str] = None, **_) -> Optional[str]:
    """Why `dot_product_attention` with these arguments runs jax.nn's own XLA path,
    or None when fusedattn's plan runs it."""
    dtypes = {jnp.result_type(x) for x in (query, key, value)}
    if implementation in (None, "xla") and any(jnp.dtype(d).name not in DTYPES for d in dtypes):
        return (f"dtype {', '.join(sorted(jnp.dtype(d).name for d in dtypes))}: fusedattn "
                f"computes in {DTYPES}")
    return None


def dot_product_attention(query, key, value, bias=None, mask=None, *,
                          scale: Optional[float] = None,
                          is_causal: bool = False,
                          query_seq_lengths=None,
                          key_value_seq_lengths=None,
                          local_window_size: Union[int, Tuple[int, int], None] = None,
                          implementation: Optional[str] = None,
                          return_residual: bool = False):
    """Scaled dot-product attention with `jax.nn.dot_product_attention`'s signature.

    query ``[B, T, N, H]`` (or ``[T, N, H]``), key / value ``[B, S, K, H]``
    (``N % K == 0``). Returns the output shaped like query, and with
    ``return_residual=True`` also the log-sum-exp ``[B, T, N]`` (no gradient).
    """
    reason = fallback_reason(query, key, value, implementation=implementation)
    if reason is not None:
        log_fallback("dot_product_attention", reason)
        return _JAX_NN_ATTENTION(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size, implementation="xla",
            return_residual=return_residual)
    out_shape = np.shape(query)
    q, k, v = (_as_4d(x, name, "[B, T|S, N|K, H]") for x, name in
               ((query, "query"), (key, "key"), (value, "value")))
    if v.shape != k.shape:
        raise ValueError(f"value shape {v.shape} must equal key shape {k.shape}")
    if q.dtype != k.dtype or v.dtype != k.dtype:
        raise ValueError(f"query, key and value must share a dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    backend = _backend(implementation)
    b, t, n, _ = q.shape
    s = k.shape[1]
    q_len = kv_len = None
    if query_seq_lengths is not None or key_value_seq_lengths is not None:
        q_len = _lengths(query_seq_lengths, "query_seq_lengths", b, t)
        kv_len = _lengths(key_value_seq_lengths, "key_value_seq_lengths", b, s)
    window = _window(local_window_size, is_causal)
    if q.size == 0 or k.size == 0:
        # jax.nn's answer for an empty batch (or sequence): an empty (or zero) result.
        out = jnp.zeros(out_shape, q.dtype)
        return (out, jnp.zeros(out_shape[:-1], q.dtype)) if return_residual else out
    out = masked_attention(q, k, v, bias=bias, mask=mask, is_causal=is_causal, window=window,
                           q_lengths=q_len, kv_lengths=kv_len,
                           scale=None if scale is None else float(scale), backend=backend,
                           need_lse=return_residual)
    if not return_residual:
        return out.reshape(out_shape)
    out, lse = out
    return out.reshape(out_shape), lse.reshape(out_shape[:-1])


def masked_attention(q, k, v, *, bias=None, mask=None, is_causal=False, window=None,
                     q_lengths=None, kv_lengths=None, scale=None, dropout=0.0, rng=None,
                     backend="auto", need_lse=False):
    """The core both drop-ins share: q ``[B, T, N, H]``, k / v ``[B, S, K, H]`` in a
    fusedattn dtype, bias and a boolean mask broadcastable to ``[B, N, T, S]``, with
    jax.nn's semantics (rows that see no key average all values)."""
    b, t, n, _ = q.shape
    s = k.shape[1]
    mask4 = None if mask is None else _as_4d(mask, "mask")
    if mask4 is not None and mask4.dtype != jnp.bool_:
        raise TypeError(f"mask must be a boolean array (True = attend), got {mask4.dtype}; an "
                        f"additive mask goes in bias")
    sequence = None if q_lengths is None else SequenceDescriptor.from_lengths(q_lengths,
                                                                             kv_lengths)
    config, inputs = build_call(q, k, v, bias=bias_with_mask(bias, mask4, q.dtype, b, n, t, s),
                                sequence=sequence, mask="causal" if is_causal else "none",
                                window=window, scale=scale, dropout=dropout, rng=rng)
    plan = dispatch.plan(config, backend)
    if not need_lse:
        out = plan.run(inputs)
    else:
        out, lse = plan.run_with_lse(inputs)
        lse = jax.lax.stop_gradient(jnp.swapaxes(lse, 1, 2).astype(k.dtype))  # [B, T, N]
    empty = _rows_seeing_nothing(mask4, is_causal, window, q_lengths, kv_lengths, b, t, s)
    if empty is not None:
        # Kernels shift such a row by the mask's constant (a no-op for softmax) or give 0
        # when no key is in range; jax.nn gives every key the same weight.
        mean = jnp.repeat(v.astype(jnp.float32).mean(axis=1), n // k.shape[2], axis=1)
        out = jnp.where(jnp.swapaxes(empty, 1, 2)[..., None], mean[:, None].astype(out.dtype),
                        out)
    return (out, lse) if need_lse else out


def _rows_seeing_nothing(mask4, is_causal, window, q_lengths, kv_lengths, b, t, s):
    """[B|1, N|1, T]: True where a (real) query row sees no key, or None if none can."""
    if mask4 is None and kv_lengths is None and (window is None or t <= s):
        return None  # every row sees at least its diagonal (or, causal, key 0)
    i = jnp.arange(t)[None, :]
    lo = jnp.zeros((1, t), jnp.int32) if window is None else i - window[0]
    hi = jnp.full((1, t), s - 1)
    if is_causal:
        hi = jnp.minimum(hi, i)
    if window is not None:
        hi = jnp.minimum(hi, i + window[1])
    if kv_lengths is not None:
        hi = jnp.minimum(hi, kv_lengths[:, None] - 1)
    lo, hi = lo[:, None], hi[:, None]  # [B|1, 1, T]
    if mask4 is None:
        empty = jnp.maximum(lo, 0) > hi
    else:
        j = jnp.arange(s)
        seen = mask4 & (j >= lo[..., None]) & (j <= hi[..., None])
        empty = ~jnp.any(seen, axis=-1)
    if q_lengths is not None:
        empty = empty & (i < q_lengths[:, None])[:, None]
    return empty


def _backend(implementation: Optional[str]) -> str:
    if implementation is None:
        return "auto"
    if implementation in dispatch.ALL_BACKENDS:
        return implementation
    raise ValueError(f"implementation must be None or one of {dispatch.ALL_BACKENDS}, got "
                     f"{implementation!r}")


def _as_4d(x, name: str, what: str = "broadcastable to [B, N, T, S]"):
    """jax.nn's rule: fewer than 4 dimensions get leading axes of size 1."""
    x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
    if x.ndim > 4:
        raise ValueError(f"{name} must have at most 4 dimensions ({what}), got shape {x.shape}")
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def bias_with_mask(bias, mask, dtype, b, n, t, s):
    """The additive term fusedattn takes: [1|B, 1|N, T, S]."""
    terms = []
    if bias is not None:
        terms.append(_as_4d(bias, "bias"))
    if mask is not None:
        m = _as_4d(mask, "mask")
        large_negative = -0.7 * float(jnp.finfo(dtype).max)
        terms.append(jnp.where(m, jnp.zeros((), dtype), jnp.asarray(large_negative, dtype)))
    if not terms:
        return None
    full = (b, n, t, s)
    shape = tuple(1 if all(x.shape[i] == 1 for x in terms) and i < 2 else full[i]
                  for i in range(4))
    for x in terms:
        try:
            np.broadcast_shapes(x.shape, full)
        except ValueError:
            raise ValueError(f"bias / mask of shape {x.shape} does not broadcast to "
                             f"[B, N, T, S] = {full}") from None
    total = terms[0] if len(terms) == 1 else terms[0] + terms[1].astype(terms[0].dtype)
    return jnp.broadcast_to(total, shape)


def _lengths(x, name: str, b: int, full: int):
    if x is None:
        return jnp.full((b,), full, jnp.int32)
    x = jnp.asarray(x)
    if x.shape != (b,) or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be an int32 array of shape ({b},), got {x.dtype} {x.shape}")
    return x.astype(jnp.int32)


def _window(size, is_causal: bool):
    if size is None:
        return None
    left, right = (size, size) if isinstance(size, int) else tuple(size)
    if left < 0 or right < 0:
        raise ValueError(f"local_window_size must be non-negative, got {size!r}")
    return (left, 0) if is_causal else (left, right)
