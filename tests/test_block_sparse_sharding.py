"""block_sparse under batch and head splits, on 8 host devices (tests/conftest.py).

The backend's kernels go through native_op's partitioning rule, as the FFI backends'
do: each device runs its shard and builds its shard's block map; a mask_mod reads the
call's batch rows. On CPU the Hopper check is patched to pass and the kernels run as
the reference list walks (as in test_block_sparse_dispatch.py), so the partitioned
step compiles and runs for real. Checked for a static mask_mod (a sliding window with a
global key), a documents mask_mod reading a whole [B, S] id array by b (every row
different, so a shard reading its own rows 0.. fails) and a dense boolean mask through
the jax.nn drop-in: the sharded step's only collective is the loss's scalar all-reduce, and the
output and the q, k, v gradients equal the unsharded step's and the float64 oracle's.
Also: score_mods reading learned tables (the tables' gradients from the backward step,
summed over the shards) or the batch / head index (the call's numbers on a shard), the
refusal of one with no in-kernel form on a shard, and padding lengths split with the
batch.
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fusedattn
from support import oracle
from support import sharding_cases as sc
from support.sharding_cases import partitioner  # noqa: F401 (a fixture)
from support.block_sparse_cases import block_map, doc_ids, rel_error
from support.block_sparse_cases import oracle as bs_oracle
from fusedattn.block_sparse import mosaic_ops
from fusedattn.block_sparse.attention import (block_sparse_attention,
                                              block_sparse_attention_backward,
                                              block_sparse_attention_with_lse)

B, S, H, H_KV, D = 4, 256, 4, 2, 64
TOL_SAME = 1e-2  # bf16: a head shard rounds dk, dv differently (out, dq are equal)
TOL_OUT, TOL_GRAD = 2e-2, 4e-2  # bf16 against float64 (test_block_sparse_dispatch's)

# name: (mesh shape, axis names, spec of q, k, v, spec of a [B, 1, S, S] mask)
SPLITS = {
    "batch": ((2,), ("dp",), P("dp"), P("dp")),
    "heads": ((2,), ("tp",), P(None, None, "tp"), P()),
    "batch-heads": ((2, 2), ("dp", "tp"), P("dp", None, "tp"), P("dp")),
}


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def _qkvo():
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = ((B, S, H, D), (B, S, H_KV, D), (B, S, H_KV, D), (B, S, H, D))
    return [jax.random.normal(kk, shape, jnp.bfloat16) for kk, shape in zip(keys, shapes)]


def _docs():
    """[B, S] document ids, each row cut differently."""
    rows = [doc_ids(1, S, [S // 8 + 16 * r, S // 4, 40 + 8 * r])[0] for r in range(B)]
    return jnp.asarray(np.stack(rows))


def window(b, h, i, j):
    # with a global first key: a window alone is a built-in mask, which auto runs as one
    return ((j <= i) & (i - j < 64)) | (j == 0)


def same_doc(b, h, i, j, doc):
    return doc[b, i] == doc[b, j]


def _case(name):
    """(call, extra arrays, their specs given the mask's spec, visible [B|1, 1, S, S])."""
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    if name == "window":
        call = lambda q, k, v: fusedattn.fused_attn(q, k, v, mask_mod=window)  # noqa: E731
        return call, [], lambda spec: [], window(0, 0, i, j)[None, None]
    doc = _docs()
    visible = np.asarray(doc[:, None, :, None] == doc[:, None, None, :])
    assert not np.array_equal(visible[0], visible[2]), "rows must differ"
    if name == "documents":
        call = lambda q, k, v, doc: fusedattn.fused_attn(  # noqa: E731
            q, k, v, mask_mod=same_doc, score_mod_args=(doc,))
        return call, [doc], lambda spec: [None], visible    # (the ids stay whole)
    call = lambda q, k, v, m: fusedattn.dot_product_attention(q, k, v, mask=m)  # noqa: E731
    return call, [jnp.asarray(visible)], lambda spec: [spec], visible


def _oracle(q, k, v, do, visible):
    ref = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)),
                           bias=np.where(visible, 0.0, -np.inf), d_out=np.asarray(do, np.float64))
    return ref.out, ref.dq, ref.dk, ref.dv


