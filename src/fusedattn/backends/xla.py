"""The XLA backend: every feature of `AttnConfig` in plain JAX, on any platform.

It is the ground truth for the native backends and the fallback everywhere.
Memory stays O(tile) beyond inputs and outputs (see `xla_tiles`), so long
sequences run without an s_q x s_kv score matrix; short ones run as a single
tile with no loop.

Gradients flow to q, k, v, bias (summed over its broadcast dimensions),
softmax_offset, and to floating-point score_mod arguments (summed over tiles);
integer score_mod arguments, sequence descriptors and the dropout key get none.

score_mod is called once per tile as
``score_mod(score, batch, head, q_idx, kv_idx, *score_mod_args)`` with ``score``
the fp32 ``[b, h_q, bq, bk]`` tile of scaled (and biased) logits, ``batch``
``[b, 1, 1, 1]``, ``head`` ``[1, h_q, 1, 1]``, ``q_idx`` ``[b|1, 1, bq, 1]`` and
``kv_idx`` ``[b|1, 1, 1, bk]`` int32 (positions inside the sequence/segment).
It must be elementwise in those arguments; its backward is JAX's derivative of it.
"""
from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from ..config import DTYPES, LAYOUTS, MASKS, QKV_PACKINGS, SEQUENCE_KINDS, SOFTMAX_TYPES, AttnConfig
from .base import AttnInputs, from_bshd, to_bshd, unpack_qkv
from .xla_masks import dropout_keep_mask, dropout_seed, pad_token_info, token_info
from .xla_tiles import Tiling, choose_tiling, tiled_attention

__all__ = ["BACKEND", "attention", "attention_with_lse", "dropout_keep_mask"]


def _pad_axis(x, axis: int, size: int):
    if x is None or x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def attention_with_lse(config: AttnConfig, inputs: AttnInputs, *,
                       tiling: Optional[Tiling] = None) -> Tuple[jax.Array, jax.Array]:
    """(out in the config's layout and q's dtype, fp32 lse ``[b, h_q, s_q]``).

    Both are differentiable. `tiling` overrides the automatic tile sizes
    (tests use it to exercise the multi-tile path on small shapes).
    """
    cfg = config
    q, k, v = (to_bshd(cfg, x) for x in unpack_qkv(cfg, inputs))
    b, s_q, h_q, d_qk = q.shape
    s_kv, h_kv, d_v = k.shape[1], k.shape[2], v.shape[-1]
    g = h_q // h_kv
    tiling = tiling or choose_tiling(cfg)
    # Tile layouts: q [b, h_kv, g, S_q, d], k/v [b, h_kv, S_kv, d], padded to whole tiles.
    q5 = _pad_axis(q.reshape(b, s_q, h_kv, g, d_qk).transpose(0, 2, 3, 1, 4), 3, tiling.s_q)
    k4 = _pad_axis(k.transpose(0, 2, 1, 3), 2, tiling.s_kv)
    v4 = _pad_axis(v.transpose(0, 2, 1, 3), 2, tiling.s_kv)
    bias = _pad_axis(_pad_axis(inputs.bias, 2, tiling.s_q), 3, tiling.s_kv)
    offset = inputs.softmax_offset if cfg.softmax == "learnable" else None
    info = pad_token_info(token_info(cfg, inputs.sequence), tiling.s_q, tiling.s_kv, b)
    seed = dropout_seed(inputs.rng) if cfg.has_dropout else None
    out, lse = tiled_attention(cfg, tiling, q5, k4, v4, bias, offset, info, seed,
                               tuple(inputs.score_mod_args))
    out = out[:, :, :, :s_q].transpose(0, 3, 1, 2, 4).reshape(b, s_q, h_q, d_v)
    lse = lse[..., :s_q].reshape(b, h_q, s_q)
    return from_bshd(cfg, out), lse


def attention(config: AttnConfig, inputs: AttnInputs) -> jax.Array:
    """Attention output ``[b, s_q, h_q, d_v]`` (``[s_q, b, ..]`` for sbhd) in q's dtype."""
    return attention_with_lse(config, inputs)[0]


class _XlaBackend:
    name = "xla"
    platforms = ("cpu", "cuda", "rocm")

    def supports(self, config: AttnConfig) -> Optional[str]:
        """Everything `AttnConfig` describes; a reason only for values it does not know."""
        for field, allowed in (("mask", MASKS), ("softmax", SOFTMAX_TYPES), ("layout", LAYOUTS),
                               ("qkv_packing", QKV_PACKINGS), ("sequence", SEQUENCE_KINDS),
                               ("dtype", DTYPES)):
            value = getattr(config, field)
            if value not in allowed:
                return f"{field}={value!r} is not one of {allowed}"
        if config.sequence == "ragged":
            return ("ragged (packed small-seq) keys are read by the small_seq kernels only; "
                    "fused_attn_small_seq gives other backends a padded view")
        if config.h_q % config.h_kv:
            return f"h_q={config.h_q} is not a multiple of h_kv={config.h_kv}"
        return None

    def attention(self, config: AttnConfig, inputs: AttnInputs) -> jax.Array:
        return attention(config, inputs)

    dropout_keep_mask = staticmethod(dropout_keep_mask)


BACKEND = _XlaBackend()
