"""A score_mod's reads along the diagonals: values of ``q_idx - kv_idx``.

A T5 bucket table ``table[h, bucket(q - kv)]`` reads by both positions, but only
through their difference, and its index is a step function of it: a few runs of
diagonals share one index. `hoisting` finds such reads, evaluates the index on the
host (it depends on positions alone) and the read values once per run on the
device. A kernel then rebuilds a tile's values from the runs its diagonals cross:
one run for tiles far from the main diagonal, a select per run crossed near it
(`kernel_diagonal.Diagonal`). The gradient of a run's value is the sum of the score's
gradient over its pairs, accumulated per query row by the dq kernel.
"""
from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

# Runs a kernel takes (times the values read): the dq kernel keeps a row of gradient
# sums per run and value in SMEM.
MAX_RUNS = 64


class Runs:
    """Runs of equal index along the ``s_q + s_kv - 1`` diagonals d = q - kv.

    `lo` int32 ``[K + 1]``: run k holds ``lo[k] <= d < lo[k + 1]`` (``lo[K] = s_q``);
    `run_of` int32 ``[s_q + s_kv - 1]``: the run of diagonal ``d`` at ``d + offset``;
    `starts`: each run's first diagonal as that index (where its value is read)."""

    def __init__(self, starts: np.ndarray, s_q: int, s_kv: int):
        self.offset = s_kv - 1
        self.count = len(starts)
        n = s_q + s_kv - 1
        self.starts = np.asarray(starts, np.int32)
        self.lo = np.append(self.starts - self.offset, s_q).astype(np.int32)
        first = np.zeros(n, np.int32)
        first[self.starts[1:]] = 1
        self.run_of = np.cumsum(first).astype(np.int32)

    @classmethod
    def of(cls, index_values: Sequence[np.ndarray], s_q: int, s_kv: int) -> "Runs":
        """The runs where none of `index_values` (each ``[n, ...]`` along the n
        diagonals, lowest d first) changes."""
        n = s_q + s_kv - 1
        change = np.zeros(n, bool)
        change[0] = True
        for x in index_values:
            x = np.asarray(x).reshape(n, -1)
            change[1:] |= np.any(x[1:] != x[:-1], axis=1)
        return cls(np.flatnonzero(change), s_q, s_kv)

    def run(self, d):
        """The run of each diagonal in `d` (any int array; clipped to the sequences)."""
        return jnp.asarray(self.run_of)[jnp.clip(d + self.offset, 0, len(self.run_of) - 1)]

    def tile(self, words, d):
        """The values (``words`` ``[..., K]`` of one (b, h)) at diagonals `d` (any int
        array), by a gather: the form of the jnp reference."""
        return jnp.take(words, self.run(d), axis=-1)

    def sums(self, grad, d):
        """``[K]``: `grad` (a tile) summed over the pairs of each run (reference form)."""
        at = jnp.broadcast_to(self.run(d), grad.shape)
        return jnp.zeros((self.count,), grad.dtype).at[at.reshape(-1)].add(grad.reshape(-1))