@functools.lru_cache(maxsize=None)
def _unsharded(mask):
    """(the unsharded step's results, the float64 oracle's out, dq, dk, dv) of a mask's
    call: every split of it compares with the same, so they are computed once per mask
    (by the first test that asks, under hopper_reference as every caller is)."""
    q, k, v, do = _qkvo()
    call, extra, _, visible = _case(mask)
    return sc.run_single(call, [q, k, v, *extra], do), _oracle(q, k, v, do, visible)


def _only_the_loss_reduces(text):
    """The sharded step moves no q / k / v: its only collective is the scalar loss's
    all-reduce (a gather written as an all-reduce of a padded array shows its shape)."""
    counts = sc.collectives(text)
    assert counts["all-gather"] == counts["all-to-all"] == counts["collective-permute"] \
        == counts["reduce-scatter"] == 0, counts
    assert set(sc.all_reduce_shapes(text)) <= {"f32[]"}, sc.all_reduce_shapes(text)


@pytest.mark.parametrize("mask", ["window", "documents", "dense"])
@pytest.mark.parametrize("split", sorted(SPLITS))
def test_a_split_runs_per_shard(hopper_reference, split, mask):
    _check_split(split, mask, jax.sharding.AxisType.Auto)


@pytest.mark.parametrize("mask", ["documents", "dense"])
@pytest.mark.parametrize("split", ["batch", "heads"])
def test_explicit_mesh_axes(hopper_reference, split, mask):
    """Sharding in types (Explicit axes, JAX's default mesh): the map's and the list
    walks' gathers run with the axes Auto, the results typed as their arrays."""
    _check_split(split, mask, jax.sharding.AxisType.Explicit)


def _check_split(split, mask, axis_type):
    mesh_shape, names, spec, mask_spec = SPLITS[split]
    mesh = jax.make_mesh(mesh_shape, names, axis_types=(axis_type,) * len(names))
    q, k, v, do = _qkvo()
    call, extra, extra_specs, _ = _case(mask)
    shardings = [NamedSharding(mesh, spec)] * 3 + [
        None if s is None else NamedSharding(mesh, s) for s in extra_specs(mask_spec)]
    single, ref = _unsharded(mask)
    single, sharded, _, text = sc.run(call, [q, k, v, *extra], shardings, do, single=single)
    _only_the_loss_reduces(text)
    sc.assert_same(single, sharded, TOL_SAME)
    (_, out), grads = sharded
    for name, got, want, tol in zip(("out", "dq", "dk", "dv"), (out, *grads), ref,
                                    (TOL_OUT, TOL_GRAD, TOL_GRAD, TOL_GRAD)):
        err = rel_error(got, want)
        assert err < tol, (name, err)


@pytest.mark.parametrize("split", ["batch", "heads"])
def test_sequence_first_arrays_split_too(hopper_reference, split):
    """sbhd q, k, v (read in place by the kernels) split over batch (their axis 1) or
    heads: each device runs its shard, and the results equal the bshd step's."""
    mesh_shape, names, _, _ = SPLITS[split]
    spec = P(None, "dp") if split == "batch" else P(None, None, "tp")
    q, k, v, do = _qkvo()
    sw = lambda x: jnp.swapaxes(x, 0, 1)  # noqa: E731
    call = lambda q, k, v, doc: fusedattn.fused_attn(  # noqa: E731
        q, k, v, mask_mod=same_doc, score_mod_args=(doc,), layout="sbhd")
    args = [sw(q), sw(k), sw(v), _docs()]
    single, sharded, _, text = sc.run(call, args, [NamedSharding(_mesh(mesh_shape, names),
                                                                 spec)] * 3 + [None], sw(do))
    _only_the_loss_reduces(text)
    sc.assert_same(single, sharded, TOL_SAME)
    (_, out), grads = sharded
    bshd, _ = _unsharded("documents")
    sc.assert_same(bshd, ((None, np.swapaxes(out, 0, 1)),
                          [np.swapaxes(g, 0, 1) for g in grads]), TOL_SAME)


