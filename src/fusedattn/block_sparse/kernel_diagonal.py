"""A score_mod's values read by q_idx - kv_idx inside the Mosaic GPU kernels.

`hoisting` gives them one word per run of diagonals sharing an index
(`diagonal.Runs`); `diagonal_words` packs those words and the runs' first diagonals
for one SMEM copy per warpgroup, `Diagonal` rebuilds a tile's values from the runs it
crosses and, in the dq kernel, sums the score's gradient per run.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .kernel_parts import F32, NWG, bh_index, broadcast_along, row_vector, row_zeros


def diagonal_words(score, words):
    """A score's values by q_idx - kv_idx as one int32 array ``[B|1, H|1, l + 1, P]``:
    rows ``0..l-1`` the value words of each run (`diagonal.Runs`; float32 bits), row l
    the runs' first diagonals ``lo``. P pads ``K + 1`` to 32 words, so each
    warpgroup's SMEM copy starts 128-byte aligned (TMA). A kernel copies one (b, h)'s
    rows into SMEM (`Diagonal`)."""
    runs = score.runs
    width = -(-(runs.count + 1) // 32) * 32
    bits = jax.lax.bitcast_convert_type(words, jnp.int32)
    bits = jnp.pad(bits, ((0, 0), (0, 0), (0, 0), (0, width - runs.count)))
    lo = np.full(width, runs.lo[-1], np.int32)
    lo[:runs.count + 1] = runs.lo
    lo = jnp.broadcast_to(jnp.asarray(lo), bits.shape[:2] + (1, width))
    return jnp.concatenate([bits, lo], axis=2)


def diagonal_scratch(words):
    """SMEM for each warpgroup's copy of one (b, h)'s `diagonal_words` (None: no such
    values), and its barriers: the last of a kernel's scratch."""
    if words is None:
        return []
    return [plgpu.SMEM((NWG,) + words.shape[2:], jnp.int32), plgpu.Barrier(num_barriers=NWG)]


class Span(NamedTuple):
    """One tile's place among the runs (`Diagonal.span`)."""
    q0: jax.Array        # the tile's first query position
    k0: jax.Array        # its first key position
    shape: tuple         # its shape, queries along `q_axis`
    q_axis: int          # 0: queries along the rows (forward, dq); 1: along the columns (dk/dv)
    first: jax.Array     # the first run its diagonals cross (that of its lowest diagonal)
    last: jax.Array      # the last (its highest's); == first: the tile lies in one run


class Diagonal:
    """A score's values by q_idx - kv_idx inside a kernel, from one (b, h)'s rows of
    `diagonal_words` in SMEM (`smem` ``[l + 1, P]``) and the runs' first diagonals
    known when tracing (`lo`). A tile far from the main diagonal lies in one run: its
    values are that run's words, one SMEM read each. A tile nearer crosses runs: its
    values start as the first run's and take each later one's past its first
    diagonal (a branch of its own, so the far tiles hold no extra tiles in registers)."""

    def __init__(self, smem, lo: np.ndarray, interpret):
        self.smem, self.lo, self.interpret = smem, lo, interpret
        self.count = smem.shape[0] - 1

    @classmethod
    def load(cls, words_ref, smem, ready, b, h, wg, runs, interpret) -> "Diagonal":
        """Warpgroup `wg`'s: its (b, h)'s rows of `diagonal_words` copied to its SMEM
        (`diagonal_scratch`)."""
        plgpu.copy_gmem_to_smem(words_ref.at[bh_index(words_ref, b, h)], smem.at[wg],
                                ready.at[wg])
        plgpu.barrier_wait(ready.at[wg])
        return cls(smem.at[wg], runs.lo, interpret)

    def span(self, q0, k0, shape, q_axis) -> Span:
        """A tile's `Span`: where it lies and the first and last runs it crosses."""
        d_min = q0 - k0 - (shape[1 - q_axis] - 1)
        d_max = q0 - k0 + shape[q_axis] - 1

        def run(x):   # the run of diagonal x: how many later runs start at or before it
            n = jnp.int32(0)
            for lo in self.lo[1:-1]:
                n = n + (x >= int(lo)).astype(jnp.int32)
            return n
        return Span(q0, k0, shape, q_axis, run(d_min), run(d_max))

    def _lo(self, k):
        return self.smem[self.count, k]

    def _tile(self, x):
        """`x` in the wgmma tile layout (both branches of a cond must give the same)."""
        return x if self.interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA)

    def _past(self, span: Span):
        """``past(lo)``: the tile's pairs with ``q - kv >= lo``, compared from a row
        and a column vector of positions (no tile of diagonals held in registers)."""
        q0, k0, shape, q_axis = span.q0, span.k0, span.shape, span.q_axis

        def positions(axis, start):
            x = start + lax.broadcasted_iota(jnp.int32, (shape[axis],), 0)
            return x if self.interpret else plgpu.layout_cast(
                x, plgpu.Layout.WGMMA.reduce(1 - axis))
        q, kv = positions(q_axis, q0), positions(1 - q_axis, k0)
        kv = broadcast_along(kv, 1 - q_axis, shape)
        return lambda lo: broadcast_along(q - lo, q_axis, shape) >= kv

    def tiles(self, span: Span):
        """Each value's tile of float32 words."""
        shape, first, last = span.shape, span.first, span.last

        def far():
            return [self._tile(jnp.full(shape, self.smem[i, first], jnp.int32))
                    for i in range(self.count)]

        def near():
            past = self._past(span)

            def one(i):
                def cross(k, x):
                    return jnp.where(past(self._lo(k)), self.smem[i, k], x)
                start = jnp.full(shape, self.smem[i, first], jnp.int32)
                return self._tile(lax.fori_loop(first + 1, last + 1, cross, start))
            return [one(i) for i in range(self.count)]
        return [lax.bitcast_convert_type(x, F32) for x in lax.cond(first == last, far, near)]

    def add_row_sums(self, acc, span: Span, grads, floats):
        """Add each float value's gradient tile, summed along the rows over each run's
        pairs, to its rows of `acc` (SMEM ``[l, K, rows]``). Near the diagonal: sums
        from each crossed run's first diagonal on, differenced (one masked sum per
        run boundary crossed)."""
        first, last = span.first, span.last
        grads = iter(grads)
        for i, yes in enumerate(floats):
            if not yes:
                continue
            g = next(grads)
            total = g.sum(axis=1)

            def add(ref, x):
                ref[...] = row_vector(ref, self.interpret) + x
            pl.when(first == last)(lambda i=i, total=total: add(acc.at[i, first], total))

            @pl.when(first != last)
            def _near(i=i, g=g, total=total):
                past = self._past(span)

                def later(n, after):   # runs last, last - 1, ..., first + 1
                    k = last - n
                    since = jnp.where(past(self._lo(k)), g, 0.0).sum(axis=1)
                    add(acc.at[i, k], since - after)
                    return since
                after = lax.fori_loop(0, last - first, later, jnp.zeros_like(total))
                add(acc.at[i, first], total - after)

    def clear(self, acc):
        """Zero `acc` (SMEM ``[l, K, rows]``) in the rows' own layout (`row_zeros`): each
        thread then reads back what it wrote, with no barrier."""
        zero = row_zeros(self.interpret, acc.shape[2])

        def one(k, _):
            for i in range(acc.shape[0]):
                acc.at[i, k][...] = zero
        lax.fori_loop(0, acc.shape[1], one, None)
