"""Context parallelism on 8 host devices (tests/conftest.py): ring and all-gather,
causal (zig-zag) and not, with padding, against the float64 oracle (fp32 inputs,
relative tolerance 1e-5) and the collectives compiled into the step.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from support import attn_cases
from support import sharding_cases as sc
import fusedattn
from fusedattn import ContextParallel, context_parallel
from fusedattn.context_parallel import blocks as context_parallel_steps
from fusedattn.backends import native_op as native_call

TOL = attn_cases.TOLERANCE["float32"]


def _mesh(dp, cp):
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh((dp, cp), ("dp", "cp"), axis_types=(auto, auto))


def _check(case, strategy, dp=2, n=4, **cp_options):
    built = attn_cases.build(case)
    mesh = _mesh(dp, n)
    cp = ContextParallel("cp", strategy=strategy, mesh=mesh, batch_axes=("dp",), **cp_options)

    def f(q, k, v, cp=cp):
        return fusedattn.fused_attn(q, k, v, mask=case.mask, sequence=built.sequence,
                                    context_parallel=cp, backend="xla")
    shard = NamedSharding(mesh, P("dp", "cp"))
    single, sharded, counts, _ = sc.run(f, [built.q, built.k, built.v], [shard] * 3,
                                        built.d_out, reference=functools.partial(f, cp=None))
    ref = attn_cases.oracle_for(built)
    (_, out), (dq, dk, dv) = sharded
    attn_cases.assert_close("out", out, ref.out, TOL)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        attn_cases.assert_close(name, got, getattr(ref, name), TOL)
    sc.assert_same(single, sharded, TOL)
    return counts


@pytest.mark.parametrize("strategy,mask,sequence", [
    ("ring", "none", "dense"), ("ring", "causal", "dense"), ("ring", "none", "padding"),
    ("ring", "causal", "padding"), ("ring", "causal_bottom_right", "dense"),
    ("allgather", "none", "padding"), ("allgather", "causal", "dense"),
])
def test_matches_the_oracle(strategy, mask, sequence):
    case = attn_cases.Case(b=2, s_q=64, s_kv=64, h_q=4, h_kv=2, d_qk=16, d_v=16, mask=mask,
                           sequence=sequence)
    counts = _check(case, strategy)
    if strategy == "ring":
        assert counts["all-gather"] == 0 and counts["collective-permute"] > 0, counts
    else:
        assert counts["all-gather"] > 0, counts


SCORE_MODS = {  # name -> (score_mod, mask_mod, score_mod_args)
    "alibi": (fusedattn.score_mods.alibi(4), None, ()),
    "relative_position": (lambda s, b, h, q, k: s + 0.05 * (q - k), None, ()),
    # (multiplicative: a per-row constant added to the scores would cancel in the softmax)
    "head_and_batch_numbers": (lambda s, b, h, q, k, w: s * (1.0 + 0.2 * w[h] + 0.3 * b), None,
                               (jnp.arange(4, dtype=jnp.int32),)),
    "position_mask": (None, lambda b, h, q, k: (k <= q) | (k < 8), ()),
}


@pytest.mark.parametrize("strategy,mask,sequence", [
    ("ring", "causal", "dense"), ("ring", "none", "padding"), ("ring", "causal", "padding"),
    ("allgather", "causal", "dense"), ("allgather", "none", "dense"),
])
@pytest.mark.parametrize("name", sorted(SCORE_MODS))
def test_score_mods_see_the_calls_positions(name, strategy, mask, sequence):
    """Blocks run with their own row numbers; the score_mod / mask_mod must see the
    call's (zig-zag halves, the ring's source device, batch and head shards): the
    split call equals the unsplit one, forward and gradients."""
    mod, mask_mod, args = SCORE_MODS[name]
    case = attn_cases.Case(b=2, s_q=64, s_kv=64, h_q=4, h_kv=2, d_qk=16, d_v=16, mask=mask,
                           sequence=sequence)
    built = attn_cases.build(case)
    mesh = jax.make_mesh((2, 2, 2), ("dp", "cp", "tp"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    cp = ContextParallel("cp", strategy=strategy, mesh=mesh, batch_axes=("dp",),
                         head_axes=("tp",))

    def f(q, k, v, cp=cp):
        return fusedattn.fused_attn(q, k, v, mask=mask, sequence=built.sequence, score_mod=mod,
                                    mask_mod=mask_mod, score_mod_args=args,
                                    context_parallel=cp, backend="xla")
    shard = NamedSharding(mesh, P("dp", "cp", "tp"))
    single, sharded, _, _ = sc.run(f, [built.q, built.k, built.v], [shard] * 3, built.d_out,
                                   reference=functools.partial(f, cp=None))
    sc.assert_same(single, sharded, TOL)


def test_two_devices_and_no_load_balance():
    case = attn_cases.Case(b=2, s_q=32, s_kv=32, h_q=2, h_kv=2, d_qk=8, d_v=8, mask="causal")
    _check(case, "ring", dp=1, n=2, load_balance=False)
    _check(case, "ring", dp=1, n=2)


def test_inputs_already_in_zigzag_order():
    """reorder=False: the caller permuted tokens with zigzag_order; results come back in
    that order and equal the natural-order call permuted the same way."""
    mesh = _mesh(1, 4)
    s = 64
    order = context_parallel.zigzag_order(s, 4)
    assert sorted(order.tolist()) == list(range(s))
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (2, s, 2, 8)) for i in range(3))
    shard = NamedSharding(mesh, P(None, "cp"))
    for strategy in ("ring", "allgather"):
        cp = ContextParallel("cp", strategy=strategy, mesh=mesh, reorder=False)

        def loss(q, k, v):
            out = fusedattn.fused_attn(q, k, v, mask="causal", context_parallel=cp, backend="xla")
            return jnp.sum(out ** 2), out
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
            *(jax.device_put(x[:, order], shard) for x in (q, k, v)))
        (_, ref), ref_grads = jax.value_and_grad(
            lambda q, k, v: (lambda o: (jnp.sum(o ** 2), o))(fusedattn.fused_attn(
                q, k, v, mask="causal", backend="xla")), argnums=(0, 1, 2), has_aux=True)(q, k, v)
        np.testing.assert_allclose(out, ref[:, order], rtol=1e-5, atol=1e-5)
        for g, r in zip(grads, ref_grads):
            np.testing.assert_allclose(g, r[:, order], rtol=1e-4, atol=1e-5)


def test_native_kernels_inside_the_ring_split_batch_without_gathers(monkeypatch):
    """The ring around native_call (the path cudnn takes), with the batch also split:
    the kernels partition over dp inside the shard_map; no all-gather anywhere."""
    monkeypatch.setattr(context_parallel_steps, "kernels", lambda backend: (
        functools.partial(native_call.forward, "xla"), functools.partial(native_call.backward,
                                                                         "xla")))
    case = attn_cases.Case(b=2, s_q=64, s_kv=64, h_q=4, h_kv=2, d_qk=16, d_v=16, mask="causal")
    counts = _check(case, "ring")
    assert counts["all-gather"] == 0, counts


@pytest.mark.parametrize("options,reason", [
    (dict(window=(8, 0), mask="causal"), "sliding windows"),
    (dict(dropout=0.1, rng=jax.random.PRNGKey(0)), "dropout"),
    (dict(softmax="off_by_one"), "softmax sinks"),
    (dict(layout="sbhd"), "bshd layout"),
    (dict(score_mod=lambda s, b, h, q, k, w: s * w[h], score_mod_args=(jnp.ones((2,)),)),
     "floating score_mod_args"),
])
def test_refusals_name_the_reason(options, reason):
    mesh = _mesh(1, 4)
    q = jnp.ones((2, 64, 2, 8))
    with pytest.raises(fusedattn.UnsupportedError, match=reason):
        fusedattn.fused_attn(q, q, q, context_parallel=ContextParallel("cp", mesh=mesh),
                             backend="xla", **options)


def test_bad_axis_and_type():
    mesh = _mesh(1, 4)
    q = jnp.ones((2, 64, 2, 8))
    with pytest.raises(ValueError, match="'sp' is not an axis"):
        fusedattn.fused_attn(q, q, q, context_parallel=ContextParallel("sp", mesh=mesh))
    with pytest.raises(TypeError, match="context_parallel must be"):
        fusedattn.fused_attn(q, q, q, context_parallel="cp")
    with pytest.raises(ValueError, match="strategy"):
        ContextParallel("cp", strategy="tree")


def test_explain_shows_the_plan():
    mesh = _mesh(1, 4)
    q = jax.ShapeDtypeStruct((1, 4096, 8, 64), jnp.bfloat16)
    text = str(fusedattn.explain(q, q, q, mask="causal",
                                 context_parallel=ContextParallel("cp", mesh=mesh)))
    assert "context parallel over 'cp' (4 devices), strategy ring" in text
    assert "zig-zag" in text and "3 ppermutes of k, v" in text
