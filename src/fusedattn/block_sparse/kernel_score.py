"""The score_mod in the form the kernels run, and its derivative on tiles.

A score_mod ``f(score, b, h, q_idx, kv_idx, *args)`` that reads no array runs as it
is. One that reads arrays by a position, by the batch or head index, or by a
function of them (``scale[doc[b, q]]``, ``slope[h]``, ``bias[b, kv]``) is split by
`hoisting`: the values it reads become float32 words per row ``[B|1, H|1, n, s_q]``
and per column ``[B|1, H|1, m, s_kv]`` (`Score.q_values` / `kv_values`, computed on
the device from the args, differentiable), and the tiles see the rest. The
backward kernels return the gradients of the float values (a row sum of the
score's gradient times the value's partial derivative), and JAX's own derivative
of the hoisted reads carries them to the args. Reads by ``q_idx - kv_idx`` (a T5
bucket table) become words per run of diagonals ``[B|1, H|1, n, K]``
(`Score.d_values`, `ScoreFn.runs`); the dq kernel returns their gradients.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from .dependence import mask_mod_reads, specs_of
from .diagonal import Runs
from .hoisting import SCORE, hoist
from .mosaic_ops import evaluate
from .tile_ops import stack_words

F32 = jnp.float32


class ScoreFn(NamedTuple):
    """The tile side: ``call(x, b, h, q, kv, q_tiles, kv_tiles, diags=d_tiles)`` -> the
    modified score; `q_floats` / `kv_floats` / `d_floats` say which values are
    differentiable floats."""
    call: Callable
    q_floats: Tuple[bool, ...] = ()
    kv_floats: Tuple[bool, ...] = ()
    d_floats: Tuple[bool, ...] = ()
    runs: Optional[Runs] = None   # the runs of diagonals the diagonal values are per

    @property
    def has_values(self) -> bool:
        return bool(self.q_floats or self.kv_floats or self.d_floats)


class Score(NamedTuple):
    fn: ScoreFn
    q_values: Optional[jax.Array]   # float32 words [B|1, H|1, n, s_q] or None
    kv_values: Optional[jax.Array]  # float32 words [B|1, H|1, m, s_kv] or None
    d_values: Optional[jax.Array] = None  # float32 words [B|1, H|1, l, K] or None


def kernel_score(score_mod: Optional[Callable], args: Sequence, batch: int, heads: int,
                 s_q: int, s_kv: int) -> Optional[Score]:
    """`score_mod` with `args` in the kernels' form (None without a score_mod); raises
    `hoisting.Unsupported` when its reads have no in-kernel form."""
    if score_mod is None:
        return None
    fn, split = _split(score_mod, specs_of(args), batch, heads, s_q, s_kv)
    if split is None:  # it reads no array
        return Score(fn, None, None)
    rows, cols = split.values(args)
    return Score(fn, stack_words(rows), stack_words(cols), split.diagonal(args))


@functools.lru_cache(maxsize=256)
def _split(score_mod, specs, batch, heads, s_q, s_kv):
    """(ScoreFn, the hoisting split or None); one ScoreFn per score_mod and shapes, so
    a re-trace reuses the compiled kernels."""
    if not _reads_args(score_mod, specs, batch, heads, s_q, s_kv):  # (closures count)
        def call(x, b, h, q, kv, q_tiles, kv_tiles, diags=()):
            # unread args: zeros made inside the trace (a kernel may not capture arrays)
            return score_mod(x, b, h, q, kv, *(jnp.zeros(s.shape, s.dtype) for s in specs))
        return ScoreFn(call), None
    split = hoist(score_mod, specs, batch, heads, s_q, s_kv, SCORE)
    return ScoreFn(split, *split.floats, split.d_floats, split.runs), split


def split(score_mod, specs, batch: int, heads: int, s_q: int, s_kv: int):
    """The hoisting split of a score_mod reading its args (`specs`: their
    ShapeDtypeStructs), None when it reads none; raises `hoisting.Unsupported`."""
    return None if score_mod is None else _split(score_mod, tuple(specs), batch, heads, s_q,
                                                 s_kv)[1]


def _reads_args(score_mod, specs, batch, heads, s_q, s_kv) -> bool:
    def as_mask_mod(b, h, i, j, *args):  # the score a constant: only the args' taint counts
        return score_mod(jnp.zeros((), F32), b, h, i, j, *args)
    return mask_mod_reads(as_mask_mod, specs, batch, heads, s_q, s_kv).args


def apply(fn: ScoreFn, x, b, h, q, kv, tiles, with_grad: bool, sides=("q", "kv", "d")):
    """(f(x), pullback or None): `tiles` are the (q, kv, diagonal) value tiles;
    ``pullback(g)`` is ``(g * df/dx, [g * df/dv tiles for each float q value], [the same
    for each float kv value], [... each float diagonal value])`` for the value `sides`
    asked for (the others' lists empty); a kernel sums the side it owns over the tile's
    other axis (a diagonal value's over its runs). Without float values on those sides
    it is one forward-mode derivative, with no reverse pass to hold in registers."""
    def f(x_, ts):
        return fn.call(x_, b, h, q, kv, ts[0], ts[1], diags=ts[2]).astype(F32)
    if not with_grad:
        return evaluate(f, x, tiles), None
    picked = [[i for i, yes in enumerate(floats) if yes and side in sides]
              for floats, side in zip((fn.q_floats, fn.kv_floats, fn.d_floats), ("q", "kv", "d"))]
    if not any(picked):
        y, d = evaluate(lambda x_: jax.jvp(lambda z: f(z, tiles), (x_,), (jnp.ones_like(x_),)), x)
        return y, lambda g: (g * d, [], [], [])

    def of_floats(x_, *chosen):
        ts = [list(t) for t in tiles]
        for side, idx, got in zip(ts, picked, chosen):
            for i, t in zip(idx, got):
                side[i] = t
        return f(x_, ts)
    y = evaluate(f, x, tiles)
    primals = (x, *([t[i] for i in idx] for t, idx in zip(tiles, picked)))
    return y, lambda g: evaluate(lambda *p: jax.vjp(of_floats, *p)[1](g), *primals)