def test_both_partitioners_split_the_documents_mask(hopper_reference, partitioner):
    """Shardy's rule and the GSPMD callbacks alike (the mask_mod reading global rows)."""
    mesh_shape, names, spec, _ = SPLITS["batch-heads"]
    mesh = _mesh(mesh_shape, names)
    q, k, v, do = _qkvo()
    call, extra, _, _ = _case("documents")
    single, sharded, _, text = sc.run(call, [q, k, v, *extra],
                                      [NamedSharding(mesh, spec)] * 3 + [None], do,
                                      single=_unsharded("documents")[0])
    _only_the_loss_reduces(text)
    sc.assert_same(single, sharded, TOL_SAME)


def test_the_log_sum_exp_is_split_too(hopper_reference):
    """The drop-in's return_residual (the backend's attention_with_lse): out and lse
    [B, T, N] per shard, nothing moved."""
    mesh_shape, names, spec, mask_spec = SPLITS["batch-heads"]
    mesh = _mesh(mesh_shape, names)
    q, k, v, _ = _qkvo()
    mask = jnp.asarray(_case("dense")[3])
    f = jax.jit(lambda q, k, v, m: fusedattn.dot_product_attention(q, k, v, mask=m,
                                                                   return_residual=True))
    placed = [jax.device_put(x, NamedSharding(mesh, s))
              for x, s in ((q, spec), (k, spec), (v, spec), (mask, mask_spec))]
    compiled = f.lower(*placed).compile()
    assert sum(sc.collectives(compiled.as_text()).values()) == 0
    (out, lse), (out_ref, lse_ref) = compiled(*placed), f(q, k, v, mask)
    assert lse.sharding.spec == P("dp", None, "tp")
    assert rel_error(np.asarray(out, np.float32), np.asarray(out_ref, np.float32)) < TOL_SAME
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-5, atol=1e-5)


def test_the_call_carries_the_rule(hopper_reference):
    """Lowered, the block_sparse call sits in custom_partitioning ops with the Shardy rule
    (the training forward and the backward)."""
    mesh = _mesh((2,), ("dp",))
    q, k, v, _ = (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("dp")))
                  for x in _qkvo())

    def loss(q, k, v):
        return fusedattn.fused_attn(q, k, v, mask_mod=window).astype(jnp.float32).sum()
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower().as_text()
    assert text.count("CustomSPMDPartitioning") == 2
    assert text.count("sdy.sharding_rule") >= 2


def test_explain_states_the_split(hopper_reference):
    """The plan as the FFI backends' (partitioning.describe), and the document ids
    sharded with the batch named as gathered: the rule keeps score_mod_args whole."""
    mesh = _mesh((2, 2), ("dp", "tp"))
    sds = lambda shape, spec, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dtype, sharding=NamedSharding(mesh, spec))
    q, kv = sds((B, S, H, D), P("dp", None, "tp")), sds((B, S, H_KV, D), P("dp", None, "tp"))
    plan = fusedattn.explain(q, kv, kv, mask_mod=same_doc, score_mod_args=(_docs(),))
    text = str(plan)
    assert plan.chosen == "block_sparse", text
    assert "batch split over ('dp',), heads over ('tp',); each device runs b2 h2/1" in text
    assert "collectives: none in the forward; none in the backward" in text
    assert "gathered" not in text
    ids = sds((B, S), P("dp"), jnp.int32)
    text = str(fusedattn.explain(q, kv, kv, mask_mod=same_doc, score_mod_args=(ids,)))
    assert "gathered: score_mod_args[0]: head dim / other split over ('dp',) is gathered " \
           "(the call reads it whole)" in text, text


def doc_scale(s, b, h, i, j, doc, scale):
    """A learned per-document scale, read by the batch row (test_block_sparse_dispatch's)."""
    return s * scale[doc[b, i]]


def same_doc_of_two(b, h, i, j, doc, _table):
    return doc[b, i] == doc[b, j]


def alibi(s, b, h, i, j, doc, slope):
    """Learned per-head slopes (the doc ids unread)."""
    return s + slope[h] * (j - i).astype(s.dtype)


