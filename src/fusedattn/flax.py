"""Flax integration (``pip install fusedattn[flax]``): an `attention_fn` for Flax's
attention layers and `DotProductAttention` modules for linen and nnx.

* `attention_fn`: the signature of `flax.linen.dot_product_attention` and
  `flax.nnx.dot_product_attention` together, so
  ``nn.MultiHeadDotProductAttention(..., attention_fn=fusedattn.flax.attention_fn)``
  and ``nnx.MultiHeadAttention(..., attention_fn=fusedattn.flax.attention_fn)`` run
  fusedattn's plan. It never refuses what Flax accepts: calls no fused kernel
  serves run Flax's own function (see `fallback_reason`). A mask runs as a block map
  where a backend takes one (block_sparse, on Hopper), else as an additive bias
  (`explain` says which, and why).
* `DotProductAttention` (linen) and `NnxDotProductAttention` (nnx): the attention
  core with fusedattn's options as module attributes, in the spirit of
  TransformerEngine's Flax module: masks, windows, padding / packing descriptors,
  dropout from the module's rng stream, sinks (``softmax="learnable"`` owns its
  per-head ``softmax_offset`` parameter) and context parallelism.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx
from flax.linen import attention as linen_attention
from flax.nnx.nn import attention as nnx_attention
from flax.nnx.nn import dtypes as nnx_dtypes

from . import dispatch
from .api import fused_attn
from .config import DTYPES
from .context_parallel import ContextParallel
from .jax_nn import log_fallback, masked_attention, masked_plan, traced_plan
from .sequence import SequenceDescriptor

__all__ = ["attention_fn", "explain", "fallback_reason", "DotProductAttention",
           "NnxDotProductAttention"]

# Flax's own functions as they were at import, the fallbacks: a test or a user may
# replace the names in flax with `attention_fn`, which must not then call itself.
_LINEN_ATTENTION = linen_attention.dot_product_attention
_NNX_ATTENTION = nnx_attention.dot_product_attention
_DEFAULT_PRECISIONS = (None, "default", "DEFAULT", "fastest", jax.lax.Precision.DEFAULT)


def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                 dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
                 dtype=None, precision=None, module=None, is_causal: bool = False,
                 force_fp32_for_softmax: bool = False, einsum_dot_general=None,
                 qk_attn_weights_einsum=None, attn_weights_value_einsum=None,
                 promote_dtype=nnx_dtypes.promote_dtype, backend: str = "auto"):
    """`flax.linen.dot_product_attention` / `flax.nnx.dot_product_attention` on fusedattn.

    query ``[batch..., q_len, heads, depth]``, key / value ``[batch..., kv_len,
    kv_heads, depth]``; bias / mask broadcastable to ``[batch..., heads, q_len,
    kv_len]`` (a non-zero mask entry attends). With ``is_causal`` the mask is also
    causal; a row that sees no key averages all values, as in Flax. Per-element
    dropout (``broadcast_dropout=False``) is fusedattn's, drawn from ``dropout_rng``.

    Flax's own function runs (logged once; `fallback_reason` says why) for what no
    fused kernel computes: attention weights (``module``, to sow them), a
    ``precision`` other than the default, ``broadcast_dropout`` with dropout (one
    mask shared over batch and heads), the einsum overrides, ``force_fp32_for_softmax``
    below float32, and dtypes fusedattn does not compute in (float64, complex).
    """
    _check_shapes(query, key, value)
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    reason = _fallback(query, key, value, locals())
    if reason is not None:
        log_fallback("fusedattn.flax.attention_fn", reason)
        if isinstance(module, nnx.Module):
            return _NNX_ATTENTION(query, key, value, bias, mask, broadcast_dropout, dropout_rng,
                                  dropout_rate, deterministic, dtype, precision, module,
                                  is_causal=is_causal)
        return _linen(query, key, value, bias, mask, is_causal, broadcast_dropout=broadcast_dropout,
                      dropout_rng=dropout_rng, dropout_rate=dropout_rate,
                      deterministic=deterministic, dtype=dtype, precision=precision,
                      module=module, force_fp32_for_softmax=force_fp32_for_softmax,
                      einsum_dot_general=einsum_dot_general,
                      qk_attn_weights_einsum=qk_attn_weights_einsum,
                      attn_weights_value_einsum=attn_weights_value_einsum)
    dropping = dropout_rate > 0.0 and not deterministic
    if dropping and dropout_rng is None:
        raise ValueError("attention_fn: dropout_rate > 0 needs dropout_rng")
    out_shape = query.shape[:-1] + value.shape[-1:]
    if math.prod(out_shape) == 0 or key.shape[-3] == 0:
        return jnp.zeros(out_shape, query.dtype)
    q, k, v, options = _arguments(query, key, value, bias, mask, is_causal,
                                  dropout_rate if dropping else 0.0,
                                  dropout_rng if dropping else None, backend)
    return masked_attention(q, k, v, **options).reshape(out_shape)


def explain(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
            dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
            dtype=None, precision=None, module=None, is_causal: bool = False,
            force_fp32_for_softmax: bool = False, einsum_dot_general=None,
            qk_attn_weights_einsum=None, attn_weights_value_einsum=None,
            promote_dtype=nnx_dtypes.promote_dtype,
            backend: str = "auto") -> Union[dispatch.Plan, str]:
    """What `attention_fn` with these arguments runs, without running it: the `Plan`
    (``print`` it: every backend and its reason, and whether ``mask`` runs as a block
    map or as a bias, and why), or a line saying why Flax's own function runs. Arrays
    may be `jax.ShapeDtypeStruct`s."""
    _check_shapes(query, key, value)
    reason = _fallback(query, key, value, locals())
    if reason is not None:
        return f"attention_fn runs Flax's own function: {reason}"
    if 0 in query.shape[:-1] or key.shape[-3] == 0:
        return "attention_fn of an empty batch or sequence: zeros, no kernel runs"
    dropping = dropout_rate > 0.0 and not deterministic

    def plan(query, key, value, bias, mask, rng):
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
        q, k, v, options = _arguments(query, key, value, bias, mask, is_causal,
                                      dropout_rate if dropping else 0.0, rng, backend)
        return masked_plan(q, k, v, **options)
    return traced_plan(plan, query, key, value, bias, mask,
                       dropout_rng if dropping else None)


_FALLBACK_OPTIONS = ("broadcast_dropout", "dropout_rate", "deterministic", "dtype", "precision",
                     "module", "force_fp32_for_softmax", "einsum_dot_general",
                     "qk_attn_weights_einsum", "attn_weights_value_einsum")


def _fallback(query, key, value, arguments: dict):
    """`fallback_reason` of an `attention_fn` / `explain` call, from its arguments."""
    return fallback_reason(query, key, value, **{n: arguments[n] for n in _FALLBACK_OPTIONS})


def _arguments(query, key, value, bias, mask, is_causal, dropout_rate, dropout_rng, backend):
    """Flax's arrays [batch..., length, heads, depth] -> (q, k, v with one batch axis,
    `masked_attention`'s options)."""
    lead = query.shape[:-3]
    flat = lambda x: x.reshape((math.prod(lead),) + x.shape[len(lead):])  # noqa: E731
    # Flax's masks are often float (make_attention_mask's default): non-zero = attend.
    # (a NumPy mask stays NumPy, so that a known one is recognised as in explain())
    flat_mask = None if mask is None else _flat_lead(
        (np.asarray if isinstance(mask, np.ndarray) else jnp.asarray)(mask).astype(bool), lead)
    flat_bias = None if bias is None else _flat_lead(bias, lead)
    return flat(query), flat(key), flat(value), dict(
        bias=flat_bias, mask=flat_mask, is_causal=is_causal, dropout=dropout_rate,
        rng=dropout_rng, backend=backend)


