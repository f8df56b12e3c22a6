"""Block maps against brute force, by where the mask comes from: the built-in
masks (with padding lengths and packed sequences), mask_mods, and dense boolean and
random masks (alone and intersected)."""
import jax.numpy as jnp
import numpy as np
import pytest

from fusedattn import block_sparse as bs
from fusedattn.sequence import SequenceDescriptor
from support.block_map_reference import (band, check, dense_mod, doc_ids, documents,
                                          prefix_lm, sliding)


SHAPES = [(256, 256, (128, 128)), (300, 200, (128, 128)), (200, 333, (64, 128)),
          (77, 77, (32, 16))]


# ---- built-in masks (static) -----------------------------------------------------
@pytest.mark.parametrize("s_q,s_kv,block", SHAPES)
@pytest.mark.parametrize("mask,window", [
    ("none", None), ("causal", None), ("causal_bottom_right", None), ("none", (40, 10)),
    ("causal", (70, 0)), ("causal_bottom_right", (33, -1)), ("none", (-1, 5)), ("none", (0, 0))])
def test_builtin(s_q, s_kv, block, mask, window):
    bm = bs.from_builtin(s_q, s_kv, mask=mask, window=window, block=block)
    assert bm.static and bm.shape[:2] == (1, 1)
    check(bm, band(s_q, s_kv, mask, window)[None, None])


@pytest.mark.parametrize("mask,window", [("causal", None), ("causal_bottom_right", (50, 0)),
                                         ("none", (30, 20)), ("none", None)])
def test_padding_lengths(mask, window):
    q_len, kv_len = np.array([300, 17, 0, 250]), np.array([200, 260, 100, 250])
    seq = SequenceDescriptor.from_lengths(q_len, kv_len)
    bm = bs.from_builtin(300, 260, mask=mask, window=window, sequence=seq, block=(64, 128))
    assert not bm.static and bm.shape[:2] == (4, 1)
    vis = np.stack([band(300, 260, mask, window, q, k) for q, k in zip(q_len, kv_len)])
    check(bm, vis[:, None])


def packed_reference(q_ids, kv_ids, mask, window):
    """Sorted packed segments: ids equal and nonzero, band on positions in segment."""
    out = []
    for qi, ki in zip(q_ids, kv_ids):
        vis = np.zeros((qi.size, ki.size), bool)
        for n in set(qi.tolist()) - {0}:
            rows, cols = np.flatnonzero(qi == n), np.flatnonzero(ki == n)
            if cols.size:
                sub = band(rows.size, cols.size, mask, window)
                vis[np.ix_(rows, cols)] = sub
        out.append(vis)
    return np.stack(out)[:, None]


@pytest.mark.parametrize("mask,window", [("causal", None), ("causal_bottom_right", None),
                                         ("none", (20, 3)), ("none", None)])
def test_packed_sequence(mask, window):
    q_ids = np.array([[1] * 100 + [2] * 60 + [3] * 90 + [0] * 10,
                      [1] * 30 + [2] * 200 + [0] * 30])
    kv_ids = np.array([[1] * 80 + [2] * 100 + [3] * 20 + [0] * 0,
                       [1] * 50 + [2] * 50 + [0] * 100])
    seq = SequenceDescriptor.from_segment_ids(q_ids, kv_ids, max_segments=3)
    bm = bs.from_builtin(260, 200, mask=mask, window=window, sequence=seq, block=(64, 32))
    check(bm, packed_reference(q_ids, kv_ids, mask, window))


# ---- mask_mods ---------------------------------------------------------------------
def per_head(b, h, i, j):
    return (j <= i) & (i - j < 40 * (h + 1))


def per_batch(b, h, i, j, lengths):
    return (j < lengths[b]) & (i < lengths[b])


@pytest.mark.parametrize("s_q,s_kv,block", SHAPES)
@pytest.mark.parametrize("fn", [sliding, prefix_lm])
def test_position_mask_mod_static(s_q, s_kv, block, fn):
    bm = bs.block_map(fn, 2, 4, s_q, s_kv, block=block)
    assert bm.static and bm.shape[:2] == (1, 1)
    check(bm, dense_mod(fn, 1, 1, s_q, s_kv))


def test_per_head_mask_mod():
    bm = bs.block_map(per_head, 3, 4, 300, 300, block=(64, 64))
    assert bm.static is False and bm.shape[:2] == (1, 4)
    check(bm, dense_mod(per_head, 1, 4, 300, 300))


def test_per_batch_mask_mod_from_array():
    lengths = jnp.array([300, 10, 129, 0], jnp.int32)
    bm = bs.block_map(per_batch, 4, 8, 300, 300, args=(lengths,), block=(128, 128))
    assert bm.shape[:2] == (4, 1)
    check(bm, dense_mod(per_batch, 4, 1, 300, 300, (lengths,)))


