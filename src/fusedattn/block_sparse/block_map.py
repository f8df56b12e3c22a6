"""`BlockMap`: which (query block, key block) tiles of attention a mask leaves
empty, partly visible or fully visible, and the lists a kernel walks.

Per ``(batch|1, head|1, query block, key block)`` the map holds `kind`
(`EMPTY`, `PARTIAL`, `FULL`). For each query block it lists the partial and the
full key blocks, each packed to the front in ascending order with a count
(torch flex_attention's ``kv_num_blocks`` / ``kv_indices`` / ``full_kv_*``); the
backward walks the key-major lists (per key block, its query blocks). The slots
past a count repeat the last listed block (0 when none), so a kernel that
prefetches one block ahead never reads out of range and refetches nothing new.

A batch or head axis of size 1 means the map does not vary along it; the axes
come first, so the map shards with the batch and head axes of q, k, v.

A block that overhangs the end of a sequence is never full (its missing
positions are masked), so kernels need no separate bounds check in full blocks.

The map is a pytree: its arrays (and the arrays of its element mask) are
leaves, the sequence lengths and block sizes static. Built on the host, its
arrays are numpy; built on the device, jax arrays.
"""
from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

from .terms import ElementMask

EMPTY, PARTIAL, FULL = 0, 1, 2
_LISTS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def pack(selected, xp=np):
    """Boolean ``[..., n]`` -> (count ``[...]``, indices ``[..., n]``): the selected
    positions first in ascending order, the rest repeating the last one (or 0)."""
    n = selected.shape[-1]
    count = selected.sum(axis=-1).astype(np.int32)
    order = xp.argsort(xp.logical_not(selected), axis=-1, stable=True).astype(np.int32)
    last = xp.take_along_axis(order, xp.maximum(count - 1, 0)[..., None], axis=-1)
    last = xp.where(count[..., None] > 0, last, 0)
    indices = xp.where(xp.arange(n, dtype=np.int32) < count[..., None], order, last)
    return count, indices.astype(np.int32)


@jax.tree_util.register_pytree_node_class
class BlockMap:
    """A mask's block map; build it with `fusedattn.block_sparse.block_map` or one of
    the other builders there, once per step, and pass it to every layer."""

    def __init__(self, kind, lists, element: ElementMask, block: Tuple[int, int]):
        self.kind = kind                      # [B|1, H|1, n_q, n_kv] int32
        for name, value in zip(_LISTS, lists):
            setattr(self, name, value)
        self.element = element
        self.block = tuple(block)

    @classmethod
    def from_kind(cls, kind, element: ElementMask, block: Tuple[int, int]) -> "BlockMap":
        """Derive the lists from the block kinds (numpy in, numpy out; numpy arrays
        are made read-only, as they are constants shared by every trace)."""
        xp = np if isinstance(kind, np.ndarray) else jnp
        kind = kind.astype(np.int32, copy=False)
        by_q = [pack(kind == PARTIAL, xp), pack(kind == FULL, xp)]
        kind_t = xp.swapaxes(kind, -1, -2)
        by_kv = [pack(kind_t == PARTIAL, xp), pack(kind_t == FULL, xp)]
        lists = [a for pair in by_q + by_kv for a in pair]
        if xp is np:
            for a in [kind, *lists]:
                a.flags.writeable = False  # shared constants of every trace
        return cls(kind, lists, element, block)

    # ---- static facts --------------------------------------------------
    @property
    def s_q(self) -> int:
        return self.element.s_q

    @property
    def s_kv(self) -> int:
        return self.element.s_kv

    @property
    def shape(self) -> Tuple[int, int, int, int]:
        """``(B|1, H|1, n_q_blocks, n_kv_blocks)``."""
        return tuple(self.kind.shape)

    @property
    def static(self) -> bool:
        """Computed on the host at trace time (nothing to run on the device)."""
        return isinstance(self.kind, np.ndarray)

    def element_mask(self, b, h, q_idx, kv_idx):
        """The exact visibility of pairs (broadcasting int32 index arrays ``[B,1,1,1]``,
        ``[1,H,1,1]``, ``[1,1,R,1]``, ``[1,1,1,C]``): what a kernel applies in a
        partial block. Pairs past either sequence length are not visible."""
        return self.element(b, h, q_idx, kv_idx)

    # ---- summaries for explain() ------------------------------------------
    def counts(self):
        """(partial, full, total) block counts over the map's axes, or None when the
        map is traced (its values are known only on the device)."""
        try:
            kind = np.asarray(self.kind)
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
            return None
        return int((kind == PARTIAL).sum()), int((kind == FULL).sum()), kind.size

    def density(self):
        """Fraction of blocks with any visible pair (None when traced)."""
        c = self.counts()
        return None if c is None else (c[0] + c[1]) / c[2]

    def describe(self) -> str:
        b, h, n_q, n_kv = self.shape
        where = "static" if self.static else "on the device"
        head = (f"block map {b}x{h}x{n_q}x{n_kv} of {self.block[0]}x{self.block[1]} blocks "
                f"({where})")
        c = self.counts()
        if c is None:
            return head + ": density known when it runs"
        partial, full, total = c
        return (f"{head}: {(partial + full) / total:.1%} of blocks visible "
                f"({partial} partial, {full} full, {total - partial - full} empty)")

    def __repr__(self) -> str:
        return f"BlockMap({self.describe()})"

    # ---- pytree ------------------------------------------------------------
    def tree_flatten(self):
        return (self.kind, tuple(getattr(self, n) for n in _LISTS), self.element), self.block

    @classmethod
    def tree_unflatten(cls, block, children):
        kind, lists, element = children
        return cls(kind, lists, element, block)
