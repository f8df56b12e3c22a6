"""Block maps against brute force: the element mask evaluated densely, reduced
block by block, and the lists read off the kinds with plain loops."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fusedattn import block_sparse as bs
from fusedattn.sequence import SequenceDescriptor


# ---- brute force -------------------------------------------------------------
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
def dense_mod(fn, B, H, s_q, s_kv, args=()):
    ar = lambda n, s: jnp.arange(n, dtype=jnp.int32).reshape(s)  # noqa: E731
    out = fn(ar(B, (B, 1, 1, 1)), ar(H, (1, H, 1, 1)), ar(s_q, (1, 1, s_q, 1)),
             ar(s_kv, (1, 1, 1, s_kv)), *args)
    return np.broadcast_to(np.asarray(out), (B, H, s_q, s_kv))


def sliding(b, h, i, j):
    return (j <= i) & (i - j < 100)


def prefix_lm(b, h, i, j):
    return (j <= i) | (j < 150)


def per_head(b, h, i, j):
    return (j <= i) & (i - j < 40 * (h + 1))


def per_batch(b, h, i, j, lengths):
    return (j < lengths[b]) & (i < lengths[b])


def documents(b, h, i, j, ids):
    return ids[b, i] == ids[b, j]


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


def doc_ids(rng, b, s, n_docs, sort=True):
    ids = rng.integers(1, n_docs + 1, size=(b, s))
    return np.sort(ids, axis=1) if sort else ids


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


# ---- segment ids -------------------------------------------------------------------
@pytest.mark.parametrize("sort", [True, False])
@pytest.mark.parametrize("mask,window", [("none", None), ("causal", None), ("none", (60, 60))])
def test_segment_ids(sort, mask, window):
    rng = np.random.default_rng(1)
    q_ids = doc_ids(rng, 3, 333, 4, sort)
    q_ids[:, -20:] = 0  # padding at the end
    kv_ids = doc_ids(rng, 3, 270, 4, sort)
    bm = bs.from_segment_ids(jnp.asarray(q_ids), jnp.asarray(kv_ids), mask=mask, window=window,
                             block=(64, 128))
    vis = (q_ids[:, :, None] == kv_ids[:, None, :]) & (q_ids[:, :, None] != 0)
    vis = vis & band(333, 270, mask, window)[None]
    check(bm, vis[:, None])


@pytest.mark.parametrize("seed", range(12))
def test_segment_ids_alone_are_counted_per_block(seed):
    """A documents map alone skips the pairs (ids ranked and counted per block): still
    exact, for unsorted ids, padding, lengths past a block and uneven blocks."""
    rng = np.random.default_rng(seed)
    b, s_q, s_kv = int(rng.integers(1, 3)), int(rng.integers(40, 300)), int(rng.integers(40, 300))
    block = (int(rng.choice([32, 64, 128])), int(rng.choice([32, 64, 128])))
    q_ids, kv_ids = (rng.integers(0, int(rng.integers(1, 6)), (b, s)) for s in (s_q, s_kv))
    if seed % 2:
        q_ids, kv_ids = np.sort(q_ids, axis=1), np.sort(kv_ids, axis=1)
    pad = None if seed % 3 == 0 else 0
    vis = q_ids[:, :, None] == kv_ids[:, None, :]
    if pad is not None:
        vis &= q_ids[:, :, None] != pad
    for ids in ((q_ids, kv_ids), (jnp.asarray(q_ids), jnp.asarray(kv_ids))):
        check(bs.from_segment_ids(*ids, pad_id=pad, block=block), vis[:, None])


def test_segment_ids_host_static_and_pad_none():
    ids = np.repeat(np.array([[0, 1, 2, 0]]), [64, 100, 50, 40], axis=1)
    bm = bs.from_segment_ids(ids, pad_id=None)
    assert bm.static
    check(bm, (ids[:, :, None] == ids[:, None, :])[:, None])


def segment_vis(q_ids, kv_ids, pad):
    vis = q_ids[:, :, None] == kv_ids[:, None, :]
    if pad is not None:
        vis &= q_ids[:, :, None] != pad
    return vis[:, None]


def check_conservative(bm, vis):
    """Ids outside [0, s_q + s_kv) may share a rank mod s_q + s_kv: a block with no
    visible pair may be partial, but full blocks are exactly the all-visible ones
    without overhang and every block with a visible pair is listed (never empty)."""
    want = ref_kinds(np.asarray(vis, bool), bm.block)
    kind = np.broadcast_to(np.asarray(bm.kind), want.shape)
    assert ((kind == 2) == (want == 2)).all()        # full exactly when all visible
    assert not ((kind == 0) & (want != 0)).any()     # never empty with a visible pair
    differ = kind != want
    assert ((kind[differ] == 1) & (want[differ] == 0)).all()  # only empty -> partial
    b = lambda name: np.broadcast_to(np.asarray(getattr(bm, name)),  # noqa: E731
                                     want.shape[:2] + np.asarray(getattr(bm, name)).shape[2:])
    check_lists(kind, b("kv_num_blocks"), b("kv_indices"), 1)
    check_lists(kind, b("full_kv_num_blocks"), b("full_kv_indices"), 2)
    return kind


@pytest.mark.parametrize("seed", range(6))
def test_segment_ids_in_range_are_exact(seed):
    """Ids anywhere in [0, s_q + s_kv) (the largest included) rank as themselves: exact."""
    rng = np.random.default_rng(100 + seed)
    b, s_q, s_kv = 2, int(rng.integers(40, 200)), int(rng.integers(40, 200))
    block = (int(rng.choice([16, 32, 64])), int(rng.choice([16, 32, 64])))
    pool = np.array([0, 1, s_q + s_kv - 1, int(rng.integers(2, s_q + s_kv - 1))])
    q_ids, kv_ids = (np.repeat(rng.choice(pool, (b, s // 8 + 1)), 8, axis=1)[:, :s]
                     for s in (s_q, s_kv))
    if seed % 2:
        q_ids, kv_ids = rng.permuted(q_ids, axis=1), rng.permuted(kv_ids, axis=1)
    pad = None if seed % 3 == 0 else 0
    for ids in ((q_ids, kv_ids), (jnp.asarray(q_ids, jnp.int32), jnp.asarray(kv_ids, jnp.int32))):
        check(bs.from_segment_ids(*ids, pad_id=pad, block=block), segment_vis(q_ids, kv_ids, pad))


OUT_OF_RANGE = {  # ids outside [0, s_q + s_kv): large, negative, near the top of uint32
    "large": (np.int32, [10**6 + k for k in range(5)], 10**6),
    "negative": (np.int32, [-1, -2, -7, -(10**6), 3], -1),
    "uint32": (np.uint32, [2**32 - 1 - k for k in range(4)] + [0], 0),  # jax: pad fits int32
}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", sorted(OUT_OF_RANGE))
def test_segment_ids_out_of_range_are_conservative(kind, seed):
    """Ids outside [0, s_q + s_kv) in random orders, with and without padding, q ids
    other than kv ids: never full or empty wrongly, and host == device."""
    from fusedattn.block_sparse import classify
    from fusedattn.block_sparse.terms import ElementMask, Segments
    dtype, pool, pad_value = OUT_OF_RANGE[kind]
    rng = np.random.default_rng(seed)
    b, s_q, s_kv = 2, int(rng.integers(40, 260)), int(rng.integers(40, 260))
    block = (int(rng.choice([16, 32, 64])), int(rng.choice([16, 32, 64])))
    # One id congruent to another mod s_q + s_kv, so that ranks collide.
    n_ids = s_q + s_kv
    pool = np.array(pool + [pool[0] + n_ids if pool[0] + n_ids < 2**31 else pool[0] - n_ids],
                    dtype)
    # Runs of ids so that full blocks occur, then shuffled or not.
    q_ids, kv_ids = (np.repeat(rng.choice(pool, (b, s // 16 + 1)), 16, axis=1)[:, :s]
                     for s in (s_q, s_kv))
    kv_ids[:, : s_kv // 3] = rng.choice(pool[-2:], (b, s_kv // 3))  # kv differs from q
    if seed % 2:
        q_ids, kv_ids = rng.permuted(q_ids, axis=1), rng.permuted(kv_ids, axis=1)
    pad = None if seed < 2 else pad_value
    vis = segment_vis(q_ids, kv_ids, pad)
    host = bs.from_segment_ids(q_ids, kv_ids, pad_id=pad, block=block)
    device = bs.from_segment_ids(jnp.asarray(q_ids), jnp.asarray(kv_ids), pad_id=pad, block=block)
    assert host.static and not device.static
    np.testing.assert_array_equal(check_conservative(host, vis), check_conservative(device, vis))
    # The two paths of the classifier itself give the same kinds.
    element = ElementMask([Segments(q_ids, kv_ids, pad)], s_q, s_kv)
    on_host = classify._segments(element.terms[0], element, block, np)
    on_device = classify._segments(Segments(jnp.asarray(q_ids), jnp.asarray(kv_ids), pad),
                                   element, block, jnp)
    assert isinstance(on_host, np.ndarray)
    np.testing.assert_array_equal(on_host, np.asarray(on_device))


@pytest.mark.parametrize("dtype,q_id,kv_id", [
    (np.int32, 5, 5 + 128),              # large, congruent to 5 mod 128
    (np.int32, 5, 5 - 128),              # negative, congruent to 5
    (np.uint32, 127, 2**32 - 1),         # 2**32 - 1 is 127 mod 128
])
@pytest.mark.parametrize("device", [False, True])
def test_segment_id_collision_is_partial(dtype, q_id, kv_id, device):
    """s_q + s_kv = 128: q block 0 holds `q_id`, kv block 0 `kv_id`, congruent mod 128
    but different, so they share no id: that pair is partial (never full, never
    empty wrongly). With an in-range id in place of `kv_id` the same layout is empty."""
    block = (32, 32)
    ids = lambda a, b: np.array([[a] * 32 + [b] * 32], dtype)  # noqa: E731
    q, kv = ids(q_id, 7), ids(kv_id, 7)
    for pad in (None, 0):
        vis = segment_vis(q, kv, pad)
        assert not vis[0, 0, :32, :32].any()
        arr = (lambda x: jnp.asarray(x)) if device else (lambda x: x)  # noqa: E731
        kind = check_conservative(bs.from_segment_ids(arr(q), arr(kv), pad_id=pad, block=block),
                                  vis)
        np.testing.assert_array_equal(kind[0, 0], [[1, 0], [0, 2]])
        in_range = ids(6, 7)
        bm = bs.from_segment_ids(arr(q), arr(in_range), pad_id=pad, block=block)
        check(bm, segment_vis(q, in_range, pad))
        np.testing.assert_array_equal(np.asarray(bm.kind)[0, 0], [[0, 0], [0, 2]])


def test_segment_id_colliding_with_padding_is_empty():
    """An id congruent to pad_id (128 and 0, mod 128) still sees no padding."""
    q = np.array([[0] * 32 + [7] * 32], np.int32)
    kv = np.array([[128] * 32 + [7] * 32], np.int32)
    for ids in ((q, kv), (jnp.asarray(q), jnp.asarray(kv))):
        bm = bs.from_segment_ids(*ids, pad_id=0, block=(32, 32))
        check(bm, segment_vis(q, kv, 0))


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
