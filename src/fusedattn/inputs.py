"""The arrays one call carries (`AttnInputs`) and the layout helpers every backend uses.
Backends read only the `AttnConfig` and these arrays, never user arguments."""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

from .config import AttnConfig
from .sequence import SequenceDescriptor


class AttnInputs(NamedTuple):
    """Arrays of one call, as the user laid them out (layout / packing in the config).

    With ``qkv_packing == "qkv"``, ``q`` is the packed ``[.., 3, h, d]`` tensor and
    ``k``/``v`` are None; with ``"kv"``, ``k`` is the packed ``[.., 2, h, d]`` tensor
    and ``v`` is None. `unpack_qkv` gives separate tensors.
    """
    q: jax.Array
    k: Optional[jax.Array]
    v: Optional[jax.Array]
    bias: Optional[jax.Array] = None
    softmax_offset: Optional[jax.Array] = None  # [h_q] float32
    sequence: Optional[SequenceDescriptor] = None
    rng: Optional[jax.Array] = None  # a JAX PRNG key, when dropout > 0
    score_mod_args: Tuple[jax.Array, ...] = ()
    dense_mask: Optional[jax.Array] = None  # bool [1|b, 1|h_q, s_q, s_kv], True: visible


def mask_as_bias(config: AttnConfig, inputs: AttnInputs) -> AttnInputs:
    """The dense mask folded into the bias, for backends that take no dense mask (with
    `config.mask_as_bias()`): ``-0.7 * finfo(dtype).max`` where the mask is False (the
    constant jax.nn adds), plus the bias if any, broadcast to the folded bias shape."""
    if inputs.dense_mask is None:
        return inputs
    large_negative = -0.7 * float(jnp.finfo(config.dtype).max)
    term = jnp.where(inputs.dense_mask, jnp.zeros((), config.dtype),
                     jnp.asarray(large_negative, config.dtype))
    bias = term if inputs.bias is None else inputs.bias + term.astype(inputs.bias.dtype)
    return inputs._replace(bias=jnp.broadcast_to(bias, config.mask_as_bias().bias_shape),
                           dense_mask=None)


def unpack_qkv(config: AttnConfig, inputs: AttnInputs):
    """Separate (q, k, v) in the config's layout, slicing packed inputs."""
    q, k, v = inputs.q, inputs.k, inputs.v
    if config.qkv_packing == "qkv":
        q, k, v = (jnp.take(inputs.q, i, axis=-3) for i in range(3))
    elif config.qkv_packing == "kv":
        k, v = (jnp.take(inputs.k, i, axis=-3) for i in range(2))
    return q, k, v


def pack_like_inputs(config: AttnConfig, dq, dk, dv):
    """Gradients of separate q, k, v -> the packing the inputs came in (dq, dk, dv with
    None where a packed tensor holds them)."""
    if config.qkv_packing == "qkv":
        return jnp.stack([dq, dk, dv], axis=-3), None, None
    if config.qkv_packing == "kv":
        return dq, jnp.stack([dk, dv], axis=-3), None
    return dq, dk, dv


def to_bshd(config: AttnConfig, x: jax.Array) -> jax.Array:
    """A [.., h, d] tensor in the config's layout -> bshd."""
    return jnp.swapaxes(x, 0, 1) if config.layout == "sbhd" else x


def from_bshd(config: AttnConfig, x: jax.Array) -> jax.Array:
    """A bshd tensor -> the config's layout."""
    return jnp.swapaxes(x, 0, 1) if config.layout == "sbhd" else x


# Token chunks of a two-stage sum over the sequence: XLA's one reduction of [b, s, h, d]
# over s ran well under the memory bandwidth; partial sums over 16 chunks of tokens
# first (16x the outputs to spread) measured faster (docs/decisions.md).
_TOKEN_CHUNKS = 16


def token_sum(x: jax.Array) -> jax.Array:
    """``x [b, s, ...]`` summed over s in fp32."""
    x = x.astype(jnp.float32)
    s = x.shape[1]
    if s % _TOKEN_CHUNKS or s == _TOKEN_CHUNKS:
        return x.sum(1)
    parts = x.reshape(x.shape[0], _TOKEN_CHUNKS, s // _TOKEN_CHUNKS, *x.shape[2:]).sum(2)
    # Kept apart: XLA would merge the two sums back into one reduction.
    return jax.lax.optimization_barrier(parts).sum(1)


def value_mean(v: jax.Array, h_q: int, sum_tokens=token_sum) -> jax.Array:
    """The mean of v ``[b, s, h_kv, d]`` over its tokens per query head, ``[b, h_q, d]``
    fp32: what jax.nn gives a row that sees no key. `sum_tokens` sums ``[b, s, ...]``
    over s in fp32 (the block-sparse path's sums skip their work where no row is unseen)."""
    return jnp.repeat(sum_tokens(v) / v.shape[1], h_q // v.shape[2], axis=1)
