"""Brute-force block maps for the block-map tests (tests/test_block_map_*.py): the
element mask evaluated densely, reduced block by block, and the lists read off the
kinds with plain loops; the built-in masks written out, and the mask_mods and
document ids that several of those files build maps from."""
import jax.numpy as jnp
import numpy as np


def ref_kinds(vis, block):
    """[B, H, s_q, s_kv] bool -> kinds; a block overhanging a length is never full."""
    bq, bk = block
    B, H, s_q, s_kv = vis.shape
    n_q, n_kv = -(-s_q // bq), -(-s_kv // bk)
    kind = np.zeros((B, H, n_q, n_kv), np.int32)
    for qb in range(n_q):
        for kb in range(n_kv):
            tile = vis[:, :, qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk]
            whole = tile.shape[2:] == (bq, bk)
            kind[:, :, qb, kb] = np.where(tile.all(axis=(2, 3)) & whole, 2,
                                          np.where(tile.any(axis=(2, 3)), 1, 0))
    return kind


def check_lists(kind, count, indices, want):
    """count/indices over the last axis of `kind` list the blocks of kind `want`."""
    for idx in np.ndindex(kind.shape[:-1]):
        expect = np.flatnonzero(kind[idx] == want)
        n = int(count[idx])
        assert n == expect.size, idx
        assert list(indices[idx][:n]) == list(expect), idx
        pad = expect[-1] if n else 0
        assert (indices[idx][n:] == pad).all(), idx


def check(bm, vis, block=None):
    """`bm` matches the dense visibility `vis` [B, H, s_q, s_kv] (broadcast as needed)."""
    block = block or bm.block
    B = max(vis.shape[0], bm.shape[0])
    H = max(vis.shape[1], bm.shape[1])
    vis = np.broadcast_to(np.asarray(vis, bool), (B, H) + vis.shape[2:])
    want = ref_kinds(vis, block)
    kind = np.broadcast_to(np.asarray(bm.kind), want.shape)
    np.testing.assert_array_equal(kind, want)
    b = lambda name: np.broadcast_to(np.asarray(getattr(bm, name)),  # noqa: E731
                                     want.shape[:2] + np.asarray(getattr(bm, name)).shape[2:])
    check_lists(want, b("kv_num_blocks"), b("kv_indices"), 1)
    check_lists(want, b("full_kv_num_blocks"), b("full_kv_indices"), 2)
    want_t = np.swapaxes(want, -1, -2)
    check_lists(want_t, b("q_num_blocks"), b("q_indices"), 1)
    check_lists(want_t, b("full_q_num_blocks"), b("full_q_indices"), 2)
    for name in ("kind", "kv_indices", "q_indices", "full_kv_num_blocks"):
        assert np.asarray(getattr(bm, name)).dtype == np.int32
    # The element mask a kernel applies equals the visibility, overhang hidden.
    bq, bk = block
    n_q, n_kv = kind.shape[2:]
    ar = lambda n, shape: np.arange(n, dtype=np.int32).reshape(shape)  # noqa: E731
    el = bm.element_mask(ar(B, (B, 1, 1, 1)), ar(H, (1, H, 1, 1)),
                         ar(n_q * bq, (1, 1, -1, 1)), ar(n_kv * bk, (1, 1, 1, -1)))
    el = np.broadcast_to(np.asarray(el), (B, H, n_q * bq, n_kv * bk))
    np.testing.assert_array_equal(el[:, :, :vis.shape[2], :vis.shape[3]], vis)
    assert not el[:, :, vis.shape[2]:].any() and not el[:, :, :, vis.shape[3]:].any()


def grid(s_q, s_kv):
    return np.arange(s_q)[:, None], np.arange(s_kv)[None, :]


def band(s_q, s_kv, mask="none", window=None, q_len=None, kv_len=None):
    """Reference built-in masks for one row: config.py's rules written out."""
    q_len = s_q if q_len is None else q_len
    kv_len = s_kv if kv_len is None else kv_len
    left, right = window if window is not None else (-1, -1)
    if mask != "none":
        right = 0
    o = kv_len - q_len if mask == "causal_bottom_right" else 0
    i, j = grid(s_q, s_kv)
    vis = (i < q_len) & (j < kv_len)
    if right >= 0:
        vis &= j <= i + o + right
    if left >= 0:
        vis &= j >= i + o - left
    return vis


def dense_mod(fn, B, H, s_q, s_kv, args=()):
    ar = lambda n, s: jnp.arange(n, dtype=jnp.int32).reshape(s)  # noqa: E731
    out = fn(ar(B, (B, 1, 1, 1)), ar(H, (1, H, 1, 1)), ar(s_q, (1, 1, s_q, 1)),
             ar(s_kv, (1, 1, 1, s_kv)), *args)
    return np.broadcast_to(np.asarray(out), (B, H, s_q, s_kv))


def sliding(b, h, i, j):
    return (j <= i) & (i - j < 100)


def prefix_lm(b, h, i, j):
    return (j <= i) | (j < 150)


def documents(b, h, i, j, ids):
    return ids[b, i] == ids[b, j]


def doc_ids(rng, b, s, n_docs, sort=True):
    ids = rng.integers(1, n_docs + 1, size=(b, s))
    return np.sort(ids, axis=1) if sort else ids
