"""`block_sparse_attention`: attention that runs only the blocks a `BlockMap` lists.

On Hopper GPUs the Mosaic GPU kernels (`kernel_fwd`, `kernel_bwd`) run it;
elsewhere (and with ``implementation="reference"``) the same list walks in plain
JAX (`reference`). Both save the base-2 log-sum-exp for the backward, which
walks the query-major lists for dq and the key-major lists for dk / dv.
`block_sparse_attention_backward` runs that backward alone, from a forward's
output and log-sum-exp (the fusedattn backend's two partitioned steps).
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import kernel_bwd, kernel_fwd, reference
from .block_map import BlockMap
from .kernel_mask import KernelMask, kernel_mask
from .kernel_parts import BLOCK

IMPLEMENTATIONS = ("mosaic", "reference")


def block_sparse_attention(q, k, v, block_map: BlockMap, *, scale: Optional[float] = None,
                           score_mod: Optional[Callable] = None,
                           implementation: Optional[str] = None):
    """Attention of q ``[b, s_q, h_q, d]`` over k, v ``[b, s_kv, h_kv, d]`` (bshd,
    h_q a multiple of h_kv) where `block_map` says which pairs are visible;
    ``score_mod(score, b, h, q_idx, kv_idx)`` rewrites the scaled score (elementwise
    JAX code; on GPU it runs inside the kernel). Rows with no visible key give 0.
    Differentiable in q, k, v. Lengths need not be multiples of the block: the arrays
    are padded to whole blocks and the padding masked. `implementation`: "mosaic",
    "reference" or None (mosaic on a Hopper GPU, else reference)."""
    out, _ = _call(q, k, v, block_map, scale, score_mod, implementation)
    return out


def block_sparse_attention_with_lse(q, k, v, block_map: BlockMap, *, scale=None,
                                    score_mod=None, implementation=None):
    """(out, lse): lse is the fp32 natural log-sum-exp ``[b, h_q, s_q]`` (-inf on
    rows with no visible key)."""
    out, lse2 = _call(q, k, v, block_map, scale, score_mod, implementation)
    return out, lse2 * math.log(2.0)


def choose_implementation(q, implementation=None) -> str:
    if implementation is not None:
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
        return implementation
    ok = q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[-1] in (64, 128)
    return "mosaic" if on_hopper() and ok else "reference"


def on_hopper() -> bool:
    """Whether JAX's first device is a Hopper GPU (what the Mosaic GPU kernels need)."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and getattr(dev, "compute_capability", "") == "9.0"


def block_sparse_attention_backward(q, k, v, out, lse, d_out, block_map: BlockMap, *,
                                    scale=None, score_mod=None, implementation=None):
    """(dq, dk, dv) of `block_sparse_attention` at cotangent `d_out`, from the forward's
    `out` and natural `lse` (`block_sparse_attention_with_lse`): the backward kernels
    alone, for a caller that runs the forward and the backward as steps of its own."""
    s_q, s_kv = q.shape[1], k.shape[1]
    fn, scale, impl, (q, k, v), ints = _operands(q, k, v, block_map, scale, implementation)
    whole = q.shape[1]
    # (padded rows see no key: lse -inf, output 0, as the forward gives them)
    lse2 = jnp.pad(lse.astype(jnp.float32) / math.log(2.0), ((0, 0), (0, 0), (0, whole - s_q)),
                   constant_values=-jnp.inf)
    out, d_out = (_pad_tokens(x, whole) for x in (out, d_out))
    dq, dk, dv, _ = _bwd(fn, scale, score_mod, impl, (q, k, v, ints, out, lse2), (d_out, None))
    return dq[:, :s_q], dk[:, :s_kv], dv[:, :s_kv]


def _call(q, k, v, bm, scale, score_mod, implementation):
    s_q = q.shape[1]
    fn, scale, impl, (q, k, v), ints = _operands(q, k, v, bm, scale, implementation)
    out, lse2 = _attention(fn, scale, score_mod, impl, q, k, v, ints)
    return out[:, :s_q], lse2[..., :s_q]


def _operands(q, k, v, bm, scale, implementation):
    """(mask fn, scale, implementation, padded (q, k, v), the map's int arrays) of a call."""
    _check(q, k, v, bm)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    impl = choose_implementation(q, implementation)
    km = _padded(kernel_mask(bm.element), bm.s_q, bm.s_kv)
    # Lengths past a block boundary: the arrays padded to whole blocks (the map already
    # has the blocks; the key padding is masked in the last block, which is never full,
    # and the padded rows' outputs are cut off, so their cotangent is 0).
    q, k, v = (_pad_tokens(x, _whole(x.shape[1])) for x in (q, k, v))
    fwd_lists = tuple(jnp.asarray(x, jnp.int32) for x in
                      (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices))
    bwd_lists = tuple(jnp.asarray(x, jnp.int32) for x in
                      (bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices))
    return km.fn, scale, impl, (q, k, v), (fwd_lists, bwd_lists, km.q_arrays, km.kv_arrays,
                                           km.dense)


