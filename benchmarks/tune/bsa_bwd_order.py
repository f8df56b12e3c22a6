"""Does the block-sparse backward's CTA launch order matter? Times the dq and dk / dv
kernels alone, dk / dv with its key tiles launched in order and reversed, round-robin
in one process, on the benchmark's documents (long document last), the same documents
long first, and causal. b4 s4096 h16 d128 bf16. `python -m benchmarks.tune.bsa_bwd_order`
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import time_interleaved
from fusedattn import block_sparse as bs
from fusedattn.block_sparse import kernel_bwd
from fusedattn.block_sparse.attention import block_sparse_attention_with_lse
from fusedattn.block_sparse.kernel_mask import kernel_mask

B, S, H, D = 4, 4096, 16, 128


def _ids(docs):
    return jnp.asarray(np.broadcast_to(
        np.concatenate([np.full(n, i, np.int32) for i, n in enumerate(docs)]), (B, S)).copy())


MAPS = {"documents": lambda: bs.from_segment_ids(_ids((512, 1024, 512, 2048)), pad_id=None),
        "documents long first": lambda: bs.from_segment_ids(_ids((2048, 512, 1024, 512)),
                                                             pad_id=None),
        "causal": lambda: bs.from_builtin(S, mask="causal")}


def main():
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(x, (B, S, H, D), jnp.bfloat16) for x in keys)
    scale = D ** -0.5
    calls, refs = {}, {}
    for name, make in MAPS.items():
        bm = make()
        out, lse = jax.jit(lambda q, k, v: block_sparse_attention_with_lse(q, k, v, bm))(q, k, v)
        lse2 = lse / math.log(2.0)
        delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), do.astype(jnp.float32))
        lse_delta = jnp.stack([jnp.where(lse2 == -jnp.inf, jnp.inf, lse2), delta], axis=2)
        by_q = tuple(jnp.asarray(x, jnp.int32) for x in
                     (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices))
        by_kv = tuple(jnp.asarray(x, jnp.int32) for x in
                      (bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices))
        km = kernel_mask(bm.element)
        args = (q, k, v, do, lse_delta)
        calls[f"{name}: dq"] = (jax.jit(lambda *a, by_q=by_q, km=km: kernel_bwd.dq(
            *a, by_q, km, scale=scale)[0]), args)
        for rev in (False, True):
            kernel_bwd.DKV_REVERSED = rev
            fn = jax.jit(lambda *a, by_kv=by_kv, km=km: kernel_bwd.dkv(*a, by_kv, km,
                                                                       scale=scale)[:2])
            got = fn(*args)   # compiled now, with this order
            label = f"{name}: dkv {'reversed' if rev else 'in order'}"
            refs[label] = [np.asarray(x, np.float32) for x in got]
            calls[label] = (fn, args)
        a, b = (refs[f"{name}: dkv {o}"] for o in ("in order", "reversed"))
        assert all(np.array_equal(x, y) for x, y in zip(a, b)), name
    kernel_bwd.DKV_REVERSED = False
    for name, t in time_interleaved(calls).items():
        print(f"{name}: {t * 1e3:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
