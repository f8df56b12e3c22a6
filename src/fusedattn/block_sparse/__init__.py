"""Block-sparse attention: masks as block maps (see `block_map.BlockMap`).

    bm = fusedattn.block_sparse.block_map(lambda b, h, i, j: (j <= i) & (i - j < 512),
                                          s_q=4096, s_kv=4096)
    bm.kv_num_blocks, bm.kv_indices      # what a forward kernel walks
    print(bm.describe())
"""
from .attention import block_sparse_attention, block_sparse_attention_with_lse
from .block_map import EMPTY, FULL, PARTIAL, BlockMap
from .builders import (DEFAULT_BLOCK, block_map, from_builtin, from_dense_mask,
                       from_element, from_segment_ids, intersect)
from .terms import Dense, ElementMask, Intervals, MaskMod, Segments

__all__ = ["BlockMap", "DEFAULT_BLOCK", "Dense", "EMPTY", "ElementMask", "FULL", "Intervals",
           "MaskMod", "PARTIAL", "Segments", "block_map", "block_sparse_attention",
           "block_sparse_attention_with_lse", "from_builtin", "from_dense_mask",
           "from_element", "from_segment_ids", "intersect"]
