"""Block maps from segment (document) ids against brute force: exact for ids in
[0, s_q + s_kv), and conservative (never full or empty wrongly) for ids outside it,
whose ranks may collide, on the host and on the device."""
import jax.numpy as jnp
import numpy as np
import pytest

from fusedattn import block_sparse as bs
from support.block_map_reference import band, check, check_lists, doc_ids, ref_kinds


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
    from fusedattn.block_sparse.documents import documents
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
    on_host = classify._segments(documents(element.terms[0], element), element, block, np)
    on_device = classify._segments(
        documents(Segments(jnp.asarray(q_ids), jnp.asarray(kv_ids), pad), element), element,
        block, jnp)
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
