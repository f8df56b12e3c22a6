"""A mask_mod that is a documents mask (``row == column`` ANDed with per-row and
per-column booleans, the in-kernel form `hoisting` gives ``doc[b, q] == doc[b, kv]``;
without the equality, flags alone are one document: a padding mask) gets the block map of segment ids, counted per block (`block_sparse.documents`):
differential over generated mask_mods, each map against brute force, and the
recognition exactly where the form is a documents mask."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fusedattn import block_sparse as bs
from fusedattn.block_sparse import classify
from support.block_map_reference import band, check

# Factors of a generated mask_mod: (name, fn(b, i, j, a, c, k)).
# `a` is read by query rows, `c` by key columns; `k` a drawn constant.
EQUALITIES = (
    ("a[q]==c[kv]", lambda b, i, j, a, c, k: a[b, i] == c[b, j]),
    ("c[kv]==a[q]", lambda b, i, j, a, c, k: c[b, j] == a[b, i]),
    ("a[q]+k==c[kv]", lambda b, i, j, a, c, k: a[b, i] + k == c[b, j]),
    ("a[q]//2==c[kv]//2", lambda b, i, j, a, c, k: a[b, i] // 2 == c[b, j] // 2),
    ("a[q]==a[kv]", lambda b, i, j, a, c, k: a[b, i] == a[0, j]),
)
FLAGS = (
    ("a[q]!=k", lambda b, i, j, a, c, k: a[b, i] != k),
    ("c[kv]>k", lambda b, i, j, a, c, k: c[b, j] > k),
    ("a[q]>=0", lambda b, i, j, a, c, k: a[b, i] >= 0),
)
# Factors of positions alone: a documents mask keeps them as a static term.
POSITIONAL = (
    ("j<=i", lambda b, i, j, a, c, k: j <= i),
    ("i-j<k", lambda b, i, j, a, c, k: i - j < k),
    ("(i+j)%3!=k", lambda b, i, j, a, c, k: (i + j) % 3 != k),
)
# Factors that make the mask no documents mask. (A factor of the row position alone is
# no such factor when hoisting folds it into a row value with a read: ``(a[q] >= 0) &
# (i >= k)`` is one per-row boolean.)
OTHERS = (
    ("a[q]<c[kv]", lambda b, i, j, a, c, k: a[b, i] < c[b, j]),
    ("a[q]*c[kv]==k", lambda b, i, j, a, c, k: a[b, i] * c[b, j] == k),
    ("j<=i+b", lambda b, i, j, a, c, k: j <= i + b),
)


def generated(seed):
    """(name, mask_mod, whether it is a documents mask, args, sizes)."""
    rng = np.random.default_rng(seed)
    B, s_q, s_kv = int(rng.integers(1, 3)), int(rng.integers(30, 200)), int(rng.integers(30, 200))
    pick = lambda pool: pool[int(rng.integers(len(pool)))]   # noqa: E731
    factors = []
    n_eq = int(rng.choice([0, 1, 1, 1, 2]))
    factors += [pick(EQUALITIES) for _ in range(n_eq)]
    factors += [pick(FLAGS) for _ in range(int(rng.integers(0, 3)))]
    factors += [pick(POSITIONAL) for _ in range(int(rng.choice([0, 0, 1, 2])))]
    other = rng.random() < 0.25 or not factors   # (at least one factor)
    if other:
        factors.append(pick(OTHERS))
    ored = rng.random() < 0.15 and len(factors) > 1   # an OR is no AND of factors
    rng.shuffle(factors)
    ks = [int(rng.integers(0, 4)) for _ in factors]

    def mask_mod(b, h, i, j, a, c):
        parts = [f(b, i, j, a, c, k) for (_, f), k in zip(factors, ks)]
        out = parts[0]
        for p in parts[1:]:
            out = (out | p) if ored else (out & p)
        return out
    # "a[q]==a[kv]" reads a's row 0 for keys: the same array on both sides, so s_kv = s_q
    if any(n == "a[q]==a[kv]" for n, _ in factors):
        s_kv = s_q
    a = rng.integers(0, int(rng.integers(1, 6)), (B, s_q))
    c = rng.integers(0, int(rng.integers(1, 6)), (B, s_kv))
    if rng.random() < 0.5:
        a, c = np.sort(a, axis=1), np.sort(c, axis=1)
    # (with no equality, flags alone are one document: a padding mask)
    flags = any(n in dict(FLAGS) for n, _ in factors)
    docs = (n_eq == 1 or (n_eq == 0 and flags)) and not other and not ored
    name = (" | " if ored else " & ").join(n for n, _ in factors)
    return name, mask_mod, docs, (a.astype(np.int32), c.astype(np.int32)), (B, s_q, s_kv)


def _recognised(monkeypatch):
    seen = []
    inner = classify.documents

    def spy(term, element):
        got = inner(term, element)
        seen.append(got is not None)
        return got
    monkeypatch.setattr(classify, "documents", spy)
    return seen


def _brute(fn, B, s_q, s_kv, args):
    b = np.arange(B).reshape(B, 1, 1, 1)
    i, j = np.arange(s_q).reshape(1, 1, -1, 1), np.arange(s_kv).reshape(1, 1, 1, -1)
    return np.broadcast_to(np.asarray(fn(b, 0, i, j, *args)), (B, 1, s_q, s_kv))


@pytest.mark.parametrize("seed", range(60))
def test_generated_mask_mods_map_exactly_and_documents_are_counted(seed, monkeypatch):
    name, fn, docs, args, (B, s_q, s_kv) = generated(seed)
    seen = _recognised(monkeypatch)
    block = (64, 32) if seed % 2 else (32, 64)
    # ANDed with the built-in masks too: their blocks cut are evaluated pair by pair
    mask, window = [("none", None), ("causal", None), ("causal_bottom_right", None),
                    ("none", (40, 3)), ("causal", (70, 0))][seed % 5]
    bm = bs.block_map(fn, B, 1, s_q, s_kv, args=tuple(jnp.asarray(x) for x in args),
                      block=block, mask=mask, window=window)
    vis = _brute(fn, B, s_q, s_kv, args) & band(s_q, s_kv, mask, window)[None, None]
    # Ids a + k or a // 2 stay inside [0, s_q + s_kv), where counting is exact.
    check(bm, vis)
    assert any(seen) == docs, name


def test_flex_documents_mask_mod_counts_ids_with_padding(monkeypatch):
    """flex_attention's documents mask with a padding test, ids in any order."""
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 5, (2, 333)).astype(np.int32)
    ids[:, -30:] = 0

    def doc(b, h, i, j, ids):
        return (ids[b, i] == ids[b, j]) & (ids[b, i] != 0)
    seen = _recognised(monkeypatch)
    bm = bs.block_map(doc, 2, 1, 333, 333, args=(jnp.asarray(ids),))
    assert any(seen)
    check(bm, _brute(doc, 2, 333, 333, (ids,)))
    seg = bs.from_segment_ids(jnp.asarray(ids), pad_id=0)
    np.testing.assert_array_equal(np.asarray(bm.kind), np.asarray(seg.kind))


