"""Flax integration (``pip install fusedattn[flax]``): an `attention_fn` for Flax's
attention layers and `DotProductAttention` modules for linen and nnx.

* `attention_fn`: the signature of `flax.linen.dot_product_attention` /
  `flax.nnx.dot_product_attention`, so
  ``nn.MultiHeadDotProductAttention(..., attention_fn=fusedattn.flax.attention_fn)``
  and ``nnx.MultiHeadAttention(..., attention_fn=fusedattn.flax.attention_fn)`` run
  fusedattn's plan. Boolean masks become masking (as in
  `fusedattn.dot_product_attention`), dropout is fusedattn's per-element dropout.
* `DotProductAttention` (linen) and `NnxDotProductAttention` (nnx): the attention
  core with fusedattn's options as module attributes, in the spirit of
  TransformerEngine's Flax module: masks, windows, padding / packing descriptors,
  dropout from the module's rng stream, sinks (``softmax="learnable"`` owns its
  per-head ``softmax_offset`` parameter) and context parallelism.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Tuple

import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from .api import fused_attn
from .context_parallel import ContextParallel
from .jax_nn import bias_with_mask
from .sequence import SequenceDescriptor

__all__ = ["attention_fn", "DotProductAttention", "NnxDotProductAttention"]


def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                 dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
                 dtype=None, precision=None, module=None, is_causal: bool = False,
                 backend: str = "auto", **unused):
    """`flax.linen.dot_product_attention`'s signature on fusedattn.

    query ``[batch..., q_len, heads, depth]``, key / value ``[batch..., kv_len,
    kv_heads, depth]``; bias / mask broadcastable to ``[batch..., heads, q_len, kv_len]``.
    Dropout is drawn per element: with ``broadcast_dropout=True`` (one mask shared
    over batch and heads) and a non-zero rate this raises rather than drawing a
    different mask. ``precision`` must be None: the kernels accumulate in fp32.
    ``module`` (Flax's hook to sow attention weights) is not supported: fused
    kernels never form the weights.
    """
    if module is not None:
        raise ValueError("attention_fn: fused attention never forms the attention weights, so "
                         "sow_weights / module is not supported")
    if precision is not None:
        raise ValueError(f"attention_fn: precision must be None (fused kernels multiply in the "
                         f"input dtype and accumulate in fp32), got {precision!r}")
    dropping = dropout_rate > 0.0 and not deterministic
    if dropping and broadcast_dropout:
        raise ValueError("attention_fn: fusedattn draws dropout per element; pass "
                         "broadcast_dropout=False to the attention layer")
    if dropping and dropout_rng is None:
        raise ValueError("attention_fn: dropout_rate > 0 needs dropout_rng")
    if dtype is not None:
        query, key, value = (x.astype(dtype) for x in (query, key, value))
    lead = query.shape[:-3]
    flat = lambda x: x.reshape((math.prod(lead),) + x.shape[len(lead):])  # noqa: E731
    q, k, v = flat(query), flat(key), flat(value)
    b, t, n, _ = q.shape
    # Flax's masks are often float (make_attention_mask's default): non-zero = attend.
    flat_mask = None if mask is None else _flat_lead(jnp.asarray(mask).astype(bool), lead)
    flat_bias = None if bias is None else _flat_lead(bias, lead)
    out = fused_attn(q, k, v, bias=bias_with_mask(flat_bias, flat_mask, q.dtype, b, n, t,
                                                   k.shape[1]),
                     mask="causal" if is_causal else "none",
                     dropout=dropout_rate if dropping else 0.0,
                     rng=dropout_rng if dropping else None, backend=backend)
    return out.reshape(lead + out.shape[1:])


def _flat_lead(x, lead):
    """Broadcastable to [batch..., heads, T, S] -> [prod(batch), ...] (as it is for one
    batch dimension)."""
    x = jnp.asarray(x)
    if len(lead) == 1:
        return x
    x = x.reshape((1,) * max(0, len(lead) + 3 - x.ndim) + x.shape)
    x = jnp.broadcast_to(x, lead + x.shape[len(lead):])
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
