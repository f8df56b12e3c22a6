"""`fusedattn.dot_product_attention`: `jax.nn.dot_product_attention`'s signature and
semantics, dispatched through fusedattn's plan.

Switching a model over is changing one import. The arguments map onto
`fused_attn` as follows:

* ``bias`` (4-d, broadcastable to ``[B, N, T, S]``) is broadcast over T and S
  (fusedattn's bias broadcasts over batch and heads only); its gradient flows.
* ``mask`` (bool, True = attend) becomes an additive term of
  ``-0.7 * finfo(q.dtype).max`` where False, added to the bias, as jax.nn does,
  so a row with no visible key averages all values exactly like jax.nn (the
  bias gradient is untouched by it).
* ``is_causal`` is the top-left causal mask; ``local_window_size`` an int
  (symmetric) or ``(left, right)`` window around the diagonal (right is 0 under
  a causal mask, where it has no effect).
* ``query_seq_lengths`` / ``key_value_seq_lengths`` are padding lengths; padded
  query rows give 0, as in jax.nn.
* ``implementation``: None picks the best backend (jax.nn's None means XLA);
  ``"xla"`` / ``"cudnn"`` or any fusedattn backend name forces one.

One difference: a key/value sequence of length 0 gives 0 here (fusedattn's rule
for rows with no visible key), where jax.nn averages the padded values. Dtypes no
fusedattn backend computes in (float64) run jax.nn's own XLA path, unless a
fusedattn backend is named.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from . import dispatch
from .config import DTYPES
from .sequence import SequenceDescriptor
from .validation import build_call


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
    q, k, v = (jnp.asarray(x) if not isinstance(x, jax.Array) else x for x in (query, key, value))
    unbatched = q.ndim == 3
    if unbatched:
        if k.ndim != 3 or v.ndim != 3:
            raise ValueError(f"query is [T, N, H], so key and value must be [S, K, H]; got "
                             f"{k.shape} and {v.shape}")
        q, k, v = q[None], k[None], v[None]
    if v.shape != k.shape:
        raise ValueError(f"value shape {v.shape} must equal key shape {k.shape}")
    if q.dtype != k.dtype or v.dtype != k.dtype:
        raise ValueError(f"query, key and value must share a dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if jnp.dtype(q.dtype).name not in DTYPES and implementation in (None, "xla"):
        # No fusedattn backend computes in this dtype (float64): jax.nn's own XLA path
        # does, so the drop-in keeps its promise instead of narrowing the precision.
        return jax.nn.dot_product_attention(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size, implementation="xla",
            return_residual=return_residual)
    b, t, n, _ = q.shape
    s = k.shape[1]
    bias = bias_with_mask(bias, mask, q.dtype, b, n, t, s)
    sequence = None
    if query_seq_lengths is not None or key_value_seq_lengths is not None:
        q_len = _lengths(query_seq_lengths, "query_seq_lengths", b, t)
        kv_len = _lengths(key_value_seq_lengths, "key_value_seq_lengths", b, s)
        sequence = SequenceDescriptor.from_lengths(q_len, kv_len)
    window = _window(local_window_size, is_causal)
    config, inputs = build_call(q, k, v, bias=bias, sequence=sequence,
                                mask="causal" if is_causal else "none", window=window,
                                scale=None if scale is None else float(scale))
    plan = dispatch.plan(config, _backend(implementation))
    if not return_residual:
        out = plan.run(inputs)
        return out[0] if unbatched else out
    out, lse = plan.run_with_lse(inputs)
    lse = jax.lax.stop_gradient(jnp.swapaxes(lse, 1, 2).astype(k.dtype))  # [B, T, N]
    return (out[0], lse[0]) if unbatched else (out, lse)


def _backend(implementation: Optional[str]) -> str:
    if implementation is None:
        return "auto"
    if implementation in dispatch.ALL_BACKENDS:
        return implementation
    raise ValueError(f"implementation must be None or one of {dispatch.ALL_BACKENDS}, got "
                     f"{implementation!r}")


def _as_4d(x, name: str):
    x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
    if x.ndim > 4:
        raise ValueError(f"{name} must have at most 4 dimensions (broadcastable to [B, N, T, S]), "
                         f"got shape {x.shape}")
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def bias_with_mask(bias, mask, dtype, b, n, t, s):
    """The additive term fusedattn takes: [1|B, 1|N, T, S]."""
    terms = []
    if bias is not None:
        terms.append(_as_4d(bias, "bias"))
    if mask is not None:
        m = _as_4d(mask, "mask")
        if m.dtype != jnp.bool_:
            raise TypeError(f"mask must be a boolean array (True = attend), got {m.dtype}; an "
                            f"additive mask goes in bias")
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
