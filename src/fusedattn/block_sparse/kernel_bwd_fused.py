"""The block-sparse backward of one native kernel for documents and dense masks
(Hopper): `csrc/cuda/block_sparse_bwd`, CuTe with wgmma and TMA, five products a
tile where the two Mosaic GPU kernels (`kernel_bwd`) take seven. It walks the
key-major lists and adds dq in f32 with TMA reductions, so it is not bitwise
reproducible: ``deterministic=True`` keeps the Mosaic kernels.

It serves maps whose element mask is one term: a documents mask (ids equal, both
tokens valid: `documents`), which reaches it and the Mosaic forward as two int32
rows per token (`words`), or a dense mask, whose packed bits (`kernel_mask.pack_bits`)
both read. No score_mod; d 128, bf16 or fp16, bshd, s_q == s_kv, on an extension
built with it (the CUTLASS headers at build time). jax.nn's mean of v for rows that
see no key adds its gradient to dv in the kernel.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..backends import extension
from .documents import Documents
from .kernel_parts import whole

TARGET = "fusedattn_block_sparse_bwd"


def reason(q, *, seq_first: bool, implementation: str, s_kv: Optional[int] = None,
           kv_dtypes=()) -> Optional[str]:
    """None when a call of these arrays (q, keys of length `s_kv`: None, q's, and k / v
    of `kv_dtypes`) can take the kernel (mask aside), else why not."""
    if implementation != "mosaic":
        return "the Mosaic GPU kernels do not run here (it runs beside them, on Hopper)"
    if q.shape[-1] != 128 or q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"it takes d 128 in bf16 or fp16, got d {q.shape[-1]} in {q.dtype}"
    if any(t != q.dtype for t in kv_dtypes):
        return f"it takes q, k and v of one dtype, got {q.dtype} and {list(kv_dtypes)}"
    if seq_first:
        return "it reads bshd arrays, not sbhd"
    if s_kv is not None and s_kv != q.shape[1]:
        # (the kernel takes them, but has not been checked against the oracle there)
        return f"it runs s_q == s_kv, got {q.shape[1]} queries and {s_kv} keys"
    return extension.ensure_targets([TARGET])


def words(docs: Documents, s_q: int, s_kv: int):
    """(q_words, kv_words): int32 ``[B|1, 2, whole s]``, the id and 1 / 0 for valid per
    token, the tokens past the real length invalid; both on one batch (the kernel
    reads them with one stride)."""
    batch = docs.batch

    def one(ids, valid, s):
        ids = jnp.asarray(ids, jnp.int32)
        ok = jnp.ones_like(ids) if valid is None else jnp.asarray(valid).astype(jnp.int32)
        ids, ok = jnp.broadcast_arrays(ids, ok)
        w = jnp.stack([ids, ok], axis=1)
        w = jnp.broadcast_to(w, (batch,) + w.shape[1:])
        return jnp.pad(w, ((0, 0), (0, 0), (0, whole(s) - s)))
    return one(docs.q_ids, docs.q_valid, s_q), one(docs.kv_ids, docs.kv_valid, s_kv)


def visible(b, h, q, kv, qv, kvv, d):
    """The words' element mask, as the kernels' mask functions take it."""
    return (qv[0] == kvv[0]) & (qv[1] != 0) & (kvv[1] != 0)


def launch_order(lists, b: int, h: int):
    """The kernel's tiles (key blocks of each batch row and head) longest walk first:
    int32 ``[b * h * n_kv]`` of ``(b_i * h + h_i) * n_kv + kb``, the key-major `lists`'
    partial and full counts summed (the lists may broadcast over batch and heads)."""
    num, _, full_num, _ = lists
    steps = jnp.broadcast_to(num + full_num, (b, h, num.shape[-1])).reshape(-1)
    return jnp.argsort(-steps, stable=True).astype(jnp.int32)


def backward(q, k, v, do, lse_delta, lists, q_words, kv_words, bits, dv_add, *,
             scale: float, s_kv: int):
    """(dq, dk, dv): dq in q's dtype, dk / dv per query head (the caller sums a GQA
    group). q, k, v, do bshd over whole blocks; `lse_delta` and `lists` (key-major) as
    the Mosaic kernels take them. The mask: the words of `words` (`q_words`,
    `kv_words`) or packed `bits` (the other None); the kernel hides keys at or past
    `s_kv` itself. `dv_add` f32 [B, H, D] (or None) is added to every key's dv."""
    b, s, h, d = q.shape
    per_head = jax.ShapeDtypeStruct((b, k.shape[1], h, d), q.dtype)
    none = lambda x, dtype=jnp.int32: jnp.zeros((0,), dtype) if x is None else x
    dq, dk, dv = jax.ffi.ffi_call(
        TARGET, (jax.ShapeDtypeStruct(q.shape, jnp.float32), per_head, per_head),
        vmap_method="sequential")(
        q, k, v, do, lse_delta, *lists, none(q_words), none(kv_words), none(bits),
        none(dv_add, jnp.float32), launch_order(lists, b, h), scale=np.float32(scale),
        causal=False, s_kv_real=np.int32(s_kv))
    return (dq * scale).astype(q.dtype), dk, dv
