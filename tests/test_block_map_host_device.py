"""Where block maps are built and how they travel: static maps on the host with no
device work, device maps under jit (chunked, as pytrees, sharded with the batch axis),
plus the summaries (describe, density) and the argument checks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fusedattn import block_sparse as bs
from support.block_map_reference import (band, check, dense_mod, doc_ids, documents,
                                          prefix_lm, sliding)


# ---- static maps do no device work; device maps run under jit ---------------------------
def test_static_map_needs_no_device_work():
    with jax.transfer_guard("disallow"):
        bm = bs.block_map(prefix_lm, 4, 16, 1000, 1000, mask="causal", window=(300, 0))
    leaves = jax.tree_util.tree_leaves(bm)
    assert bm.static and all(isinstance(x, np.ndarray) for x in leaves)
    # Built inside a trace it is a constant: the traced program holds no operation.
    jaxpr = jax.make_jaxpr(lambda: bs.block_map(prefix_lm, s_q=512, s_kv=512).kv_indices)()
    assert not jaxpr.eqns


def test_static_map_under_jit_with_unread_args():
    """A mask_mod given arguments it does not read still has a static map in a trace."""
    @jax.jit
    def build(table):
        bm = bs.block_map(lambda b, h, i, j, t: (j <= i) & (i - j < 64), s_q=256, s_kv=256,
                          args=(table,), block=(32, 32))
        assert bm.static and isinstance(bm.kind, np.ndarray)
        return bm
    bm = build(jnp.ones((8,), jnp.float32))
    check(bm, band(256, 256, "causal", (63, 0))[None, None])


def test_large_static_mask_runs_on_the_device(monkeypatch):
    """Past the host limit a position-only mask is classified on the device, same map."""
    from fusedattn.block_sparse import classify
    host = bs.block_map(sliding, s_q=300, s_kv=280, block=(64, 32))
    monkeypatch.setattr(classify, "MAX_HOST_ELEMENTS", 1000)
    device = bs.block_map(sliding, s_q=300, s_kv=280, block=(64, 32), mask="causal")
    assert host.static and not device.static
    np.testing.assert_array_equal(np.asarray(device.kind), host.kind)
    check(device, dense_mod(sliding, 1, 1, 300, 280))


def test_static_kinds_are_cached():
    a = bs.block_map(prefix_lm, s_q=384, s_kv=384, mask="causal", window=[200, 0])
    b = bs.block_map(prefix_lm, 2, 2, 384, 384, mask="causal", window=(200, 0))
    assert a.kind is b.kind  # one host evaluation for both
    c = bs.block_map(prefix_lm, s_q=384, s_kv=384, mask="causal", window=(100, 0))
    assert not np.array_equal(a.kind, c.kind)


def test_device_map_under_jit():
    ids = jnp.asarray(doc_ids(np.random.default_rng(3), 2, 300, 3, sort=False), jnp.int32)

    @jax.jit
    def build(ids):
        return bs.block_map(documents, 2, 4, 300, 300, args=(ids,), mask="causal",
                            block=(64, 64))
    bm = build(ids)
    assert isinstance(bm, bs.BlockMap) and bm.block == (64, 64)
    vis = dense_mod(documents, 2, 1, 300, 300, (ids,)) & band(300, 300, "causal")
    check(bm, vis)
    eager = bs.block_map(documents, 2, 4, 300, 300, args=(ids,), mask="causal", block=(64, 64))
    for a, b in zip(jax.tree_util.tree_leaves(bm), jax.tree_util.tree_leaves(eager)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_device_map_chunks_query_blocks(monkeypatch):
    """Several lax.map steps (small chunks) give the same map as one."""
    from fusedattn.block_sparse import classify
    ids = jnp.asarray(doc_ids(np.random.default_rng(4), 1, 500, 4), jnp.int32)
    one = bs.block_map(documents, 1, 1, 500, 500, args=(ids,), block=(32, 64))
    monkeypatch.setattr(classify, "CHUNK_ELEMENTS", 1)
    many = bs.block_map(documents, 1, 1, 500, 500, args=(ids,), block=(32, 64))
    np.testing.assert_array_equal(np.asarray(one.kind), np.asarray(many.kind))
    check(many, dense_mod(documents, 1, 1, 500, 500, (ids,)))


def test_pytree_passes_through_jit():
    bm = bs.from_segment_ids(jnp.asarray(doc_ids(np.random.default_rng(5), 2, 256, 3)))
    out = jax.jit(lambda m: m)(bm)
    assert out.block == bm.block and out.s_q == 256
    np.testing.assert_array_equal(np.asarray(out.kind), np.asarray(bm.kind))
    leaves, tree = jax.tree_util.tree_flatten(bm)
    again = jax.tree_util.tree_unflatten(tree, leaves)
    np.testing.assert_array_equal(np.asarray(again.full_q_indices), np.asarray(bm.full_q_indices))


# ---- summaries and argument checks --------------------------------------------------------
def test_describe_and_density():
    bm = bs.from_builtin(512, mask="causal")
    assert bm.density() == pytest.approx(10 / 16)
    assert bm.counts() == (4, 6, 16)
    assert "62.5% of blocks visible (4 partial, 6 full, 6 empty)" in bm.describe()
    seen = []

    @jax.jit
    def traced(x):
        bm = bs.from_dense_mask(x)
        seen.append((bm.describe(), bm.density()))
        return bm.kind
    traced(jnp.ones((1, 1, 256, 256), bool))
    assert seen[0][1] is None and "(on the device): density known when it runs" in seen[0][0]


def test_bad_arguments():
    with pytest.raises(ValueError):
        bs.block_map(sliding, s_q=0)
    with pytest.raises(ValueError):
        bs.from_builtin(64, mask="causal", window=(3, 2))
    with pytest.raises(TypeError):
        bs.from_dense_mask(np.ones((4, 4), np.int32))
    with pytest.raises(TypeError):
        bs.block_map(sliding, s_q=64, block=64)


def test_map_shards_with_the_batch_axis():
    """Every leaf of a per-batch map leads with the batch axis, so one sharding of
    the batch axis places the whole map (as it places q, k, v)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    if len(jax.devices()) < 2:
        pytest.skip("needs two devices")
    ids = jnp.asarray(doc_ids(np.random.default_rng(6), 2, 256, 3), jnp.int32)
    bm = bs.from_segment_ids(ids, block=(64, 64))
    mesh = Mesh(np.array(jax.devices()[:2]), ("b",))
    sharded = jax.device_put(bm, NamedSharding(mesh, P("b")))
    counts = jax.jit(lambda m: m.kv_num_blocks + m.full_kv_num_blocks)(sharded)
    assert len(sharded.kv_indices.sharding.device_set) == 2
    np.testing.assert_array_equal(np.asarray(counts),
                                  np.asarray(bm.kv_num_blocks + bm.full_kv_num_blocks))