@pytest.mark.parametrize("sort", [True, False])
def test_documents_mask_mod(sort):
    ids = jnp.asarray(doc_ids(np.random.default_rng(0), 2, 400, 5, sort), jnp.int32)
    bm = bs.block_map(documents, 2, 16, 400, 400, args=(ids,), block=(64, 128))
    assert bm.shape[:2] == (2, 1)
    check(bm, dense_mod(documents, 2, 1, 400, 400, (ids,)))


def test_mask_mod_with_padding_and_causal():
    seq = SequenceDescriptor.from_lengths(np.array([250, 90]), np.array([200, 256]))
    bm = bs.block_map(prefix_lm, 2, 2, 256, 256, mask="causal_bottom_right", sequence=seq,
                      block=(64, 64))
    vis = dense_mod(prefix_lm, 1, 1, 256, 256)[0, 0] & np.stack(
        [band(256, 256, "causal_bottom_right", None, q, k) for q, k in [(250, 200), (90, 256)]])
    check(bm, vis[:, None])


def test_mask_mod_sees_positions_in_packed_segments():
    ids = np.array([[1] * 100 + [2] * 100 + [3] * 56])
    seq = SequenceDescriptor.from_segment_ids(ids, max_segments=3)
    bm = bs.block_map(lambda b, h, i, j: j >= i - 10, 1, 1, 256, 256, sequence=seq,
                      block=(32, 32))
    vis = packed_reference(ids, ids, "none", (10, -1))
    check(bm, vis)


# ---- dense boolean masks and random masks ---------------------------------------------
def random_mask(rng, shape, block):
    """Blocks of all-false / all-true / random pairs, so every kind appears."""
    B, H, s_q, s_kv = shape
    bq, bk = block
    coarse = rng.integers(0, 3, size=(B, H, -(-s_q // bq), -(-s_kv // bk)))
    fine = rng.random(shape) < rng.random()
    up = np.repeat(np.repeat(coarse, bq, axis=2), bk, axis=3)[:, :, :s_q, :s_kv]
    return np.where(up == 0, False, np.where(up == 2, True, fine))


@pytest.mark.parametrize("seed", range(8))
def test_random_dense_masks(seed):
    rng = np.random.default_rng(seed)
    block = tuple(int(x) for x in rng.choice([16, 32, 64], size=2))
    shape = (int(rng.choice([1, 2])), int(rng.choice([1, 3])),
             int(rng.integers(1, 200)), int(rng.integers(1, 200)))
    m = random_mask(rng, shape, block)
    host = bs.from_dense_mask(m, block=block)
    assert host.static and host.shape[:2] == shape[:2]
    check(host, m)
    device = bs.from_dense_mask(jnp.asarray(m), block=block)
    assert not device.static
    check(device, m)


@pytest.mark.parametrize("block", [(128, 128), (64, 32), (32, 16), (256, 256), (16, 64)])
def test_device_dense_map_reduces_the_kernels_bits(block):
    """A device map of a dense mask packs it once, reduces the words (where its key
    blocks hold whole words), and keeps them for the kernels: the same kinds as brute
    force, on either path."""
    from fusedattn.block_sparse.kernel_mask import kernel_mask, pack_bits
    from fusedattn.block_sparse.kernel_parts import whole
    rng = np.random.default_rng(sum(block))
    shape = (2, 1, 300, 333)
    m = random_mask(rng, shape, block)
    bm = bs.from_dense_mask(jnp.asarray(m), block=block)
    check(bm, m)
    bits = bm.element.terms[0].bits
    np.testing.assert_array_equal(bits, pack_bits(jnp.asarray(m), whole(300), whole(333)))
    assert kernel_mask(bm.element).dense is bits


@pytest.mark.parametrize("seed", range(4))
def test_random_combinations(seed):
    """A random dense mask AND a mask_mod AND causal: exact, not a product of kinds."""
    rng = np.random.default_rng(100 + seed)
    s_q, s_kv, block = 190, 230, (32, 64)
    m = random_mask(rng, (2, 1, s_q, s_kv), block)
    combo = bs.intersect(bs.from_dense_mask(jnp.asarray(m), block=block),
                         bs.block_map(sliding, s_q=s_q, s_kv=s_kv, mask="causal", block=block))
    vis = m & dense_mod(sliding, 1, 1, s_q, s_kv) & band(s_q, s_kv, "causal")
    check(combo, vis)


def test_intersect_of_disjoint_partials_is_empty():
    lower = bs.block_map(lambda b, h, i, j: j < i - 200, s_q=256, s_kv=256, block=(256, 256))
    upper = bs.block_map(lambda b, h, i, j: j > i + 200, s_q=256, s_kv=256, block=(256, 256))
    assert int(lower.kind[0, 0, 0, 0]) == int(upper.kind[0, 0, 0, 0]) == 1
    both = bs.intersect(lower, upper)
    assert both.static and int(both.kind[0, 0, 0, 0]) == 0


def test_dense_mask_broadcast_dims():
    m = np.tril(np.ones((100, 100), bool))
    bm = bs.from_dense_mask(m, block=(32, 32))
    assert bm.shape[:2] == (1, 1)
    check(bm, m[None, None])
