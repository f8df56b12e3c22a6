"""Mask_mods that read arrays, in the kernels' form (`block_sparse.hoisting`): the
hoisted values plus the tile-side rest against the mask_mod itself over every
pair, for hand-written and randomly generated mask_mods, on the reference's
``[R, 1]`` / ``[1, C]`` shapes and on 2-D tiles in both orientations the kernels
use; the refusals and their reasons; block_sparse_attention end to end."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support.block_sparse_cases import doc_ids, oracle, rel_error
from fusedattn import block_sparse as bs
from fusedattn.block_sparse.attention import block_sparse_attention
from fusedattn.block_sparse.hoisting import Unsupported, hoist, reason as mask_mod_reason
from fusedattn.block_sparse.kernel_mask import kernel_mask
from fusedattn.sequence import SequenceDescriptor

B, H, S_Q, S_KV, L, T = 2, 3, 7, 5, 8, 4


def _specs(args):
    return [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in args]


def _truth(fn, args, b=B, h=H, s_q=S_Q, s_kv=S_KV):
    idx = (jnp.arange(b)[:, None, None, None], jnp.arange(h)[None, :, None, None],
           jnp.arange(s_q)[None, None, :, None], jnp.arange(s_kv)[None, None, None, :])
    return np.broadcast_to(np.asarray(fn(*idx, *args)), (b, h, s_q, s_kv))


def _kernel_side(split, rows, cols, layout, b=B, h=H, s_q=S_Q, s_kv=S_KV):
    """[b, h, s_q, s_kv] from the split's tile function; b, h are scalars inside.
    layout "ref": q [R, 1], kv [1, C]; "tile": q rows of a 2-D tile (forward
    kernels); "tile_t": q along the columns (the dk/dv kernel's key-major tile)."""
    def pick(x, bb):
        return x[bb] if x.shape[0] > 1 else x[0]

    def one(bb, hh):
        r = [pick(x, bb) for x in rows]
        c = [pick(x, bb) for x in cols]
        if layout == "ref":
            q, kv = jnp.arange(s_q)[:, None], jnp.arange(s_kv)[None, :]
            return split(bb, hh, q, kv, [x[:, None] for x in r], [x[None, :] for x in c])
        shape = (s_q, s_kv) if layout == "tile" else (s_kv, s_q)
        qa, ka = (0, 1) if layout == "tile" else (1, 0)
        q = jax.lax.broadcasted_iota(jnp.int32, shape, qa)
        kv = jax.lax.broadcasted_iota(jnp.int32, shape, ka)
        tile = lambda x, axis: jax.lax.broadcast_in_dim(x, shape, (axis,))  # noqa: E731
        out = split(bb, hh, q, kv, [tile(x, qa) for x in r], [tile(x, ka) for x in c])
        return out if layout == "tile" else out.T
    return np.asarray(jax.vmap(jax.vmap(one, (None, 0)), (0, None))(jnp.arange(b), jnp.arange(h)))


def _check(fn, args, b=B, h=H, s_q=S_Q, s_kv=S_KV, layouts=("ref", "tile", "tile_t")):
    split = hoist(fn, _specs(args), b, h, s_q, s_kv)
    rows, cols = split.values(args)
    for x, n in [(x, s_q) for x in rows] + [(x, s_kv) for x in cols]:
        assert x.dtype == jnp.int32 and x.ndim == 2 and x.shape[0] in (1, b) and x.shape[1] == n
    want = _truth(fn, args, b, h, s_q, s_kv)
    for layout in layouts:
        got = _kernel_side(split, rows, cols, layout, b, h, s_q, s_kv)
        np.testing.assert_array_equal(got, want, err_msg=layout)
    assert mask_mod_reason(fn, _specs(args), b, h, s_q, s_kv) is None
    return split


# ---- hand cases --------------------------------------------------------------------
_rng = np.random.default_rng(0)
DOC = jnp.asarray(_rng.integers(0, 3, (B, L)), jnp.int32)
N = jnp.asarray([2, 4], jnp.int32)
TBL = jnp.asarray(_rng.integers(0, 3, (T,)), jnp.int32)
FLAG = jnp.asarray(_rng.random((B, L)) < 0.5)
BIG = jnp.asarray(_rng.integers(2 ** 31 - 2, 2 ** 31 + 2, (B, L)), jnp.uint32)
SMALL = jnp.asarray(_rng.integers(-3, 3, (B, L)), jnp.int8)
CONST = np.arange(L, dtype=np.int32) % 3

HAND = {
    "documents": (lambda b, h, q, kv, doc: doc[b, q] == doc[b, kv], (DOC,), (1, 1)),
    "prefix_per_batch": (lambda b, h, q, kv, n: (kv <= q) | (kv < n[b]), (N,), None),
    "document_causal": (lambda b, h, q, kv, doc, start: (doc[b, q] == doc[b, kv]) & (kv <= q),
                        (DOC, N), (1, 1)),
    "table_of_position": (lambda b, h, q, kv, t: t[q // 2] >= kv // 2, (TBL,), (1, 0)),
    "bool_flags": (lambda b, h, q, kv, f: f[b, q] & ~f[b, kv], (FLAG,), (1, 1)),
    "uint32_wraps": (lambda b, h, q, kv, x: x[b, q] > x[b, kv], (BIG,), (1, 1)),
    "int8": (lambda b, h, q, kv, x: x[b, q] + x[b, kv] > 0, (SMALL,), (1, 1)),
    "int8_wraps": (lambda b, h, q, kv, x: x[b, q] * 50 + x[b, kv] * 45 > 0, (SMALL,), (1, 1)),
    "uint8_wraps": (lambda b, h, q, kv, x: (x[b, q] - x[b, kv]) // 2 < ~x[b, kv],
                    (SMALL.astype(jnp.uint8),), (1, 2)),
    "int8_cast": (lambda b, h, q, kv, doc: doc[b, q].astype(jnp.int8) * 100 + kv < 50,
                  (DOC,), (1, 0)),
    "float_after_read": (lambda b, h, q, kv, doc: doc[b, q].astype(jnp.float32) * 0.5 < kv,
                         (DOC,), (1, 0)),
    "head_after_read": (lambda b, h, q, kv, doc: doc[b, q] + h == doc[b, kv], (DOC,), (1, 1)),
    "nested_read": (lambda b, h, q, kv, doc, t: doc[b, t[q % T] + 1] == doc[b, kv % 3],
                    (DOC, TBL), (1, 1)),
    "scalar_arg": (lambda b, h, q, kv, w: q - kv < w, (jnp.int32(2),), None),
    "closed_over_array": (lambda b, h, q, kv, doc: (doc[b, q] == doc[b, kv])
                          & (jnp.asarray(CONST)[q] <= 1), (DOC,), None),
    "row_only": (lambda b, h, q, kv, doc: doc[b, q] > 0, (DOC,), (1, 0)),
    "where": (lambda b, h, q, kv, doc: jnp.where(doc[b, q] > 0, kv <= q, doc[b, kv] == 2),
              (DOC,), None),
    # calls the walker inlines: jit, and jax.checkpoint (a remat2 equation)
    "under_jit": (jax.jit(lambda b, h, q, kv, doc: doc[b, q] == doc[b, kv]), (DOC,), (1, 1)),
    "under_checkpoint": (jax.checkpoint(lambda b, h, q, kv, doc: doc[b, q] == doc[b, kv]),
                         (DOC,), (1, 1)),
}


@pytest.mark.parametrize("name", HAND)
def test_hand_cases_match_the_mask_mod(name):
    fn, args, counts = HAND[name]
    split = _check(fn, args)
    if counts is not None:
        assert (split.n_rows, split.n_cols) == counts


def test_lengths_and_batch_of_one():
    fn, args, _ = HAND["document_causal"]
    _check(fn, (DOC[:1], N), b=1, h=1, s_q=L, s_kv=3)


# ---- refusals ----------------------------------------------------------------------
REFUSED = {
    "both": (lambda b, h, q, kv, m: m[b, h, q, kv],
             (jnp.zeros((B, H, S_Q, S_KV), bool),), "both q_idx and kv_idx"),
    "both_sum": (lambda b, h, q, kv, doc: doc[b, (q + kv) % L] > 0, (DOC,),
                 "both q_idx and kv_idx"),
    "float": (lambda b, h, q, kv, f: f[b, q] < f[b, kv], (jnp.zeros((B, L)),), "float32"),
    "head": (lambda b, h, q, kv, t: t[h, q] == t[h, kv], (jnp.zeros((H, L), jnp.int32),),
             "head index"),
    "head_only": (lambda b, h, q, kv, t: kv < t[h], (jnp.zeros((H,), jnp.int32),),
                  "head index"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_refusals_name_the_rule(name):
    fn, args, why = REFUSED[name]
    with pytest.raises(Unsupported, match=why):
        hoist(fn, _specs(args), B, H, S_Q, S_KV)
    reason = mask_mod_reason(fn, _specs(args), B, H, S_Q, S_KV)
    assert isinstance(reason, str) and why in reason and "reads arrays" in reason


def test_kernel_mask_refuses_through_the_map():
    fn, args, _ = REFUSED["both_sum"]
    bm = bs.block_map(fn, B, 1, S_Q, S_KV, args=args)
    with pytest.raises(Unsupported, match="both q_idx and kv_idx"):
        kernel_mask(bm.element)


def test_positions_only_has_no_reason():
    assert mask_mod_reason(lambda b, h, q, kv: kv <= q, [], B, H, S_Q, S_KV) is None


# ---- random mask_mods --------------------------------------------------------------
def _index(rng, side, nested=True):
    """An index into [0, L) from one position: f(q) or f(kv), maybe through a table."""
    f = rng.integers(6 if nested else 5)
    pos = lambda e: e[side]  # noqa: E731
    if f == 0:
        return pos
    if f == 1:
        return lambda e: pos(e) // 2
    if f == 2:
        c = int(rng.integers(1, L))
        return lambda e: (pos(e) + c) % L
    if f == 3:
        return lambda e: L - 1 - pos(e)
    if f == 4:
        c = int(rng.integers(0, L))
        return lambda e: jnp.minimum(pos(e), c)
    inner = _index(rng, side, nested=False)
    return lambda e: e["tbl"][inner(e) % T]


def _int_expr(rng, depth):
    k = rng.integers(9 if depth > 0 else 6)
    if k == 0:
        side = ("q", "kv")[rng.integers(2)]
        arr, idx = ("doc", "small")[rng.integers(2)], _index(rng, side)
        if arr == "small" and rng.integers(2):  # 8-bit arithmetic, wrapping
            other, c = _index(rng, ("q", "kv")[rng.integers(2)]), int(rng.integers(20, 60))
            return lambda e: (e["small"][e["b"], idx(e)] * c
                              - e["small"][e["b"], other(e)]).astype(jnp.int32)
        return lambda e: e[arr][e["b"], idx(e)].astype(jnp.int32)
    if k == 1:
        return lambda e: e["n"][e["b"]]
    if k == 2:
        name = ("q", "kv", "b", "h")[rng.integers(4)]
        return lambda e: e[name]
    if k == 3:
        c = int(rng.integers(-3, 6))
        return lambda e: jnp.int32(c)
    if k == 4:
        idx = _index(rng, ("q", "kv")[rng.integers(2)])
        return lambda e: e["tbl"][idx(e) % T]
    if k == 5:
        c = int(rng.integers(0, T))
        return lambda e: e["tbl"][c]
    x, y = _int_expr(rng, depth - 1), _int_expr(rng, depth - 1)
    if k == 6:
        op = (jnp.add, jnp.subtract, jnp.maximum, jnp.minimum)[rng.integers(4)]
        return lambda e: op(x(e), y(e))
    if k == 7:
        c = int(rng.integers(1, 4))
        unary = (lambda v: v // c, lambda v: v % c, lambda v: v * c, jnp.abs,
                 lambda v: (v.astype(jnp.float32) * 0.5).astype(jnp.int32))[rng.integers(5)]
        return lambda e: unary(x(e))
    cond = _bool_expr(rng, depth - 1)
    return lambda e: jnp.where(cond(e), x(e), y(e))


def _bool_expr(rng, depth):
    k = rng.integers(5 if depth > 0 else 2)
    if k == 0:
        idx = _index(rng, ("q", "kv")[rng.integers(2)])
        return lambda e: e["flag"][e["b"], idx(e)]
    if k == 1:
        x, y = _int_expr(rng, depth), _int_expr(rng, depth)
        op = (jnp.equal, jnp.not_equal, jnp.less, jnp.less_equal)[rng.integers(4)]
        return lambda e: op(x(e), y(e))
    if k == 2:
        x = _bool_expr(rng, depth - 1)
        return lambda e: ~x(e)
    x, y = _bool_expr(rng, depth - 1), _bool_expr(rng, depth - 1)
    return (lambda e: x(e) & y(e)) if k == 3 else (lambda e: x(e) | y(e))


def _program(seed):
    rng = np.random.default_rng(seed)
    body = _bool_expr(rng, int(rng.integers(1, 3)))
    row = _int_expr(rng, 0)
    # at least one array read on each side, so every program hoists something
    read = lambda e: e["doc"][e["b"], e["q"]] != e["doc"][e["b"], e["kv"] % L]  # noqa: E731
    top = (lambda e: body(e) | read(e)) if rng.integers(2) else (lambda e: body(e) & ~read(e))
    if rng.integers(2):
        top_inner = top
        top = lambda e: top_inner(e) ^ (row(e) > 1)  # noqa: E731

    def fn(b, h, q, kv, doc, small, flag, n, tbl):
        return top(dict(b=b, h=h, q=q, kv=kv, doc=doc, small=small, flag=flag, n=n, tbl=tbl))
    args = (DOC, SMALL, FLAG, N, TBL % L)
    return fn, args


@pytest.mark.parametrize("first", range(0, 240, 60))
def test_random_mask_mods_match(first):
    for seed in range(first, first + 60):
        fn, args = _program(seed)
        try:
            _check(fn, args, layouts=(("ref", "tile", "tile_t")[seed % 3],))
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from None


def test_random_reads_at_both_positions_are_refused():
    for seed in range(40):
        fn, args = _program(seed)

        def mixed(b, h, q, kv, *a, fn=fn):
            return fn(b, h, q, kv, *a) & (a[0][b, (q * kv) % L] > 0)
        with pytest.raises(Unsupported, match="both q_idx and kv_idx"):
            hoist(mixed, _specs(args), B, H, S_Q, S_KV)


# ---- kernel_mask and attention ------------------------------------------------------
def _kernel_mask_matches_element(bm, b, h, s_q, s_kv):
    km = kernel_mask(bm.element)
    q, kv = jnp.arange(s_q)[:, None], jnp.arange(s_kv)[None, :]

    def vals(arrays, bb, axis):
        return [] if arrays is None else \
            list(jnp.expand_dims(arrays[min(bb, arrays.shape[0] - 1)], axis))
    for bb in range(b):
        qv, kvv = vals(km.q_arrays, bb, 2), vals(km.kv_arrays, bb, 1)
        for hh in range(h):
            got = np.asarray(km.fn(jnp.int32(bb), jnp.int32(hh), q, kv, qv, kvv, None))
            want = np.asarray(bm.element_mask(jnp.int32(bb), jnp.int32(hh), q, kv))
            np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want)


def test_kernel_mask_with_packed_positions():
    ids = np.array([[1] * 100 + [2] * 100 + [3] * 56, [1] * 256])
    seq = SequenceDescriptor.from_segment_ids(ids, max_segments=3)
    width = jnp.asarray([10, 40], jnp.int32)
    bm = bs.block_map(lambda b, h, i, j, w: (j <= i) & (i - j < w[b]), 2, 1, 256, 256,
                      args=(width,), sequence=seq)
    _kernel_mask_matches_element(bm, 2, 1, 256, 256)


def _documents_with_prefix(b, h, q, kv, doc, n):
    return (doc[b, q] == doc[b, kv]) & ((kv <= q) | (kv < n[b]))


@pytest.mark.parametrize("s", [256, 300])
def test_documents_attention_matches_oracle(s):
    b, h, d = 2, 2, 32
    doc = jnp.asarray(doc_ids(b, s, [s // 8, s // 4, s // 8 + 40]))
    n = jnp.asarray([s // 3, 0], jnp.int32)
    q, k, v, do = (jax.random.normal(key, (b, s, h, d))
                   for key in jax.random.split(jax.random.key(s), 4))

    @jax.jit
    def run(q, k, v, doc, n):  # the map built from traced arrays
        bm = bs.block_map(_documents_with_prefix, b, h, s, s, args=(doc, n))
        out, vjp = jax.vjp(lambda q, k, v: block_sparse_attention(
            q, k, v, bm, implementation="reference"), q, k, v)
        return out, vjp(do)

    out, grads = run(q, k, v, doc, n)
    ids, i, j = np.asarray(doc), np.arange(s)[:, None], np.arange(s)[None, :]
    vis = (ids[:, :, None] == ids[:, None, :]) & ((j <= i) | (j < np.asarray(n)[:, None, None]))
    ref_out, _, ref_grads = oracle(q, k, v, np.broadcast_to(vis[:, None], (b, h, s, s)),
                                   d ** -0.5, None, do)
    assert rel_error(out, ref_out) < 1e-4
    for g, r in zip(grads, ref_grads):
        assert rel_error(g, r) < 1e-4
