"""`block_sparse_attention` called directly under batch and head splits (8 host devices,
tests/conftest.py).

On a GPU the kernels are opaque custom calls, so each step runs under the package's
partitioning rule (`block_sparse.sharded`). On CPU the same rule runs around the
reference walks (`attention.PARTITIONED` patched), so the partitioned step compiles
and runs for real. Checked: a user's map, static or built in the step from sharded
ids, splits with the batch and heads and the sharded step's only collectives are the
loss's (and a learned table's gradient, summed over shards); the results equal the
unsharded call's and the float64 oracle's; a map whose functions read the batch or
head number as a value has that axis gathered, and still gives the unsharded results.
"""
from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fusedattn import block_sparse as bs
from fusedattn.block_sparse import attention, sharded
from fusedattn.block_sparse.kernel_mask import kernel_mask
from fusedattn.block_sparse.kernel_score import kernel_score
from support import sharding_cases as sc
from support.block_sparse_cases import (SCORE_VALUE_MODS, block_map, dense_visibility,
                                        doc_ids, oracle, rel_error)

B, S, H, H_KV, D = 4, 256, 4, 2, 64
TOL_SAME = 1e-2   # bf16: a head shard rounds dk, dv differently
TOL_OUT, TOL_GRAD = 2e-2, 4e-2   # bf16 against float64

SPLITS = {"batch": ((2,), ("dp",), P("dp")),
          "heads": ((2,), ("tp",), P(None, None, "tp")),
          "batch-heads": ((2, 2), ("dp", "tp"), P("dp", None, "tp"))}


@pytest.fixture
def partitioned_reference(monkeypatch):
    monkeypatch.setattr(attention, "PARTITIONED", ("mosaic", "reference"))


def _qkvo():
    keys = jax.random.split(jax.random.key(3), 4)
    shapes = ((B, S, H, D), (B, S, H_KV, D), (B, S, H_KV, D), (B, S, H, D))
    return [jax.random.normal(kk, shape, jnp.bfloat16) for kk, shape in zip(keys, shapes)]


