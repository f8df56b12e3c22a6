"""The XLA backend's attention: forward and backward in plain JAX over tiles (`tiles`),
masks from `masks`; what it computes and promises is in the package docstring."""
from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from ... import partitioning
from ...config import AttnConfig
from ...inputs import AttnInputs, from_bshd, pack_like_inputs, to_bshd, unpack_qkv
from .masks import dropout_keep_mask, dropout_seed, pad_token_info, token_info
from .tiles import Tiling, choose_tiling, tiled_attention
from .tiles import backward as backward_tiles

__all__ = ["BACKEND", "attention", "attention_with_lse", "dropout_keep_mask"]


def _pad_axis(x, axis: int, size: int):
    if x is None or x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _tile_operands(config: AttnConfig, inputs: AttnInputs, tiling: Tiling):
    """The tiled kernels' operands: q [b, h_kv, g, S_q, d], k/v [b, h_kv, S_kv, d] padded
    to whole tiles, bias, sink offset, token info, dropout seed, score_mod args."""
    cfg = config
    q, k, v = (to_bshd(cfg, x) for x in unpack_qkv(cfg, inputs))
    b = q.shape[0]
    q5 = _query_tiles(q, k.shape[2], tiling)
    k4 = _pad_axis(k.transpose(0, 2, 1, 3), 2, tiling.s_kv)
    v4 = _pad_axis(v.transpose(0, 2, 1, 3), 2, tiling.s_kv)
    bias = _pad_axis(_pad_axis(inputs.bias, 2, tiling.s_q), 3, tiling.s_kv)
    offset = inputs.softmax_offset if cfg.softmax == "learnable" else None
    info = pad_token_info(token_info(cfg, inputs.sequence), tiling.s_q, tiling.s_kv, b)
    seed = _seed(inputs.rng) if cfg.has_dropout else None
    return q5, k4, v4, bias, offset, info, seed, tuple(inputs.score_mod_args)


def _seed(rng) -> jax.Array:
    """The hash's two seed words: from a PRNG key, or the first two of raw uint32 bits
    (the form native calls take, see native_op.rng_bits)."""
    if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.dtype == jnp.uint32 \
            and rng.shape != (2,):
        return rng[:2]
    return dropout_seed(rng)


def _out_from_tiles(config: AttnConfig, out5, s_q: int):
    b, h_kv, g = out5.shape[:3]
    out = out5[:, :, :, :s_q].transpose(0, 3, 1, 2, 4).reshape(b, s_q, h_kv * g, -1)
    return from_bshd(config, out)


def _query_tiles(x, h_kv: int, tiling: Tiling):
    """A bshd per-query-head tensor (q, out, d_out) -> [b, h_kv, g, S_q, d], padded."""
    b, s_q, h_q, d = x.shape
    return _pad_axis(x.reshape(b, s_q, h_kv, h_q // h_kv, d).transpose(0, 2, 3, 1, 4),
                     3, tiling.s_q)


def attention_with_lse(config: AttnConfig, inputs: AttnInputs, *,
                       tiling: Optional[Tiling] = None) -> Tuple[jax.Array, jax.Array]:
    """(out in the config's layout and q's dtype, fp32 lse ``[b, h_q, s_q]``).

    Both are differentiable. `tiling` overrides the automatic tile sizes
    (tests use it to exercise the multi-tile path on small shapes).
    """
    tiling = tiling or choose_tiling(config)

    def run(inputs):
        operands = _tile_operands(config, inputs, tiling)
        out, lse = tiled_attention(config, tiling, *operands)
        lse = lse[..., :config.s_q].reshape(config.batch, config.h_q, config.s_q)
        return _out_from_tiles(config, out, config.s_q), lse
    # Under Explicit mesh axes the tiles' reshapes run with the axes Auto (partitioning).
    specs = lambda: partitioning.typed_specs(  # noqa: E731
        config, inputs.q, (partitioning.output_dims(config), partitioning.LSE_DIMS))
    return partitioning.in_auto_axes(run, inputs.q, specs, inputs)


# ---- the per-device kernel interface of native backends (used by context parallelism,
# and by tests of the partitioning rule on CPU) -------------------------------------------
def forward(config: AttnConfig, inputs: AttnInputs, training: bool = True):
    """(out, fp32 lse [b, h_q, s_q]); not differentiable (see `backward`)."""
    out, lse = attention_with_lse(config, inputs)
    return out, (lse if training else None)


def backward(config: AttnConfig, inputs: AttnInputs, out, lse, d_out) -> AttnInputs:
    """Gradients given the forward's (out, lse): with another call's statistics (a
    context-parallel ring's merged ones) it gives that call's share of the gradient."""
    tiling = choose_tiling(config)
    operands = _tile_operands(config, inputs, tiling)
    h_kv = operands[1].shape[1]
    lse5 = _pad_axis(lse.reshape(config.batch, h_kv, -1, config.s_q), 3, tiling.s_q)
    residuals = operands + (_query_tiles(to_bshd(config, out), h_kv, tiling), lse5)
    d_out5 = _query_tiles(to_bshd(config, d_out.astype(out.dtype)), h_kv, tiling)
    dq, dk, dv, dbias, d_offset, _ = backward_tiles(config, tiling, residuals, d_out5, None)
    s_q, s_kv = config.s_q, config.s_kv
    dq = _out_from_tiles(config, dq, s_q)
    dk, dv = (from_bshd(config, x[:, :, :s_kv].transpose(0, 2, 1, 3)) for x in (dk, dv))
    if dbias is not None:
        dbias = dbias[:, :, :s_q, :s_kv]
    dq, dk, dv = pack_like_inputs(config, dq, dk, dv)
    return AttnInputs(q=dq, k=dk, v=dv, bias=dbias,
                      softmax_offset=d_offset if config.softmax == "learnable" else None,
                      sequence=None, rng=None, score_mod_args=())


def attention(config: AttnConfig, inputs: AttnInputs) -> jax.Array:
    """Attention output ``[b, s_q, h_q, d_v]`` (``[s_q, b, ..]`` for sbhd) in q's dtype."""
    return attention_with_lse(config, inputs)[0]
