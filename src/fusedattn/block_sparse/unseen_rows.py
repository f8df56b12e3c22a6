"""jax.nn's rows that see no key (`unseen_rows="mean"`): the mean of v they give and its
gradient, summed only where the map leaves a row that may see no key.

A query block with a full key block has every row seeing a key. So unless some query
block lacks one, nothing reads the mean, and `gate` says so: at trace time for a map
known there, else as a flag on the device. A `lax.cond` on that flag would send it to
the host every step (docs/decisions.md), so the sums are a Pallas Triton kernel whose
programs read the flag and return zeros without reading their tokens.
"""
from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..inputs import token_sum
from .block_map import BlockMap

Gate = Union[bool, jax.Array]


def gate(bm: BlockMap, has_score: bool) -> Gate:
    """Whether a row may see no key: True, False, or an int32[1] flag on the device.
    True with a score_mod, which may give every key of a row -inf."""
    if has_score:
        return True
    full = bm.full_kv_num_blocks
    if isinstance(full, np.ndarray):
        return bool((full == 0).any())
    return jnp.any(full == 0).astype(jnp.int32).reshape(1)


def gated_token_sum(x, flag: Gate, lse2=None, *, kernel: bool, interpret: bool = False):
    """``x [b, s, h, d]`` summed over s in f32, ``[b, h, d]``; with `lse2` ``[b, h, s]``
    only the tokens whose row's lse2 is -inf (the rows that saw no key). Zeros where
    `flag` is 0. `kernel`: the Pallas kernel (on a GPU that runs Triton, or
    `interpret`ed), else XLA, which reads x whatever the flag."""
    if lse2 is not None:
        unseen = jnp.swapaxes(lse2 == -jnp.inf, 1, 2)[..., None]      # [b, s, h, 1]
    if flag is True or not kernel or _chunk(x.shape) is None:
        total = token_sum(x if lse2 is None else jnp.where(unseen, x, 0))
        return total if flag is True else total * flag[0].astype(jnp.float32)
    return _pallas_sum(x, flag, lse2, _chunk(x.shape), interpret)


def _chunk(shape) -> Optional[int]:
    """Tokens a program sums (Triton blocks are powers of two), or None."""
    s, d = shape[1], shape[3]
    if d & (d - 1):
        return None
    return next((c for c in (256, 128) if s % c == 0), None)


def _pallas_sum(x, flag, lse2, chunk, interpret):
    b, s, h, d = x.shape

    def body(flag_ref, x_ref, *refs):
        out_ref = refs[-1]
        on = flag_ref[0] != 0

        @pl.when(on)
        def _sum():
            tokens = x_ref[...].astype(jnp.float32)                  # [chunk, d]
            if lse2 is not None:
                tokens = jnp.where((refs[0][...] == -jnp.inf)[:, None], tokens, 0.0)
            out_ref[...] = jnp.sum(tokens, axis=0)

        @pl.when(jnp.logical_not(on))
        def _zeros():
            out_ref[...] = jnp.zeros((d,), jnp.float32)

    in_specs = [pl.BlockSpec((1,), lambda i, t, j: (0,)),
                pl.BlockSpec((None, chunk, None, d), lambda i, t, j: (i, t, j, 0))]
    args = [flag, x]
    if lse2 is not None:
        in_specs.append(pl.BlockSpec((None, None, chunk), lambda i, t, j: (i, j, t)))
        args.append(lse2)
    parts = pl.pallas_call(
        body, grid=(b, s // chunk, h), in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, None, d), lambda i, t, j: (i, t, j, 0)),
        out_shape=jax.ShapeDtypeStruct((b, s // chunk, h, d), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=4),
        interpret=interpret)(*args)
    return parts.sum(1)
