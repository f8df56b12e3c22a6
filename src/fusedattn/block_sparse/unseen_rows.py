"""jax.nn's rows that see no key (`unseen_rows="mean"`): the mean of v they give and its
gradient, summed only where the map leaves a row that may see no key.

A query block with a full key block has every row seeing a key. So unless some query
block lacks one, nothing reads the mean, and `gate` says so: at trace time for a map
known there, else as a flag on the device. A `lax.cond` on that flag would send it to
the host every step (docs/decisions.md), so the sums are a Mosaic GPU kernel whose
CTAs read the flag and, where it is 0, return without reading their tokens.
"""
from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..inputs import token_sum
from .block_map import BlockMap
from .terms import is_host
from .kernel_parts import F32, ROWS, col_vector, cols_of, matmul_acc, smem_tiled

Gate = Union[bool, jax.Array]
CHUNK = 256   # tokens a CTA sums


def gate(bm: BlockMap, has_score: bool) -> Gate:
    """Whether a row may see no key: True, False, or an int32[1] flag on the device.
    True with a score_mod, which may give every key of a row -inf."""
    if has_score:
        return True
    full = bm.full_kv_num_blocks
    if is_host(full):
        return bool((np.asarray(full) == 0).any())
    return jnp.any(full == 0).astype(jnp.int32).reshape(1)


def gated_token_sum(x, flag: Optional[jax.Array], lse2=None, *, kernel: bool):
    """``x [b, s, h, d]`` summed over s in f32, ``[b, h, d]``; with `lse2` ``[b, h, s]``
    only the tokens whose row's lse2 is -inf (the rows that saw no key). `flag`: the
    device flag of `gate`, or None (always sum). `kernel`: the Mosaic GPU kernel (a
    Hopper GPU; a constant to autodiff), zeros without reading x where `flag` is 0;
    else XLA's sum whatever the flag (where it is 0 no row is unseen: nothing reads the
    mean, and the unseen rows' sum is 0), differentiable as the backward's own
    derivative needs."""
    if flag is None or not kernel or x.shape[1] % CHUNK or x.shape[3] % 64:
        if lse2 is not None:
            x = jnp.where(jnp.swapaxes(lse2 == -jnp.inf, 1, 2)[..., None], x, 0)
        return token_sum(x)
    total = _kernel_sum(lax.stop_gradient(x), flag, lse2)[:, :, :, 0].sum(1)
    # A select, not a product: where the flag is 0 the kernel left its output unwritten.
    return jnp.where(flag[0] != 0, total, 0.0)


def _kernel_sum(x, flag, lse2):
    """Per CTA, a chunk of tokens of one (batch, head), summed by one wgmma: a tile of
    ones (or of the unseen rows' indicator) times the tokens, whose rows are all the
    sum; [b, s / CHUNK, h, 8, d] (TMA stores the first 8 rows, a whole tile)."""
    b, s, h, d = x.shape
    shape = (ROWS, CHUNK)

    def body(flag_ref, x_ref, *refs):
        if lse2 is not None:
            lse_ref, out_ref, x_smem, lse_smem, acc_smem, ready = refs
        else:
            (out_ref, x_smem, acc_smem, ready), lse_ref = refs, None
        i, t, j = (lax.axis_index(a) for a in ("b", "t", "h"))
        tokens = pl.ds(t * CHUNK, CHUNK)

        @pl.when(flag_ref[0] != 0)
        def _sum():
            plgpu.copy_gmem_to_smem(x_ref.at[i, tokens, j], x_smem, ready.at[0])
            if lse_ref is not None:
                plgpu.copy_gmem_to_smem(lse_ref.at[i, j, tokens], lse_smem, ready.at[1])
                plgpu.barrier_wait(ready.at[1])
                unseen = cols_of(col_vector(lse_smem, False), shape) == -jnp.inf
                weights = jnp.where(unseen, 1.0, 0.0).astype(x.dtype)
            else:
                weights = plgpu.layout_cast(jnp.ones(shape, x.dtype), plgpu.Layout.WGMMA)
            plgpu.barrier_wait(ready.at[0])
            acc_smem[...] = matmul_acc(jnp.zeros((ROWS, d), F32), weights, x_smem, False)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(acc_smem.at[pl.ds(0, 8)], out_ref.at[i, t, j])
            plgpu.wait_smem_to_gmem(0)

    scratch = [smem_tiled((CHUNK, d), x.dtype)]
    if lse2 is not None:
        scratch.append(plgpu.SMEM((CHUNK,), F32))
    scratch += [plgpu.SMEM((ROWS, d), F32, transforms=(plgpu.TilingTransform((8, 32)),
                                                      plgpu.SwizzleTransform(128))),
                plgpu.Barrier(num_barriers=2)]
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((b, s // CHUNK, h, 8, d), F32),
                        scratch_types=tuple(scratch), grid=(b, s // CHUNK, h),
                        grid_names=("b", "t", "h"))(
        flag, x, *(() if lse2 is None else (lse2,)))