def fallback_reason(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                    dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
                    dtype=None, precision=None, module=None, is_causal: bool = False,
                    force_fp32_for_softmax: bool = False, einsum_dot_general=None,
                    qk_attn_weights_einsum=None, attn_weights_value_einsum=None,
                    **_) -> Optional[str]:
    """Why `attention_fn` with these arguments runs Flax's own function, or None when
    fusedattn's plan runs it (arguments as `attention_fn` takes them)."""
    if module is not None:
        return "module= asks for the attention weights, which fused kernels never form"
    linen_only = _linen_only(force_fp32_for_softmax, einsum_dot_general,
                             qk_attn_weights_einsum, attn_weights_value_einsum)
    names = {jnp.dtype(dtype or jnp.result_type(query, key, value)).name}
    if linen_only:
        # force_fp32_for_softmax is what fused kernels do anyway; in float32 it changes nothing.
        if linen_only == "force_fp32_for_softmax":
            if names != {"float32"}:
                return ("force_fp32_for_softmax below float32: Flax keeps float32 weights "
                        "and output")
        else:
            return f"{linen_only}: a custom product inside Flax's function, no fused kernel's"
    if not _default_precision(precision):
        return f"precision={precision!r}: fused kernels multiply at the default precision"
    if dropout_rate > 0.0 and not deterministic and broadcast_dropout:
        return ("broadcast_dropout=True: one dropout mask shared over batch and heads, which "
                "no fused kernel draws")
    if not names <= set(DTYPES):
        return f"dtype {', '.join(sorted(names))}: fusedattn computes in {DTYPES}"
    return None


