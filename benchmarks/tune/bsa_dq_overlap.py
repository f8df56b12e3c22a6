"""Does the block-sparse dq kernel gain from overlapping each step's dQ product with the
next step's elementwise work (`kernel_bwd.dq(overlap=True)`: dQ's accumulator held in
flight across steps, S and dP read with one wgmma group pending, dS staged in SMEM,
three K / V stages)? Where ptxas cannot keep wgmma groups in flight it serializes them
(warning C7510), which cancels the overlap: then the two forms time alike.

Checks on the benchmark's documents (b4 s4096 h16 d128 bf16, 512/1024/512/2048, map from
`from_segment_ids`), causal and a dense document mask's map that the overlapped dq equals
the default one bit for bit, then times both round-robin in one process, with the dk / dv
kernel beside them for scale. `python -m benchmarks.tune.bsa_dq_overlap`
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import time_interleaved
from fusedattn import block_sparse as bs
from benchmarks.tune.bsa_inputs import backward_inputs
from fusedattn.block_sparse import kernel_bwd

B, S, H, D = 4, 4096, 16, 128
DOCS = (512, 1024, 512, 2048)


def _ids():
    return jnp.asarray(np.broadcast_to(
        np.concatenate([np.full(n, i, np.int32) for i, n in enumerate(DOCS)]), (B, S)).copy())


MAPS = {"documents": lambda: bs.from_segment_ids(_ids(), pad_id=None),
        "causal": lambda: bs.from_builtin(S, mask="causal"),
        "dense documents": lambda: bs.from_dense_mask(
            _ids()[:, None, :, None] == _ids()[:, None, None, :])}


def main():
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(x, (B, S, H, D), jnp.bfloat16) for x in keys)
    scale = D ** -0.5
    calls = {}
    for name, make in MAPS.items():
        args, by_q, by_kv, km = backward_inputs(make(), q, k, v, do)
        got = {}
        for overlap in (False, True):
            fn = jax.jit(lambda *a, overlap=overlap, by_q=by_q, km=km: kernel_bwd.dq(
                *a, by_q, km, scale=scale, overlap=overlap)[0])
            got[overlap] = np.asarray(fn(*args), np.float32)
            calls[f"{name}: dq{' overlapped' if overlap else ''}"] = (fn, args)
        same = np.array_equal(got[False], got[True])
        err = np.linalg.norm(got[True] - got[False]) / np.linalg.norm(got[False])
        print(f"{name}: overlapped dq bit-identical {same}, relative L2 {err:.1e}", flush=True)
        assert err < 1e-3, (name, err)
        calls[f"{name}: dk / dv"] = (jax.jit(lambda *a, by_kv=by_kv, km=km: kernel_bwd.dkv(
            *a, by_kv, km, scale=scale)[:2]), args)
    for name, t in time_interleaved(calls).items():
        print(f"{name}: {t * 1e3:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