def _ids():
    return jnp.asarray(doc_ids(B, S, [S // 8, S // 4, S // 8 + 40]))


def _mesh(split, axis_type=jax.sharding.AxisType.Auto):
    shape, names, spec = SPLITS[split]
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names)), spec


def _moved(text):
    """(collective, element count) of every collective's result in the compiled step."""
    found = re.findall(rf"= (.*?) ({'|'.join(sc.COLLECTIVES)})(?:-start)?\(", text)
    return [(op, math.prod(int(n) for n in dims.split(",") if n))
            for shapes, op in found for dims in re.findall(r"\w+\[([\d,]*)\]", shapes)]


def _only_collectives(text, largest=1):
    """No token array moves (q, k, v, the output, their gradients): each collective
    carries at most `largest` elements (1: the loss's all-reduce alone)."""
    moved = _moved(text)
    assert moved and all(n <= largest for _, n in moved), moved


def _check(call, args, shardings, visible, unseen_rows="zero", moves=False):
    q, k, v, do = _qkvo()
    single, got, _, text = sc.run(call, [q, k, v, *args], shardings, do)
    if not moves:
        _only_collectives(text)
    sc.assert_same(single, got, TOL_SAME)
    ref_out, _, (dq, dk, dv) = oracle(*(np.asarray(x, np.float64) for x in (q, k, v)), visible,
                                      1 / np.sqrt(D), d_out=np.asarray(do, np.float64),
                                      unseen_rows=unseen_rows)
    (_, out), grads = got
    for name, x, want, tol in zip(("out", "dq", "dk", "dv"), (out, *grads[:3]),
                                  (ref_out, dq, dk, dv), (TOL_OUT,) + (TOL_GRAD,) * 3):
        assert rel_error(x, want) < tol, (name, rel_error(x, want))
    return text


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_a_static_map_splits(partitioned_reference, split):
    """A window's map (numpy, closed over): every device walks the same lists."""
    bm = block_map("sliding_window", B, H, S)
    mesh, spec = _mesh(split)
    call = lambda q, k, v: bs.block_sparse_attention(q, k, v, bm,  # noqa: E731
                                                     implementation="reference")
    _check(call, [], [NamedSharding(mesh, spec)] * 3, dense_visibility(bm, B, H, S))


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_a_map_built_in_the_step_from_sharded_ids(partitioned_reference, split):
    """Documents from ids split with the batch: the map's [B, ...] lists and id arrays
    follow q, and a learned per-document scale's gradient is the only other sum."""
    mesh, spec = _mesh(split)
    ids = _ids()
    fn = SCORE_VALUE_MODS["document_scale"]
    scale = jnp.linspace(0.8, 1.2, 5, dtype=jnp.float32)

    def call(q, k, v, scale, ids):
        return bs.block_sparse_attention(q, k, v, bs.from_segment_ids(ids), score_mod=fn,
                                         score_mod_args=(ids, scale),
                                         implementation="reference")
    ids_spec = P(spec[0]) if spec[0] else P()
    q, k, v, do = _qkvo()
    shardings = [NamedSharding(mesh, spec)] * 3 + [None, NamedSharding(mesh, ids_spec)]
    single, got, _, text = sc.run(call, [q, k, v, scale, ids], shardings, do, n_diff=4)
    # (a score_mod's args are read whole, as through fused_attn: the ids move for the
    # scale's reads, and the per-row values' gradient is summed over head shards; the
    # map built from the ids moves nothing)
    _only_collectives(text, largest=B * S)
    sc.assert_same(single, got, TOL_SAME)


def test_unseen_rows_take_the_mean_on_each_shard(partitioned_reference):
    """jax.nn's rule under a split: each device's mean of its own v rows and heads, and
    the unseen rows' part of dv, inside the partitioned steps."""
    bm = block_map("random_dense", B, H, S)
    mesh, spec = _mesh("batch-heads")
    call = lambda q, k, v: bs.block_sparse_attention(  # noqa: E731
        q, k, v, bm, implementation="reference", unseen_rows="mean")
    _check(call, [], [NamedSharding(mesh, spec)] * 3, dense_visibility(bm, B, H, S),
           unseen_rows="mean")


def test_sequence_first_arrays_split_too(partitioned_reference):
    bm = block_map("documents", B, H, S)
    mesh, _ = _mesh("batch")
    sw = lambda x: jnp.swapaxes(x, 0, 1)  # noqa: E731
    q, k, v, do = _qkvo()
    call = lambda q, k, v: bs.block_sparse_attention(  # noqa: E731
        q, k, v, bm, implementation="reference", layout="sbhd")
    single, got, _, text = sc.run(call, [sw(q), sw(k), sw(v)],
                                  [NamedSharding(mesh, P(None, "dp"))] * 3, sw(do))
    _only_collectives(text)
    sc.assert_same(single, got, TOL_SAME)


@pytest.mark.parametrize("family, reads", [("head_dependent", (False, True)),
                                           ("sliding_window", (False, False)),
                                           ("documents_mask_mod", (False, False))])
def test_functions_reading_the_numbers(family, reads):
    """What the kernels' mask function computes with: a window whose width depends on
    the head reads the head number; reads of ids by the batch number are hoisted."""
    bm = block_map(family, B, H, S)
    km = kernel_mask(bm.element)
    n = lambda x: 0 if x is None else x.shape[1]  # noqa: E731
    assert sharded.reads_numbers(km.fn, None, n(km.q_arrays), n(km.kv_arrays),
                                 km.dense is not None, ()) == reads


def test_a_score_mod_reading_the_batch_number():
    km = kernel_mask(block_map("causal", B, H, S).element)
    score = kernel_score(lambda s, b, h, i, j: s * (1.0 + 0.1 * b), (), B, H, S, S)
    assert sharded.reads_numbers(km.fn, score.fn, 0, 0, False, (0, 0, 0)) == (True, False)


def test_a_head_number_read_gathers_the_heads(partitioned_reference):
    """A window whose width grows with the head: under a head split the heads are
    gathered (a shard would read its own 0..), and the results are the unsharded ones."""
    bm = block_map("head_dependent", B, H, S)
    mesh, spec = _mesh("batch-heads")
    call = lambda q, k, v: bs.block_sparse_attention(q, k, v, bm,  # noqa: E731
                                                     implementation="reference")
    text = _check(call, [], [NamedSharding(mesh, spec)] * 3, dense_visibility(bm, B, H, S),
                  moves=True)
    assert ("all-gather", B * S * H * D // 2) in _moved(text)


def test_explicit_mesh_axes(partitioned_reference):
    """Sharding in types: the step runs with the axes Auto and its results are typed as
    the rule splits them."""
    mesh, spec = _mesh("batch-heads", jax.sharding.AxisType.Explicit)
    ids = _ids()
    call = lambda q, k, v, ids: bs.block_sparse_attention(  # noqa: E731
        q, k, v, bs.from_segment_ids(ids), implementation="reference")
    q, k, v, do = _qkvo()
    single, got, _, text = sc.run(call, [q, k, v, ids], [NamedSharding(mesh, spec)] * 3
                                  + [NamedSharding(mesh, P("dp"))], do)
    _only_collectives(text)
    sc.assert_same(single, got, TOL_SAME)


def test_the_steps_carry_the_rule(partitioned_reference):
    """Lowered, a direct call's forward and backward sit in custom_partitioning ops with
    the Shardy rule; `partitioned=False` (the backend's per-device call) has none."""
    mesh, spec = _mesh("batch")
    bm = block_map("sliding_window", B, H, S)
    q, k, v, _ = (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
                  for x in _qkvo())

    def text(partitioned):
        loss = lambda q, k, v: bs.block_sparse_attention(  # noqa: E731
            q, k, v, bm, implementation="reference",
            partitioned=partitioned).astype(jnp.float32).sum()
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower().as_text()
    on = text(True)
    assert on.count("CustomSPMDPartitioning") == 2 and on.count("sdy.sharding_rule") >= 2
    assert text(False).count("CustomSPMDPartitioning") == 0


def test_a_gathered_axis_under_explicit_axes(partitioned_reference):
    """Sharding in types with the heads gathered (a head-dependent window): the step's
    results are typed as its split leaves them, and equal the unsharded call's."""
    bm = block_map("head_dependent", B, H, S)
    mesh, spec = _mesh("batch-heads", jax.sharding.AxisType.Explicit)
    call = lambda q, k, v: bs.block_sparse_attention(q, k, v, bm,  # noqa: E731
                                                     implementation="reference")
    _check(call, [], [NamedSharding(mesh, spec)] * 3, dense_visibility(bm, B, H, S),
           moves=True)