def _linen_only(force_fp32_for_softmax, einsum_dot_general, qk_einsum, value_einsum) -> str:
    """The name of the first linen-only argument in use, or ''."""
    for name, used in (("qk_attn_weights_einsum", qk_einsum is not None),
                       ("attn_weights_value_einsum", value_einsum is not None),
                       ("einsum_dot_general", einsum_dot_general is not None),
                       ("force_fp32_for_softmax", bool(force_fp32_for_softmax))):
        if used:
            return name
    return ""


def _default_precision(precision) -> bool:
    if isinstance(precision, (tuple, list)):
        return all(_default_precision(p) for p in precision)
    try:
        return precision in _DEFAULT_PRECISIONS
    except Exception:  # an object without equality to these (a DotAlgorithm)
        return False


def _check_shapes(query, key, value) -> None:
    """Flax's (nnx's) shape rules and messages, before anything runs."""
    arrays = [jnp.asarray(x) if not hasattr(x, "shape") else x for x in (query, key, value)]
    if len({a.ndim for a in arrays}) != 1:
        raise ValueError(f"q, k, v must have same rank, but got "
                         f"{', '.join(str(a.ndim) for a in arrays)}.")
    if arrays[0].ndim < 3:
        raise ValueError(f"q, k, v must be [batch..., length, heads, depth] (rank >= 3), got "
                         f"rank {arrays[0].ndim}")
    if len({a.shape[:-3] for a in arrays}) != 1:
        raise ValueError(f"q, k, v batch dims must match, but got shapes "
                         f"{', '.join(str(a.shape) for a in arrays)}.")
    q, k, v = arrays
    if k.shape[-3] != v.shape[-3]:
        raise ValueError(f"k, v lengths must match, but got {k.shape[-3]} and {v.shape[-3]}.")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q, k depths must match, but got {q.shape[-1]} and {k.shape[-1]}.")
    if k.shape[-2] != v.shape[-2] or k.shape[-2] == 0 or q.shape[-2] % k.shape[-2]:
        raise ValueError(f"The number of query heads must be a multiple of key/value heads "
                         f"(and k, v heads equal), but got {q.shape[-2]} vs {k.shape[-2]}, "
                         f"{v.shape[-2]}")


def _linen(query, key, value, bias, mask, is_causal, **kwargs):
    """Flax linen's function, which has neither is_causal nor GQA: the causal mask joins
    the mask (as nnx combines them) and k / v heads repeat."""
    if is_causal:
        t, s = query.shape[-3], key.shape[-3]
        causal = jnp.tril(jnp.ones((t, s), jnp.bool_))
        mask = causal if mask is None else jnp.logical_and(jnp.asarray(mask).astype(bool), causal)
    groups = query.shape[-2] // key.shape[-2]
    if groups > 1:
        key, value = (jnp.repeat(x, groups, axis=-2) for x in (key, value))
    return _LINEN_ATTENTION(query, key, value, bias, mask, **kwargs)