def _whole(s: int) -> int:
    return -(-s // BLOCK) * BLOCK


def _pad_tokens(x, size: int, axis: int = 1):
    if x is None or x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _padded(km: KernelMask, s_q: int, s_kv: int) -> KernelMask:
    """The kernel mask over whole blocks: its arrays padded, and keys past s_kv hidden."""
    if s_q % BLOCK == 0 and s_kv % BLOCK == 0:
        return km
    fn = km.fn
    if s_kv % BLOCK:
        def fn(b, h, q, kv, qv, kvv, d, inner=km.fn):
            return inner(b, h, q, kv, qv, kvv, d) & (kv < s_kv)
    dense = km.dense
    if dense is not None:
        dense = _pad_tokens(_pad_tokens(dense, _whole(s_q), axis=2), _whole(s_kv), axis=3)
    return KernelMask(_pad_tokens(km.q_arrays, _whole(s_q), axis=2),
                      _pad_tokens(km.kv_arrays, _whole(s_kv), axis=2), dense, fn)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _attention(fn, scale, score_mod, impl, q, k, v, ints):
    return _forward(fn, scale, score_mod, impl, q, k, v, ints)


def _forward(fn, scale, score_mod, impl, q, k, v, ints):
    fwd_lists, _, qa, ka, dense = ints
    km = KernelMask(qa, ka, dense, fn)
    if impl == "mosaic":
        return kernel_fwd.forward(q, k, v, fwd_lists, km, scale=scale, score_mod=score_mod)
    return reference.forward(q, k, v, fwd_lists, km, scale=scale, score_mod=score_mod)


def _fwd(fn, scale, score_mod, impl, q, k, v, ints):
    out, lse2 = _forward(fn, scale, score_mod, impl, q, k, v, ints)
    return (out, lse2), (q, k, v, ints, out, lse2)


def _bwd(fn, scale, score_mod, impl, res, cts):
    q, k, v, ints, out, lse2 = res
    do = cts[0].astype(q.dtype)
    fwd_lists, bwd_lists, qa, ka, dense = ints
    km = KernelMask(qa, ka, dense, fn)
    delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), do.astype(jnp.float32))
    # A reduction of its own: fused into the stack below, XLA computed it element by
    # element in a loop fusion, which cost as much as a third of the backward.
    delta = jax.lax.optimization_barrier(delta)
    # +inf on rows with no visible key: their probabilities exp2(s - lse) are 0
    lse_delta = jnp.stack([jnp.where(lse2 == -jnp.inf, jnp.inf, lse2), delta], axis=2)
    kw = dict(scale=scale, score_mod=score_mod)
    if impl == "mosaic":
        dq = kernel_bwd.dq(q, k, v, do, lse_delta, fwd_lists, km, **kw)
        km_t = km if dense is None else km._replace(dense=jnp.swapaxes(dense, -1, -2))
        dk, dv = kernel_bwd.dkv(q, k, v, do, lse_delta, bwd_lists, km_t, **kw)
    else:
        dq = reference.dq(q, k, v, do, lse_delta, fwd_lists, km, **kw)
        dk, dv = reference.dkv(q, k, v, do, lse_delta, bwd_lists, km, **kw)
    dk, dv = (_group_sum(x, k.shape[2]).astype(k.dtype) for x in (dk, dv))
    zeros = jax.tree_util.tree_map(lambda x: np.zeros(np.shape(x), jax.dtypes.float0), ints)
    return dq, dk, dv, zeros


_attention.defvjp(_fwd, _bwd)


def _group_sum(x, h_kv):
    """Per-query-head dk / dv [b, s, h_q, d] -> [b, s, h_kv, d] summed over each group."""
    b, s, h, d = x.shape
    if h == h_kv:
        return x
    return x.reshape(b, s, h_kv, h // h_kv, d).astype(jnp.float32).sum(3)


def _check(q, k, v, bm: BlockMap):
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"q, k, v must be bshd with k.shape == v.shape, got {q.shape}, "
                         f"{k.shape}, {v.shape}")
    b, s_q, h_q, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or h_q % k.shape[2]:
        raise ValueError(f"k/v {k.shape} do not fit q {q.shape} (h_q must be a multiple of h_kv)")
    if tuple(bm.block) != (BLOCK, BLOCK):
        raise ValueError(f"block_sparse_attention needs a map of {BLOCK}x{BLOCK} blocks, "
                         f"got {bm.block}")
    if (bm.s_q, bm.s_kv) != (s_q, k.shape[1]):
        raise ValueError(f"the map is for {bm.s_q}x{bm.s_kv}, q/k give {s_q}x{k.shape[1]}")
    mb, mh = bm.shape[:2]
    if mb not in (1, b) or mh not in (1, h_q):
        raise ValueError(f"the map's batch/head axes {bm.shape[:2]} do not fit b={b}, h_q={h_q}")