# name: (score_mod, mask_mod, builtin mask, table, [B|1, 1, S, S] visible of the ids)
TABLE_CASES = {
    "doc_scale+documents": (doc_scale, same_doc_of_two, "causal",
                            lambda n: jnp.linspace(0.5, 1.5, n, dtype=jnp.float32)),
    "doc_scale+causal": (doc_scale, None, "causal",
                         lambda n: jnp.linspace(0.5, 1.5, n, dtype=jnp.float32)),
    "alibi+documents": (alibi, same_doc_of_two, "none",
                        lambda n: jnp.linspace(0.01, 0.05, H, dtype=jnp.float32)),
}


AUTO, EXPLICIT = jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit


def _table_call(case):
    """(the call of a TABLE_CASES case, its options, its arguments q, k, v, table, doc,
    the output's cotangent)."""
    q, k, v, do = _qkvo()
    doc = _docs()
    score_mod, mask_mod, mask, make_table = TABLE_CASES[case]
    options = dict(score_mod=score_mod, mask_mod=mask_mod, mask=mask)

    def call(q, k, v, table, doc):
        return fusedattn.fused_attn(q, k, v, score_mod_args=(doc, table), **options)
    return call, options, [q, k, v, make_table(int(doc.max()) + 1), doc], do


@functools.lru_cache(maxsize=None)
def _table_unsharded(case):
    """(the unsharded step's results, the float64 oracle's out, dq, dk, dv and table
    gradient) of a TABLE_CASES case: once per case, as `_unsharded`."""
    call, options, (q, k, v, table, doc), do = _table_call(case)
    mask, mask_mod = options["mask"], options["mask_mod"]
    same = np.asarray(doc[:, None, :, None] == doc[:, None, None, :])
    visible = (np.tril(np.ones((S, S), bool)) if mask == "causal" else True) & \
        (same if mask_mod is not None else True)
    ref_out, _, ref = bs_oracle(q, k, v, np.broadcast_to(visible, (B, H, S, S)), D ** -0.5,
                                options["score_mod"], do, args=(doc, table))
    single = sc.run_single(call, [q, k, v, table, doc], do, n_diff=4)
    return single, (ref_out, *ref[:3], ref[4])


@pytest.mark.parametrize("split,case,axis_type", [("batch", "doc_scale+documents", AUTO),
                                                  ("batch", "doc_scale+causal", AUTO),
                                                  ("heads", "alibi+documents", AUTO),
                                                  ("batch-heads", "doc_scale+documents", AUTO),
                                                  ("batch", "doc_scale+documents", EXPLICIT)])
def test_a_learned_table_under_a_split(hopper_reference, split, case, axis_type):
    """A score_mod reading a learned table (a per-document scale read through the [B, S]
    ids by b, or per-head slopes read by h) on shards: the kernels' reads are hoisted from
    the call's row and head numbers, and the backward step returns the table's gradient
    from the kernels' value gradients (each shard's partial sum, all-reduced: the only
    collective besides the loss's, of the table's size). Output, dq/dk/dv and the table's
    gradient equal the unsharded step's and the float64 oracle's (Explicit axes too)."""
    mesh_shape, names, spec, _ = SPLITS[split]
    mesh = jax.make_mesh(mesh_shape, names, axis_types=(axis_type,) * len(names))
    call, options, (q, k, v, table, doc), do = _table_call(case)
    sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype,  # noqa: E731
                                            sharding=NamedSharding(mesh, s))
    plan = fusedattn.explain(*(sds(x, spec) for x in (q, k, v)),
                             score_mod_args=(sds(doc, P()), sds(table, P())), **options)
    assert plan.chosen == "block_sparse"
    assert "all-reduce of the float score_mod_args' gradients" in str(plan), str(plan)
    single, ref = _table_unsharded(case)
    single, sharded, _, text = sc.run(call, [q, k, v, table, doc],
                                      [NamedSharding(mesh, spec)] * 3 + [None, None], do,
                                      n_diff=4, single=single)
    counts = sc.collectives(text)
    assert counts["all-gather"] == counts["all-to-all"] == counts["collective-permute"] \
        == counts["reduce-scatter"] == 0, counts
    reduced = {re.sub(r"\{.*?\}", "", shape) for t in sc.all_reduce_shapes(text)
               for shape in t.strip("()").split(", ")}  # (XLA may combine the two)
    assert reduced <= {"f32[]", f"f32[{table.shape[0]}]"}, sc.all_reduce_shapes(text)
    sc.assert_same(single, sharded, TOL_SAME)
    (_, out), grads = sharded
    for name, got, want, tol in zip(("out", "dq", "dk", "dv", "table"), (out, *grads), ref,
                                    (TOL_OUT,) + (TOL_GRAD,) * 4):
        err = rel_error(got, want)
        assert err < tol, (name, err)


