"""score_mods that read arrays, in the block-sparse kernels' form (`kernel_score`):
values read per row, per column, per (batch, head) or per run of diagonals (a T5
table by q_idx - kv_idx) are hoisted, the tiles run the rest, and the backward
returns the float values' gradients, which reach the args. On CPU
`block_sparse.reference` runs the same split and pullback as the kernels; each case
is checked against the float64 oracle for the output, lse, dq, dk, dv and every
float arg's gradient, under GQA, a sparse mask and a length that is not a multiple of
the block."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support.block_sparse_cases import (SCORE_VALUE_MODS, dense_visibility, doc_ids, oracle,
                                        rel_error, score_value_args)
from fusedattn import block_sparse as bs
from fusedattn import score_mods
from fusedattn.block_sparse import kernel_score
from fusedattn.block_sparse.kernel_diagonal import Diagonal, diagonal_words
from fusedattn.block_sparse.attention import (block_sparse_attention,
                                              block_sparse_attention_with_lse)
from fusedattn.block_sparse.hoisting import Unsupported

B, S, H, H_KV, D = 2, 200, 4, 2, 32
DOCS = jnp.asarray(doc_ids(B, S, [50, 90, 60]))  # [B, S] int32 ids in 1..4, unsorted
MODS = SCORE_VALUE_MODS


def _args(name):
    return score_value_args(name, DOCS, H)


def _inputs():
    keys = jax.random.split(jax.random.key(0), 4)
    return [jax.random.normal(kk, (B, S, hh, D), jnp.float32)
            for kk, hh in zip(keys, (H, H_KV, H_KV, H))]


def _same_doc_causal(b, h, i, j, *args):
    return (DOCS[b, i] == DOCS[b, j]) & (j <= i)


def _map(mask):
    if mask == "causal":
        return bs.block_map(None, 1, 1, S, S, mask="causal", block=(128, 128))
    return bs.block_map(lambda b, h, i, j, doc: (doc[b, i] == doc[b, j]) & (j <= i), B, 1, S, S,
                        args=(DOCS,), block=(128, 128))


@pytest.mark.parametrize("mask", ["causal", "documents_causal"])
@pytest.mark.parametrize("name", sorted(MODS))
def test_matches_oracle_with_arg_gradients(name, mask):
    q, k, v, do = _inputs()
    args, mod = _args(name), MODS[name]
    bm = _map(mask)
    floats = [i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating)]

    def run(q, k, v, *fargs):
        full = list(args)
        for i, a in zip(floats, fargs):
            full[i] = a
        return block_sparse_attention(q, k, v, bm, score_mod=mod, score_mod_args=tuple(full),
                                      implementation="reference")
    out, vjp = jax.vjp(run, q, k, v, *[args[i] for i in floats])
    grads = vjp(do)
    _, lse = block_sparse_attention_with_lse(q, k, v, bm, score_mod=mod, score_mod_args=args,
                                             implementation="reference")
    ref_out, ref_lse, ref_grads = oracle(q, k, v, dense_visibility(bm, B, H, S), D ** -0.5,
                                         mod, do, args=args)
    assert rel_error(out, ref_out) < 1e-4
    np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=1e-4)
    for g, r in zip(grads[:3], ref_grads[:3]):
        assert rel_error(g, r) < 1e-4
    for g, i in zip(grads[3:], floats):
        assert rel_error(g, ref_grads[3 + i]) < 1e-4, f"the gradient of arg {i}"


def test_values_are_hoisted_per_side_and_kind():
    specs = lambda args: [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]  # noqa: E731
    cases = {"document_scale": ((True,), ()), "key_bias": ((), (True,)),
             "alibi": ((True,), ()), "packed_distance": ((False,), (False,))}
    for name, floats in cases.items():
        split = kernel_score.split(MODS[name], specs(_args(name)), B, H, S, S)
        assert split.floats == floats, name
        assert split.by_position == (name != "alibi"), name
        rows, cols = split.values(_args(name))
        assert all(x.dtype == jnp.float32 and x.shape[2] == S for x in rows + cols)
    # a score_mod that reads no array has no split
    assert kernel_score.split(lambda s, b, h, i, j, t: s * 2.0, specs(_args("alibi")),
                              B, H, S, S) is None


@pytest.mark.parametrize("bidirectional", [True, False])
def test_diagonal_reads_take_one_value_per_run(bidirectional):
    """A T5 table read by q_idx - kv_idx: runs of diagonals where the bucket holds (the
    longest such, against every diagonal's bucket), one word per run and head, and the
    tile side fed those words equal to the score_mod on every pair."""
    table = jax.random.normal(jax.random.key(3), (H, 32), jnp.float32)

    def mod(s, b, h, i, j, t):
        return s + t[h, score_mods.t5_bucket(i, j, bidirectional=bidirectional)]
    s_q, s_kv = S, S - 37
    split = kernel_score.split(mod, [jax.ShapeDtypeStruct(table.shape, table.dtype)], B, H,
                               s_q, s_kv)
    runs = split.runs
    d = np.arange(-(s_kv - 1), s_q)
    bucket = np.asarray(score_mods.t5_bucket(jnp.asarray(d), 0, bidirectional=bidirectional))
    starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
    np.testing.assert_array_equal(runs.lo, np.r_[d[starts], s_q])
    assert split.floats == ((), ()) and split.d_floats == (True,) and split.by_position
    words = split.diagonal((table,))
    assert words.shape == (1, H, 1, runs.count)
    np.testing.assert_array_equal(words[0, :, 0], np.asarray(table)[:, bucket[starts]])
    q_idx, kv_idx = jnp.arange(s_q)[:, None], jnp.arange(s_kv)[None, :]
    x = jax.random.normal(jax.random.key(4), (s_q, s_kv))
    for h in range(H):
        tiles = [runs.tile(words[0, h, 0], q_idx - kv_idx)]
        got = split(x, 0, h, q_idx, kv_idx, [], [], diags=tiles)
        np.testing.assert_array_equal(np.asarray(got),
                                      np.asarray(mod(x, 0, h, q_idx, kv_idx, table)))


def test_kernel_tiles_of_diagonal_values_match_the_runs():
    """`kernel_diagonal.Diagonal` (as the kernels run it, in interpret mode) rebuilds
    each tile's values run by run: exactly the words at each pair's diagonal, for the
    forward's, dq's and the key-major dk/dv's tiles, near and far from the diagonal
    and past the sequences' ends."""
    s_q, s_kv = 300, 260
    table = jax.random.normal(jax.random.key(3), (H, 32), jnp.float32)
    ks = kernel_score.kernel_score(MODS["t5_table"], (table,), B, H, s_q, s_kv)
    runs, words = ks.fn.runs, ks.d_values
    packed = diagonal_words(ks.fn, words)
    for h in range(H):
        diag = Diagonal(packed[0, h], runs.lo, interpret=True)
        for shape, q_axis in (((64, 128), 0), ((64, 64), 0), ((64, 64), 1)):
            rows, cols = (shape[q_axis], shape[1 - q_axis])

            # (one compilation per head and tile shape: the corner traced, as in the kernels)
            @jax.jit
            def both(q0, k0, shape=shape, q_axis=q_axis, h=h, diag=diag):
                got = diag.tiles(diag.span(q0, k0, shape, q_axis))[0]
                q_idx = q0 + jax.lax.broadcasted_iota(jnp.int32, shape, q_axis)
                kv_idx = k0 + jax.lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
                return got, runs.tile(words[0, h, 0], q_idx - kv_idx)

            for q0 in range(0, 320, rows):
                for k0 in range(0, 320, cols):
                    got, want = both(jnp.int32(q0), jnp.int32(k0))
                    np.testing.assert_array_equal(np.asarray(got).view(np.int32),
                                                  np.asarray(want).view(np.int32),
                                                  err_msg=f"{shape} {q_axis} {q0} {k0}")


@pytest.mark.parametrize("mask", ["none", "window"])
def test_t5_tables_both_ways_past_the_diagonal(mask):
    """Keys after the query (the bidirectional table's other half) visible, at s_q !=
    s_kv: output, dq, dk, dv and the table's gradient against the float64 oracle."""
    s_q, s_kv = S, S + 56
    keys = jax.random.split(jax.random.key(5), 4)
    q, do = (jax.random.normal(kk, (B, s_q, H, D), jnp.float32) for kk in keys[:2])
    k, v = (jax.random.normal(kk, (B, s_kv, H_KV, D), jnp.float32) for kk in keys[2:])
    table = jax.random.normal(jax.random.key(6), (H, 32), jnp.float32)
    mod = MODS["t5_table"]
    near = None if mask == "none" else (lambda b, h, i, j: jnp.abs(i - j) < 150)
    bm = bs.block_map(near, 1, 1, s_q, s_kv, block=(128, 128))

    def run(q, k, v, t):
        return block_sparse_attention(q, k, v, bm, score_mod=mod, score_mod_args=(t,),
                                      implementation="reference")
    out, vjp = jax.vjp(run, q, k, v, table)
    grads = vjp(do)
    visible = np.broadcast_to(np.asarray(bm.element_mask(
        jnp.arange(B)[:, None, None, None], jnp.arange(H)[None, :, None, None],
        jnp.arange(s_q)[None, None, :, None], jnp.arange(s_kv)[None, None, None, :])),
        (B, H, s_q, s_kv))
    ref_out, _, ref = oracle(q, k, v, visible, D ** -0.5, mod, do, args=(table,))
    assert rel_error(out, ref_out) < 1e-4
    for g, r in zip(grads, ref):
        assert rel_error(g, r) < 1e-4


def test_integer_values_stay_exact():
    """Ids past float32's 24-bit mantissa survive: integers travel bit-cast."""
    big = jnp.full((B, S), 2 ** 26 + 1, jnp.int32).at[:, S // 2:].set(2 ** 26)
    mod = lambda s, b, h, i, j, ids: jnp.where(ids[b, i] == ids[b, j], s, s - 5.0)  # noqa: E731
    split = kernel_score.split(mod, [jax.ShapeDtypeStruct(big.shape, big.dtype)], B, H, S, S)
    rows, cols = split.values((big,))
    q_idx, kv_idx = jnp.arange(S)[:, None], jnp.arange(S)[None, :]
    got = split(jnp.zeros((S, S)), 0, 0, q_idx, kv_idx, [rows[0][0, 0][:, None]],
                [cols[0][0, 0][None, :]])
    want = jnp.where(big[0][:, None] == big[0][None, :], 0.0, -5.0)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("fn, words", [
    (lambda s, b, h, i, j, t: s + t[h, jnp.minimum(i + j, 7)],
     "depends on both q_idx and kv_idx"),
    # by q_idx - kv_idx, but changing index on every diagonal: more runs than hoisted
    (lambda s, b, h, i, j, t: s + t[h, (i - j) % 8], "runs of diagonals"),
    # q - kv mixed with something else that varies along the positions: both positions
    (lambda s, b, h, i, j, t: s + t[h, jnp.clip(i - j + jnp.arange(i.shape[2])[:, None], 0, 7)],
     "depends on both q_idx and kv_idx"),
    (lambda s, b, h, i, j, t: s + t[h, jnp.clip(i - j + jnp.asarray(
        np.arange(S * S).reshape(1, 1, S, S) % 3), 0, 7)], "depends on both q_idx and kv_idx"),
    (lambda s, b, h, i, j, t: s + t[h, jnp.clip(jnp.take_along_axis(
        jnp.broadcast_to(i - j, (1, 1, S, S)), jnp.zeros((1, 1, S, S), jnp.int32), axis=3),
        0, 7)], "depends on both q_idx and kv_idx"),
    (lambda s, b, h, i, j, t: s + t[(s > 0).astype(jnp.int32), 0], "depends on the score"),
])
def test_reads_with_no_in_kernel_form_are_refused(fn, words):
    table = jnp.ones((8, 8), jnp.float32)
    with pytest.raises(Unsupported, match=words):
        kernel_score.split(fn, [jax.ShapeDtypeStruct(table.shape, table.dtype)], B, H, S, S)
