"""Hoisted equations on tiles: how each of `hoisting`'s in-kernel equations evaluates on
a kernel's tiles, and the 32-bit words a score_mod's hoisted values travel in.

Tiles hold 8-bit integers as int32 (the kernels do no 8-bit arithmetic), each result
wrapped back into range; a mask_mod's values are int32 tiles, a score_mod's float32
words with integers bit-cast, so ids past 2^24 stay exact.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..jaxprs import SHAPE_ONLY, Eqn

_SAME_SHAPES = frozenset({"select_n", "clamp"})  # (lax broadcasts only scalars here)


def is_float(dtype) -> bool:
    """Whether `dtype` is a float (bfloat16 too, unlike NumPy's test)."""
    return jnp.issubdtype(dtype, jnp.floating)


def _narrow(dtype) -> bool:
    """8-bit integers: the kernels do no arithmetic on them, so tiles hold them as int32
    (sign- or zero-extended) and each result is wrapped back into range."""
    return np.dtype(dtype).itemsize == 1 and np.issubdtype(dtype, np.integer)


def widened(x):
    """An 8-bit integer value as the int32 a tile holds; others as they are."""
    return x.astype(np.int32) if _narrow(x.dtype) else x


def _wrap(x, dtype):
    """An int32 result of 8-bit arithmetic, reduced to the 8-bit value (extended again)."""
    if np.issubdtype(dtype, np.signedinteger):
        return jax.lax.shift_right_arithmetic(jax.lax.shift_left(x, np.int32(24)), np.int32(24))
    return x & np.int32(255)


def _aligned(name, xs):
    """Operands broadcast where the primitive needs it (lax takes scalars mixed in)."""
    shapes = [jnp.shape(x) for x in xs]
    if len(set(shapes)) <= 1:
        return xs
    target = jnp.broadcast_shapes(*shapes)
    return [x if jnp.shape(x) == target or (not jnp.shape(x) and name not in _SAME_SHAPES)
            else jnp.broadcast_to(x, target) for x in xs]


def on_tiles(e: Eqn, ins):
    """One equation on tiles (8-bit integers held as int32: see `_narrow`)."""
    name, dt, params = e.prim.name, e.outs[0].aval.dtype, e.params
    if name in SHAPE_ONLY:
        return ins[0]
    if name == "convert_element_type" and _narrow(dt):
        params = dict(params, new_dtype=np.dtype(np.int32))
        if is_float(e.ins[0].aval.dtype):  # XLA saturates a float -> int cast
            info = np.iinfo(dt)
            ins = [jnp.clip(ins[0], float(info.min), float(info.max))]
    if name in ("shift_right_logical", "population_count"):  # of the 8-bit pattern
        ins = [x & 255 if _narrow(v.aval.dtype) else x for x, v in zip(ins, e.ins)]
    x = e.prim.bind(*_aligned(name, ins), **params)
    return _wrap(x, dt) if _narrow(dt) else x


def flat_values(x, n, axis):
    """A frontier value ``[B|1, H|1, n|1, 1]`` (axis 2) or ``[B|1, H|1, 1, n|1]`` (or a
    scalar) as ``[B|1, H|1, n]`` in its own dtype."""
    x = jnp.reshape(x, (1, 1, 1, 1)) if jnp.ndim(x) == 0 else x
    shape = x.shape[:2] + ((n, 1) if axis == 2 else (1, n))
    return jnp.broadcast_to(x, shape).reshape(x.shape[:2] + (n,))


def word(x):
    """A score_mod value as a float32 word: floats converted, integers bit-cast."""
    if is_float(x.dtype):
        return x.astype(jnp.float32)
    return jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.float32)


def stack_words(values):
    """A score_mod's value words, each ``[B|1, H|1, n]``, as float32 ``[B|1, H|1, count,
    n]`` (batch and heads broadcast to the largest), or None without values."""
    if not values:
        return None
    lead = tuple(max(v.shape[a] for v in values) for a in (0, 1))
    return jnp.stack([jnp.broadcast_to(v, lead + v.shape[2:]) for v in values], axis=2)


def from_tile(x, dtype, words: bool):
    """A value's tile as the function sees it: from an int32 tile (a mask_mod's) or a
    float32 word tile (a score_mod's); 8-bit integers stay int32 (see `_narrow`)."""
    if words and not is_float(dtype):
        x = jax.lax.bitcast_convert_type(x, jnp.int32)
    if dtype == np.bool_:
        return x != 0
    return x if x.dtype == dtype or _narrow(dtype) else x.astype(dtype)
