"""The block_sparse_xla backend: the block-sparse list walks in plain JAX
(`block_sparse.reference`) for masks that neither the Mosaic GPU kernels nor a vendor
kernel can run: a head dim or dtype the kernels lack, or a GPU that is not a Hopper,
with a mask_mod that reads arrays (documents from ids) or the batch / head number, or a
score_mod that reads arrays by position; and a built-in window where cuDNN and FA3
cannot run it (float32) and XLA would tile the scores.

The alternative there is the XLA backend, which evaluates a mask_mod on every pair (tile
by tile when the scores are large). The walks follow the same block map as the kernels:
empty blocks are never touched, full blocks skip the mask, and nothing larger than a
tile per (batch, head, query block) is formed. They come after cudnn and flash in the
preference order: a mask those run (a built-in one, a lowered mask_mod of positions, a
dense mask as a bias) runs there every tile, faster than the walks (docs/decisions.md).
CUDA only: the walks against XLA are measured there; ROCm has no GPU of ours to measure
them on.
"""
from __future__ import annotations

from typing import Optional

from ..config import AttnConfig
from . import native_op
from .block_sparse import BlockSparseBackend, config_reason


class BlockSparseXlaBackend(BlockSparseBackend):
    """block_sparse's map, dispatch and partitioning, its lists walked by XLA."""
    name = "block_sparse_xla"
    platforms = ("cuda",)

    def implementation(self) -> str:
        return "reference"

    def config_reason(self, config: AttnConfig) -> Optional[str]:
        return config_reason(config, kernels=False)

    def defers_to(self, config: AttnConfig) -> Optional[str]:
        return None   # (it follows the vendors' kernels already: nothing to defer)


BACKEND = BlockSparseXlaBackend()
native_op.register(BACKEND.name, native_op.Kernels(BACKEND.forward, BACKEND.backward,
                                                    arg_grads=True))