def test_a_score_mod_reading_b_and_h_sees_the_calls_numbers(hopper_reference):
    """On a shard the kernels' own b and h are the shard's: a score_mod reading them
    gets the call's (the shard's first row and head are args, so the values are hoisted
    from them), not wrong numbers."""
    mesh_shape, names, spec, _ = SPLITS["batch-heads"]
    mesh = _mesh(mesh_shape, names)
    q, k, v, do = _qkvo()
    by_numbers = lambda s, b, h, i, j: s + 0.3 * h - 0.2 * b  # noqa: E731
    call = lambda q, k, v: fusedattn.fused_attn(  # noqa: E731
        q, k, v, mask_mod=window, score_mod=by_numbers)
    assert fusedattn.explain(q, k, v, mask_mod=window,
                             score_mod=by_numbers).chosen == "block_sparse"
    single, sharded, _, text = sc.run(call, [q, k, v], [NamedSharding(mesh, spec)] * 3, do)
    _only_the_loss_reduces(text)
    sc.assert_same(single, sharded, TOL_SAME)
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    ref_out, _, ref = bs_oracle(q, k, v, np.broadcast_to(window(0, 0, i, j), (B, H, S, S)),
                                D ** -0.5, by_numbers, do)
    (_, out), grads = sharded
    for name, got, want, tol in zip(("out", "dq", "dk", "dv"), (out, *grads),
                                    (ref_out, *ref[:3]), (TOL_OUT,) + (TOL_GRAD,) * 3):
        assert rel_error(got, want) < tol, (name, rel_error(got, want))


def test_a_score_mod_without_a_shard_form_is_refused(hopper_reference, monkeypatch):
    """A score_mod whose read of the head meets both positions in an operation the
    kernels run only undifferentiated (a float fmod, whose derivative needs floor, from
    round: here taken out of the lowering) runs unsplit as it is, but on a head shard its
    h must come from the shard's start: no in-kernel form, and the error says so (not
    wrong numbers)."""
    registry = mosaic_ops.lowered()
    if registry is None:
        pytest.fail("this JAX's Mosaic GPU lowering registry cannot be read")
    monkeypatch.setattr(mosaic_ops, "lowered", lambda: registry - {"round"})
    mesh = _mesh((2,), ("tp",))
    q, k, v, _ = _qkvo()
    wavy = lambda s, b, h, i, j: s + jnp.fmod(0.1 * h * (i - j).astype(s.dtype), 3.0)  # noqa: E731

    def f(q, k, v):
        return fusedattn.fused_attn(q, k, v, mask_mod=window, score_mod=wavy)
    assert fusedattn.explain(q, k, v, mask_mod=window, score_mod=wavy).chosen == "block_sparse"
    placed = [jax.device_put(x, NamedSharding(mesh, P(None, None, "tp"))) for x in (q, k, v)]
    with pytest.raises(jax.errors.JaxRuntimeError, match="on a shard of a batch / head split"):
        jax.jit(f).lower(*placed).compile()


