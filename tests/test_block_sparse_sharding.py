"""block_sparse under batch and head splits, on 8 host devices (tests/conftest.py).

The backend's kernels go through native_op's partitioning rule, as the FFI backends'
do: each device runs its shard and builds its shard's block map; a mask_mod reads the
call's batch rows. On CPU the Hopper check is patched to pass and the kernels run as
the reference list walks (as in test_block_sparse_dispatch.py), so the partitioned
step compiles and runs for real. Checked for a static mask_mod (sliding window), a
documents mask_mod reading a whole [B, S] id array by b (every row different, so a
shard reading its own rows 0.. fails) and a dense boolean mask through the jax.nn
drop-in: the sharded step's only collective is the loss's scalar all-reduce, and the
output and the q, k, v gradients equal the unsharded step's and the float64 oracle's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fusedattn
from fusedattn import dispatch
from fusedattn.backends import block_sparse as backend
from support import oracle
from support import sharding_cases as sc
from support.sharding_cases import partitioner  # noqa: F401 (a fixture)
from support.block_sparse_cases import block_map, doc_ids, rel_error
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


@pytest.fixture
def hopper(monkeypatch):
    """A CUDA platform with a Hopper GPU; the kernels run as the reference list walks."""
    monkeypatch.setenv(dispatch.ENV_PLATFORM, "cuda")
    monkeypatch.setattr(backend, "on_hopper", lambda: True)
    monkeypatch.setattr(backend, "IMPLEMENTATION", "reference")
    dispatch.clear_cache()
    yield
    dispatch.clear_cache()


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
    return (j <= i) & (i - j < 64)


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


def _only_the_loss_reduces(text):
    """The sharded step moves no q / k / v: its only collective is the scalar loss's
    all-reduce (a gather written as an all-reduce of a padded array shows its shape)."""
    counts = sc.collectives(text)
    assert counts["all-gather"] == counts["all-to-all"] == counts["collective-permute"] \
        == counts["reduce-scatter"] == 0, counts
    assert set(sc.all_reduce_shapes(text)) <= {"f32[]"}, sc.all_reduce_shapes(text)


@pytest.mark.parametrize("mask", ["window", "documents", "dense"])
@pytest.mark.parametrize("split", sorted(SPLITS))
def test_a_split_runs_per_shard(hopper, split, mask):
    _check_split(split, mask, jax.sharding.AxisType.Auto)


@pytest.mark.parametrize("mask", ["documents", "dense"])
@pytest.mark.parametrize("split", ["batch", "heads"])
def test_explicit_mesh_axes(hopper, split, mask):
    """Sharding in types (Explicit axes, JAX's default mesh): the map's and the list
    walks' gathers run with the axes Auto, the results typed as their arrays."""
    _check_split(split, mask, jax.sharding.AxisType.Explicit)


def _check_split(split, mask, axis_type):
    mesh_shape, names, spec, mask_spec = SPLITS[split]
    mesh = jax.make_mesh(mesh_shape, names, axis_types=(axis_type,) * len(names))
    q, k, v, do = _qkvo()
    call, extra, extra_specs, visible = _case(mask)
    shardings = [NamedSharding(mesh, spec)] * 3 + [
        None if s is None else NamedSharding(mesh, s) for s in extra_specs(mask_spec)]
    single, sharded, _, text = sc.run(call, [q, k, v, *extra], shardings, do)
    _only_the_loss_reduces(text)
    sc.assert_same(single, sharded, TOL_SAME)
    (_, out), grads = sharded
    for name, got, want, tol in zip(("out", "dq", "dk", "dv"), (out, *grads),
                                    _oracle(q, k, v, do, visible),
                                    (TOL_OUT, TOL_GRAD, TOL_GRAD, TOL_GRAD)):
        err = rel_error(got, want)
        assert err < tol, (name, err)


def test_both_partitioners_split_the_documents_mask(hopper, partitioner):
    """Shardy's rule and the GSPMD callbacks alike (the mask_mod reading global rows)."""
    mesh_shape, names, spec, _ = SPLITS["batch-heads"]
    mesh = _mesh(mesh_shape, names)
    q, k, v, do = _qkvo()
    call, extra, _, _ = _case("documents")
    single, sharded, _, text = sc.run(call, [q, k, v, *extra],
                                      [NamedSharding(mesh, spec)] * 3 + [None], do)
    _only_the_loss_reduces(text)
    sc.assert_same(single, sharded, TOL_SAME)


def test_the_log_sum_exp_is_split_too(hopper):
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


def test_the_call_carries_the_rule(hopper):
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


def test_explain_states_the_split(hopper):
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


def test_a_score_mod_reading_the_head_is_refused_on_a_head_shard(hopper):
    """The kernels see a shard's own head numbers and take no offset: a score_mod that
    reads h cannot run on a head shard, and the error says so (not wrong numbers)."""
    mesh = _mesh((2,), ("tp",))
    q, k, v, _ = _qkvo()

    def f(q, k, v):
        return fusedattn.fused_attn(q, k, v, mask_mod=window,
                                    score_mod=lambda s, b, h, i, j: s + 0.1 * h)
    assert fusedattn.explain(q, k, v, mask_mod=window,
                             score_mod=lambda s, b, h, i, j: s + 0.1 * h).chosen == "block_sparse"
    placed = [jax.device_put(x, NamedSharding(mesh, P(None, None, "tp"))) for x in (q, k, v)]
    with pytest.raises(jax.errors.JaxRuntimeError, match="needs the shard's offset"):
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
    for got, want in zip(steps, vjp(do)):
        assert got.shape == want.shape and rel_error(got, want) < 1e-6