def _flat_lead(x, lead):
    """Broadcastable to [batch..., heads, T, S] -> [prod(batch), ...] (as it is for one
    batch dimension)."""
    xp = np if isinstance(x, np.ndarray) else jnp
    x = xp.asarray(x)
    if len(lead) == 1:
        return x
    x = x.reshape((1,) * max(0, len(lead) + 3 - x.ndim) + x.shape)
    x = xp.broadcast_to(x, lead + x.shape[len(lead):])
    return x.reshape((-1,) + x.shape[len(lead):])


@dataclasses.dataclass(frozen=True)
class _Options:
    """What both modules pass to `fused_attn` (their attributes)."""
    mask: str = "none"
    window: Optional[Tuple[int, int]] = None
    scale: Optional[float] = None
    softmax: str = "vanilla"
    dropout: float = 0.0
    layout: str = "bshd"
    context_parallel: Optional[ContextParallel] = None
    backend: str = "auto"

    def __call__(self, q, k, v, bias, sequence, offset, rng):
        return fused_attn(q, k, v, bias=bias, sequence=sequence, mask=self.mask, window=self.window,
                          scale=self.scale, softmax=self.softmax, softmax_offset=offset,
                          dropout=self.dropout if rng is not None else 0.0, rng=rng,
                          layout=self.layout, context_parallel=self.context_parallel,
                          backend=self.backend)


class DotProductAttention(nn.Module):
    """The attention core as a linen module (no projections: q, k, v come in).

    Attributes are `fused_attn`'s options. Dropout draws from the
    ``dropout_rng_name`` stream unless ``deterministic``. With
    ``softmax="learnable"`` the module owns ``softmax_offset`` ``[h_q]`` (zeros).
    """
    mask: str = "none"
    window: Optional[Tuple[int, int]] = None
    scale: Optional[float] = None
    softmax: str = "vanilla"
    dropout: float = 0.0
    dropout_rng_name: str = "dropout"
    layout: str = "bshd"
    context_parallel: Optional[ContextParallel] = None
    backend: str = "auto"

    @nn.compact
    def __call__(self, query, key, value, *, bias=None,
                 sequence: Optional[SequenceDescriptor] = None, deterministic: bool = False):
        offset = None
        if self.softmax == "learnable":
            offset = self.param("softmax_offset", nn.initializers.zeros, (query.shape[-2],),
                                jnp.float32)
        rng = None
        if self.dropout > 0.0 and not deterministic:
            rng = self.make_rng(self.dropout_rng_name)
        options = _Options(self.mask, self.window, self.scale, self.softmax, self.dropout,
                           self.layout, self.context_parallel, self.backend)
        return options(query, key, value, bias, sequence, offset, rng)


class NnxDotProductAttention(nnx.Module):
    """The attention core as an nnx module; the same options as `DotProductAttention`.

    ``num_heads`` is needed only with ``softmax="learnable"`` (the size of its
    ``softmax_offset`` parameter); ``rngs`` only with dropout.
    """

    def __init__(self, *, num_heads: Optional[int] = None, mask: str = "none",
                 window: Optional[Tuple[int, int]] = None, scale: Optional[float] = None,
                 softmax: str = "vanilla", dropout: float = 0.0, layout: str = "bshd",
                 context_parallel: Optional[ContextParallel] = None, backend: str = "auto",
                 rngs: Optional[nnx.Rngs] = None):
        self.options = _Options(mask, window, scale, softmax, dropout, layout, context_parallel,
                                backend)
        if softmax == "learnable" and num_heads is None:
            raise ValueError("NnxDotProductAttention: softmax='learnable' needs num_heads")
        self.softmax_offset: Any = (nnx.Param(jnp.zeros((num_heads,), jnp.float32))
                                    if softmax == "learnable" else None)
        if dropout > 0.0 and rngs is None:
            raise ValueError("NnxDotProductAttention: dropout > 0 needs rngs")
        self.rngs = rngs

    def __call__(self, query, key, value, *, bias=None,
                 sequence: Optional[SequenceDescriptor] = None, deterministic: bool = False):
        offset = None if self.softmax_offset is None else self.softmax_offset[...]
        rng = None
        if self.options.dropout > 0.0 and not deterministic:
            rng = self.rngs.dropout()
        return self.options(query, key, value, bias, sequence, offset, rng)
