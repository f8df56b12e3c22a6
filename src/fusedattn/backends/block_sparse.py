"""The block_sparse backend: a `mask_mod` runs only the blocks its block map lists, on our
Mosaic GPU kernels (`fusedattn.block_sparse`) on Hopper.

cuDNN's graph has no block list: a mask_mod it does not recognise runs every tile there,
or falls back to XLA. Here `supports` builds the call's static block map (a mask_mod of
positions, with the built-in causal mask and window folded in) at trace time, and
`details` gives explain() its density. The config's score_mod (if any) runs inside the
kernel. Anything the kernels do not take is a reason, and dispatch moves on.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax

from .. import block_sparse
from ..block_sparse.attention import block_sparse_attention, on_hopper
from ..block_sparse.kernel_parts import BLOCK
from ..config import AttnConfig
from ..inputs import AttnInputs
from ..score_mods import Masked

DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (64, 128)


def config_reason(config: AttnConfig) -> Optional[str]:
    """What the kernels cannot run, from the config alone (None: they can)."""
    mod = config.score_mod
    rules = (
        (not isinstance(mod, Masked), "runs a mask_mod's block map; this call has none "
                                      "(cudnn and flash skip the built-in masks' blocks)"),
        (config.is_fp8, "no FP8 kernels"),
        (config.dtype not in DTYPES, f"dtype {config.dtype}: kernels are {'/'.join(DTYPES)}"),
        (config.d_qk != config.d_v or config.d_qk not in HEAD_DIMS,
         f"head dims {config.d_qk}/{config.d_v}: kernels take d_qk == d_v in {HEAD_DIMS}"),
        (config.layout != "bshd" or config.qkv_packing != "separate",
         "takes separate q, k, v in the bshd layout"),
        (config.sequence != "dense", f"sequence {config.sequence!r}: takes dense sequences"),
        (config.has_bias or config.has_dropout or config.softmax != "vanilla",
         "takes no bias, dropout or sink softmax"),
        (bool(config.score_mod_arg_specs), "a mask_mod or score_mod reading arrays (score_mod_args) "
                                    "has no static map here"),
    )
    return next((why for broken, why in rules if broken), None)


@functools.lru_cache(maxsize=256)
def block_map(config: AttnConfig) -> block_sparse.BlockMap:
    """The config's static map (a mask_mod of positions; built once per config)."""
    mod = config.score_mod
    return block_sparse.block_map(mod.mask_mod, 1, 1, config.s_q, config.s_kv,
                                  mask=config.mask, window=config.window,
                                  block=(BLOCK, BLOCK))


class BlockSparseBackend:
    name = "block_sparse"
    platforms = ("cuda",)

    def supports(self, config: AttnConfig) -> Optional[str]:
        why = config_reason(config)
        if why is None and not on_hopper():
            why = "its Mosaic GPU kernels need a Hopper GPU (compute capability 9.0)"
        if why is None:
            try:
                bm = block_map(config)
            except Exception as e:  # a mask_mod the map cannot take: a reason, not a crash
                return f"block map: {type(e).__name__}: {e}"
            if not bm.static:
                why = "the mask_mod reads the batch or head index: its map is not static"
        return why

    def details(self, config: AttnConfig) -> str:
        return block_map(config).describe()

    def attention(self, config: AttnConfig, inputs: AttnInputs) -> jax.Array:
        why = self.supports(config)
        if why is not None:
            raise ValueError(f"block_sparse backend cannot run {config.short()}: {why}")
        # The config's own score_mod object (no score_mod_args here): a stable static
        # argument, so a re-trace reuses the compiled kernels.
        return block_sparse_attention(inputs.q, inputs.k, inputs.v, block_map(config),
                                      scale=config.scale, score_mod=config.score_mod.score_mod,
                                      implementation="mosaic")


BACKEND = BlockSparseBackend()