@pytest.mark.parametrize("family,s", [("sliding_window", 300), ("random_dense", 256)])
def test_the_backward_step_equals_the_vjp(family, s):
    """The partitioned backward step's kernels (`block_sparse_attention_backward`, from
    the forward's out and natural lse) give the custom_vjp's gradients: a length past a
    block boundary (padded rows) and rows with no visible key (lse -inf) included."""
    keys = jax.random.split(jax.random.key(2), 4)
    q, k, v, do = (jax.random.normal(kk, (2, s, h, 32)) for kk, h in zip(keys, (H, H_KV, H_KV, H)))
    bm = block_map(family, 2, H, s)
    out, lse = block_sparse_attention_with_lse(q, k, v, bm, implementation="reference")
    if family == "random_dense":
        assert np.isneginf(np.asarray(lse)).any()
    _, vjp = jax.vjp(lambda q, k, v: block_sparse_attention(
        q, k, v, bm, implementation="reference"), q, k, v)
    steps = block_sparse_attention_backward(q, k, v, out, lse, do, bm, implementation="reference")
    assert steps[3] == ()  # (no score_mod_args)
    for got, want in zip(steps, vjp(do)):
        assert got.shape == want.shape and rel_error(got, want) < 1e-6


def test_the_backward_step_gives_the_tables_gradient():
    """With a score_mod reading a learned table the backward step also returns the
    table's gradient (None for the integer ids), equal to the custom_vjp's."""
    s = 300
    keys = jax.random.split(jax.random.key(3), 4)
    q, k, v, do = (jax.random.normal(kk, (2, s, h, 32)) for kk, h in zip(keys, (H, H_KV, H_KV, H)))
    doc = jnp.asarray(doc_ids(2, s, [70, 150]))
    table = jnp.linspace(0.5, 1.5, int(doc.max()) + 1, dtype=jnp.float32)
    bm = block_map("sliding_window", 2, H, s)
    kw = dict(score_mod=doc_scale, implementation="reference")
    out, lse = block_sparse_attention_with_lse(q, k, v, bm, score_mod_args=(doc, table), **kw)
    _, vjp = jax.vjp(lambda q, k, v, t: block_sparse_attention(
        q, k, v, bm, score_mod_args=(doc, t), **kw), q, k, v, table)
    dq, dk, dv, d_args = block_sparse_attention_backward(q, k, v, out, lse, do, bm,
                                                         score_mod_args=(doc, table), **kw)
    assert d_args[0] is None
    for got, want in zip((dq, dk, dv, d_args[1]), vjp(do)):
        assert got.shape == want.shape and rel_error(got, want) < 1e-6


def test_padding_lengths_split_with_the_batch(hopper_reference):
    """Padded sequences (the drop-in's query / key lengths: per-batch arrays, so they
    split with the batch) with a dense mask and rows that see no key, on a batch split:
    each shard builds its map from its own lengths; nothing moves but the loss, and out
    and dq/dk/dv equal the unsharded step's and jax.nn's own (float32)."""
    mesh = _mesh((2,), ("dp",))
    q, k, v, do = _qkvo()
    mask = np.random.default_rng(4).random((B, 1, S, S)) < 0.3
    mask[:, :, 5] = False
    q_len = jnp.asarray([S, 180, 200, S], jnp.int32)
    kv_len = jnp.asarray([100, S, 150, S], jnp.int32)
    assert fusedattn.jax_nn.explain(q, k, v, mask=mask, query_seq_lengths=q_len,
                                    key_value_seq_lengths=kv_len).chosen == "block_sparse"

    def call(fn):
        return lambda q, k, v, m, ql, kvl: fn(q, k, v, mask=m, query_seq_lengths=ql,
                                              key_value_seq_lengths=kvl)
    extra = [jnp.asarray(mask), q_len, kv_len]
    single, sharded, _, text = sc.run(call(fusedattn.dot_product_attention), [q, k, v, *extra],
                                      [NamedSharding(mesh, P("dp"))] * 6, do)
    _only_the_loss_reduces(text)
    sc.assert_same(single, sharded, TOL_SAME)
    group = H // H_KV
    jax_nn = lambda q, k, v, **o: jax.nn.dot_product_attention(  # noqa: E731
        q, jnp.repeat(k, group, 2), jnp.repeat(v, group, 2), implementation="xla", **o)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    want, vjp = jax.vjp(lambda q, k, v: call(jax_nn)(q, k, v, *extra), *f32[:3])
    (_, out), grads = sharded
    for name, got, ref, tol in zip(("out", "dq", "dk", "dv"), (out, *grads),
                                   (want, *vjp(f32[3])), (TOL_OUT,) + (TOL_GRAD,) * 3):
        assert rel_error(got, ref) < tol, (name, rel_error(got, ref))
