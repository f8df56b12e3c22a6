"""The score_mod in the form the kernels run, and its derivative on tiles.

A score_mod ``f(score, b, h, q_idx, kv_idx, *args)`` that reads no array runs as it
is. One that reads arrays by a position, by the batch or head index, or by a
function of them (``scale[doc[b, q]]``, ``slope[h]``, ``bias[b, kv]``) is split by
`hoisting`: the values it reads become float32 words per row ``[B|1, H|1, n, s_q]``
and per column ``[B|1, H|1, m, s_kv]`` (`Score.q_values` / `kv_values`, computed on
the device from the args, differentiable), and the tiles see the rest. The
backward kernels return the gradients of the float values (a row sum of the
score's gradient times the value's partial derivative), and JAX's own derivative
of the hoisted reads carries them to the args.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from .dependence import mask_mod_reads
from .hoisting import SCORE, hoist
from ..jaxprs import plain

F32 = jnp.float32


class ScoreFn(NamedTuple):
    """The tile side: ``call(x, b, h, q, kv, q_tiles, kv_tiles)`` -> the modified
    score; `q_floats` / `kv_floats` say which values are differentiable floats."""
    call: Callable
    q_floats: Tuple[bool, ...] = ()
    kv_floats: Tuple[bool, ...] = ()

    @property
    def has_values(self) -> bool:
        return bool(self.q_floats or self.kv_floats)


class Score(NamedTuple):
    fn: ScoreFn
    q_values: Optional[jax.Array]   # float32 words [B|1, H|1, n, s_q] or None
    kv_values: Optional[jax.Array]  # float32 words [B|1, H|1, m, s_kv] or None


def kernel_score(score_mod: Optional[Callable], args: Sequence, batch: int, heads: int,
                 s_q: int, s_kv: int) -> Optional[Score]:
    """`score_mod` with `args` in the kernels' form (None without a score_mod); raises
    `hoisting.Unsupported` when its reads have no in-kernel form."""
    if score_mod is None:
        return None
    specs = tuple(jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in args)
    fn, split = _split(score_mod, specs, batch, heads, s_q, s_kv)
    if split is None:  # it reads no array
        return Score(fn, None, None)
    rows, cols = split.values(args)
    return Score(fn, _stack(rows), _stack(cols))


@functools.lru_cache(maxsize=256)
def _split(score_mod, specs, batch, heads, s_q, s_kv):
    """(ScoreFn, the hoisting split or None); one ScoreFn per score_mod and shapes, so
    a re-trace reuses the compiled kernels."""
    if not _reads_args(score_mod, specs, batch, heads, s_q, s_kv):  # (closures count)
        def call(x, b, h, q, kv, q_tiles, kv_tiles):
            # unread args: zeros made inside the trace (a kernel may not capture arrays)
            return score_mod(x, b, h, q, kv, *(jnp.zeros(s.shape, s.dtype) for s in specs))
        return ScoreFn(call), None
    split = hoist(score_mod, specs, batch, heads, s_q, s_kv, SCORE)
    return ScoreFn(split, *split.floats), split


def split(score_mod, specs, batch: int, heads: int, s_q: int, s_kv: int):
    """The hoisting split of a score_mod reading its args (`specs`: their
    ShapeDtypeStructs), None when it reads none; raises `hoisting.Unsupported`."""
    return None if score_mod is None else _split(score_mod, tuple(specs), batch, heads, s_q,
                                                 s_kv)[1]


def _reads_args(score_mod, specs, batch, heads, s_q, s_kv) -> bool:
    def as_mask_mod(b, h, i, j, *args):  # the score a constant: only the args' taint counts
        return score_mod(jnp.zeros((), F32), b, h, i, j, *args)
    return mask_mod_reads(as_mask_mod, specs, batch, heads, s_q, s_kv).args


def _stack(values):
    """float32 [B|1, H|1, n, s] (batch and heads broadcast to the largest), or None."""
    if not values:
        return None
    lead = tuple(max(v.shape[a] for v in values) for a in (0, 1))
    return jnp.stack([jnp.broadcast_to(v, lead + v.shape[2:]) for v in values], axis=2)


def apply(fn: ScoreFn, x, b, h, q, kv, q_tiles, kv_tiles, with_grad: bool,
          sides=("q", "kv")):
    """(f(x), pullback or None): ``pullback(g)`` is ``(g * df/dx, [g * df/dv tiles for
    each float q value], [the same for each float kv value])`` for the value `sides`
    asked for (the others' lists empty); a kernel sums the side it owns over the
    tile's other axis. Without float values on those sides it is one forward-mode
    derivative, with no reverse pass to hold in registers."""
    f = lambda x_, qt, kt: fn.call(x_, b, h, q, kv, qt, kt).astype(F32)  # noqa: E731
    if not with_grad:
        return f(x, q_tiles, kv_tiles), None
    qi = [i for i, yes in enumerate(fn.q_floats) if yes and "q" in sides]
    ki = [i for i, yes in enumerate(fn.kv_floats) if yes and "kv" in sides]
    if not qi and not ki:
        y, d = plain(lambda x_: jax.jvp(lambda z: f(z, q_tiles, kv_tiles), (x_,),
                                        (jnp.ones_like(x_),)), x)
        return y, lambda g: (g * d, [], [])

    def of_floats(x_, qf, kf):
        qt, kt = list(q_tiles), list(kv_tiles)
        for i, t in zip(qi, qf):
            qt[i] = t
        for i, t in zip(ki, kf):
            kt[i] = t
        return f(x_, qt, kt)
    y = f(x, q_tiles, kv_tiles)
    primals = (x, [q_tiles[i] for i in qi], [kv_tiles[i] for i in ki])

    return y, lambda g: plain(lambda *p: jax.vjp(of_floats, *p)[1](g), *primals)