def test_documents_mask_mod_is_counted_inside_jit(monkeypatch):
    """The map of a traced id array (every training step) takes the counting path too."""
    seen = _recognised(monkeypatch)
    ids = jnp.asarray(np.repeat(np.arange(4), [40, 100, 20, 96])[None], jnp.int32)

    @jax.jit
    def kinds(ids):
        return bs.block_map(lambda b, h, i, j, d: d[b, i] == d[b, j], 1, 1, 256, 256,
                            args=(ids,), block=(64, 64)).kind
    got = kinds(ids)
    assert any(seen)
    check_ids = np.asarray(ids)
    want = bs.from_segment_ids(check_ids, pad_id=None, block=(64, 64)).kind
    np.testing.assert_array_equal(np.asarray(got), want)


def test_flags_may_vary_by_batch_where_ids_do_not():
    """Ids shared by the batch ([1, s]) with a per-batch validity: the counted map
    broadcasts every array to the batch that varies, alone and with causal."""
    rng = np.random.default_rng(5)
    ids = np.repeat(np.arange(3), [50, 70, 80])[None].astype(np.int32)     # [1, 200]
    keep = rng.random((3, 200)) < 0.8

    def doc(b, h, i, j, ids, keep):
        return (ids[0 * b, i] == ids[0 * b, j]) & keep[b, i]
    args = (jnp.asarray(ids), jnp.asarray(keep))
    for mask in ("none", "causal"):
        bm = bs.block_map(doc, 3, 1, 200, 200, args=args, block=(32, 64), mask=mask)
        vis = _brute(doc, 3, 200, 200, (ids, keep)) & band(200, 200, mask)[None, None]
        check(bm, vis)
