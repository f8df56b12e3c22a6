"""block_sparse as the kernels of context parallelism, on host devices (tests/conftest.py).

Each ring or all-gather block builds the map of its own (query shard, key shard) from
the mask_mod at the call's positions, so a block the mask hides has no listed blocks
and nothing is computed there. On CPU the Hopper check is patched to pass and the
kernels run as the reference list walks (`hopper_reference`). Checked: a documents
mask_mod reading a whole [B, S] id array (documents cut off the block grid, every
batch row different), the same ANDed with causal (flex's causal documents), and with
mask="causal" (the zig-zag order), a sliding window as a mask_mod, on 2 and 4 devices of
the sequence axis, against the unsplit call and the float64 oracle.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fusedattn
from fusedattn import ContextParallel
from support import sharding_cases as sc
from support.block_sparse_cases import doc_ids, oracle, rel_error

B, S, H, H_KV, D = 2, 512, 2, 1, 64
TOL_SAME = 1e-2                  # bf16: the blocks' outputs merge in f32 after rounding
TOL_OUT, TOL_GRAD = 2e-2, 4e-2   # bf16 against float64 (test_block_sparse_sharding's)


def _ids():
    """[B, S] document ids, cut off the 128-block grid, each row differently."""
    return jnp.asarray(np.stack([doc_ids(1, S, lengths)[0]
                                 for lengths in ((90, 110, 133, 179), (150, 10, 260, 92))]))


def documents(b, h, i, j, ids):
    return ids[b, i] == ids[b, j]


def causal_documents(b, h, i, j, ids):
    return (ids[b, i] == ids[b, j]) & (j <= i)


def window(b, h, i, j, ids):
    return (j <= i) & (i - j < 100)


CASES = {   # name: (mask_mod, mask)
    "documents": (documents, "none"),
    "causal documents": (causal_documents, "none"),
    "documents, mask=causal": (documents, "causal"),
    "window": (window, "none"),
}


def _visible(mask_mod, mask, ids):
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    vis = np.stack([np.asarray(mask_mod(b, 0, i, j, np.asarray(ids))) for b in range(B)])
    if mask == "causal":
        vis = vis & (j <= i)
    return vis[:, None]


@pytest.mark.parametrize("name,strategy,n", [(name, "ring", 4) for name in sorted(CASES)] + [
    ("documents", "ring", 2), ("documents, mask=causal", "ring", 2),
    ("causal documents", "allgather", 2), ("documents, mask=causal", "allgather", 4)])
def test_block_sparse_blocks_of_a_split_sequence(hopper_reference, name, strategy, n):
    mask_mod, mask = CASES[name]
    ids = _ids()
    keys = jax.random.split(jax.random.key(1), 4)
    q, k, v, do = (jax.random.normal(x, shape, jnp.bfloat16) for x, shape in zip(
        keys, ((B, S, H, D), (B, S, H_KV, D), (B, S, H_KV, D), (B, S, H, D))))
    mesh = jax.make_mesh((n,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
    cp = ContextParallel("cp", strategy=strategy, mesh=mesh)

    def f(q, k, v, cp=cp):
        return fusedattn.fused_attn(q, k, v, mask=mask, mask_mod=mask_mod, score_mod_args=(ids,),
                                    context_parallel=cp, backend="block_sparse")
    plan = fusedattn.explain(q, k, v, mask=mask, mask_mod=mask_mod, score_mod_args=(ids,),
                             context_parallel=cp, backend="block_sparse")
    assert plan.chosen == "block_sparse", plan
    shard = NamedSharding(mesh, P(None, "cp"))
    single, sharded, counts, _ = sc.run(f, [q, k, v], [shard] * 3, do,
                                        reference=functools.partial(f, cp=None))
    if strategy == "ring":
        assert counts["all-gather"] == 0, counts
    sc.assert_same(single, sharded, TOL_SAME)
    want_out, _, want_grads = oracle(q, k, v, _visible(mask_mod, mask, ids), D ** -0.5,
                                     d_out=do)
    (_, out), grads = sharded
    assert rel_error(out, want_out) < TOL_OUT
    for got, want in zip(grads, want_grads[:3]):
        assert rel_error(got, want) < TOL_GRAD
