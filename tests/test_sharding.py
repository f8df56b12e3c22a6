"""The partitioning rule of native calls, on 8 host devices (tests/conftest.py).

The rule (fusedattn.partitioning, applied by backends/native_call.py) is the same
for cudnn, small_seq and ck; here it runs around the XLA backend's per-device
kernels (`native_call.attention("xla", ...)`), so the custom_partitioning path
compiles, partitions and runs on the CPU for real. Checked: no gather for batch
and head splits (under Shardy and under GSPMD), the expected all-reduces only,
numbers equal to the unsplit call (fp32, relative error 1e-5), the plans that
must gather say so in explain(), and the native calls lowered for CUDA / ROCm
without a GPU carry the rule.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from support import sharding_cases as sc
from support.sharding_cases import partitioner  # noqa: F401 (a fixture)
import fusedattn
from fusedattn import SequenceDescriptor, partitioning
from fusedattn.backends import cudnn, fp8_op, xla
from fusedattn.backends import native_op as native_call
from fusedattn.backends.xla import fp8 as xla_fp8
from fusedattn.inputs import AttnInputs
from fusedattn.validation import build_call

TOL = 1e-5  # fp32: the same arithmetic on fewer rows


def _mesh(shape, names):
    """A mesh of Auto axes: the partitioner decides, the rule is asked (the XLA
    kernels used here reshape heads, which Explicit sharding types refuse when the
    heads are split)."""
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def _normal(seed, shape):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def _native(options, extra_names=()):
    """fused_attn semantics through native_call around the XLA kernels."""
    def f(q, k, v, *extra):
        opts = dict(options, **dict(zip(extra_names, extra)))
        config, inputs = build_call(q, k, v, **opts)
        return native_call.attention("xla", config, inputs)[0]
    return f


CASES = {
    # name: (mesh shape, q spec, options, extras {name: (shape, spec)}, all-reduces of grads)
    "mha-batch": ((4,), P("dp"), dict(mask="causal"), {}, 0),
    "gqa-batch-heads": ((2, 4), P("dp", None, "tp"), dict(mask="causal"), {}, 0),
    "bias-per-head": ((2, 4), P("dp", None, "tp"),
                      dict(), {"bias": ((1, 8, 32, 32), P(None, "tp"))}, 1),
    "bias-per-batch": ((2, 4), P("dp", None, "tp"),
                       dict(), {"bias": ((4, 1, 32, 32), P("dp"))}, 1),
    "learnable-sinks": ((2, 4), P("dp", None, "tp"), dict(softmax="learnable"),
                        {"softmax_offset": ((8,), P("tp"))}, 1),
    "padding": ((2, 4), P("dp", None, "tp"), dict(mask="causal", sequence=SequenceDescriptor
                                                  .from_lengths(jnp.array([32, 7, 19, 1]))), {}, 0),
    "packed-thd": ((4,), P("dp"), dict(sequence=SequenceDescriptor.from_segment_ids(
        jnp.repeat(jnp.array([[1, 1, 2, 3]]), 8, axis=1).repeat(4, axis=0), max_segments=3)),
        {}, 0),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_batch_and_head_splits_need_no_gather(partitioner, name):
    mesh_shape, spec, options, extras, reduces = CASES[name]
    mesh = _mesh(mesh_shape, ("dp", "tp")[:len(mesh_shape)])
    b, s, h_q, h_kv, d = 4, 32, 8, 4, 16
    q, k, v, d_out = (_normal(0, (b, s, h_q, d)), _normal(1, (b, s, h_kv, d)),
                      _normal(2, (b, s, h_kv, d)), _normal(3, (b, s, h_q, d)))
    extra = [_normal(4 + i, shape) for i, (shape, _) in enumerate(extras.values())]
    shardings = [NamedSharding(mesh, spec)] * 3 + [NamedSharding(mesh, sp)
                                                   for _, sp in extras.values()]
    single, sharded, counts, text = sc.run(_native(options, tuple(extras)), [q, k, v, *extra],
                                           shardings, d_out, n_diff=3 + len(extra))
    assert counts["all-gather"] == counts["all-to-all"] == counts["collective-permute"] == 0, counts
    # The loss's own all-reduce, plus one per gradient summed over shards (XLA may
    # combine them into one all-reduce of a tuple).
    assert 1 <= counts["all-reduce"] <= 1 + reduces + 1, counts
    sc.assert_same(single, sharded, TOL)


def test_layouts_and_packing_split_too(partitioner):
    """sbhd and packed qkv: the roles follow the layout."""
    mesh = _mesh((2, 4), ("dp", "tp"))
    q = _normal(0, (32, 4, 3, 8, 16))  # sb3hd
    d_out = _normal(1, (32, 4, 8, 16))

    def f(qkv):
        config, inputs = build_call(qkv, None, None, layout="sb3hd", mask="causal")
        return native_call.attention("xla", config, inputs)[0]
    single, sharded, counts, _ = sc.run(f, [q], [NamedSharding(mesh, P(None, "dp", None, "tp"))],
                                        d_out, n_diff=1)
    assert counts["all-gather"] == 0, counts
    sc.assert_same(single, sharded, TOL)


def test_heads_finer_than_kv_heads_are_gathered_and_explained():
    mesh = _mesh((8,), ("tp",))
    q, k, v, d_out = (_normal(0, (2, 16, 8, 16)), _normal(1, (2, 16, 2, 16)),
                      _normal(2, (2, 16, 2, 16)), _normal(3, (2, 16, 8, 16)))
    shard = NamedSharding(mesh, P(None, None, "tp"))
    single, sharded, counts, _ = sc.run(_native({}), [q, k, v], [shard, NamedSharding(mesh, P()),
                                                                NamedSharding(mesh, P())], d_out)
    sc.assert_same(single, sharded, TOL)
    plan = fusedattn.explain(*(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shard)
                               for x in (q, k, v)))
    assert "h_kv=2" in str(plan) and "gathered" in str(plan)


def test_explain_states_the_split_and_the_sequence_gather():
    mesh = _mesh((2, 4), ("dp", "sp"))
    sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.bfloat16,  # noqa: E731
                                                   sharding=NamedSharding(mesh, spec))
    q = sds((4, 64, 8, 64), P("dp", "sp"))
    text = str(fusedattn.explain(q, q, q, mask="causal"))
    assert "batch split over ('dp',)" in text
    assert "query sequence split over ('sp',) is gathered" in text
    assert "ContextParallel(axis='sp')" in text
    plain = str(fusedattn.explain(sds((4, 64, 8, 64), P("dp")), sds((4, 64, 8, 64), P("dp")),
                                  sds((4, 64, 8, 64), P("dp"))))
    assert "gathered" not in plain and "each device runs b2 h8/8" in plain


def test_rule_decisions():
    config, inputs = build_call(*(jax.ShapeDtypeStruct((8, 64, 16, 32), jnp.bfloat16)
                                  for _ in range(3)), bias=jax.ShapeDtypeStruct(
        (1, 16, 64, 64), jnp.bfloat16))
    dims = partitioning.input_dims(config, inputs)
    assert dims.q.roles == ("b", "s", "h", None) and dims.k.roles == ("b", "t", "k", None)
    assert dims.bias.roles == (None, "h", None, None)
    assert partitioning.summed_roles(dims.bias) == ("b",)
    split = partitioning.decide(config, {"dp": 2, "tp": 4},
                                [("q", dims.q, P("dp", None, "tp"))])
    assert (split.batch, split.heads, split.notes) == (("dp",), ("tp",), ())
    local = partitioning.local_config(config, split, {"dp": 2, "tp": 4})
    assert (local.batch, local.h_q, local.h_kv, local.bias_shape) == (4, 4, 4, (1, 4, 64, 64))
    odd = partitioning.decide(config, {"dp": 3}, [("q", dims.q, P("dp"))])
    assert odd.batch == () and "does not divide" in odd.notes[0]


def test_vmap_and_shard_map_keep_working():
    q, k, v = (_normal(i, (3, 2, 16, 4, 8)) for i in range(3))
    f = _native({})
    looped = jnp.stack([f(q[i], k[i], v[i]) for i in range(3)])
    np.testing.assert_allclose(jax.vmap(f)(q, k, v), looped, rtol=1e-6, atol=1e-6)
    mesh = _mesh((2,), ("dp",))
    per_device = jax.shard_map(f, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    np.testing.assert_allclose(jax.jit(per_device)(q[0], k[0], v[0]), f(q[0], k[0], v[0]),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_a_partially_manual_shard_map_runs_the_call_per_manual_shard(partitioner, axis_type):
    """shard_map over dp with tp left automatic: the call skips custom_partitioning (it
    would get no mesh, and GSPMD aborted the process on its sharding), runs per dp
    shard, and gives the unsplit numbers under both partitioners. With Explicit axes
    (`jax.make_mesh`'s default) the call's body runs with tp Auto, dp staying Manual."""
    mesh = _mesh((2, 4), ("dp", "tp")) if axis_type == "auto" else jax.make_mesh(
        (2, 4), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    q, k, v = (_normal(i, (4, 16, 8, 8)) for i in range(3))
    f = _native(dict(mask="causal"))
    sharded = [jax.device_put(x, NamedSharding(mesh, P("dp", None, "tp"))) for x in (q, k, v)]
    g = jax.shard_map(f, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"), axis_names={"dp"})
    np.testing.assert_allclose(jax.jit(g)(*sharded), f(q, k, v), rtol=TOL, atol=TOL)

    def loss(q, k, v):
        return jnp.sum(g(q, k, v) ** 2)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*sharded)
    want = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2))(q, k, v)
    for got, ref in zip(grads, want):
        np.testing.assert_allclose(got, ref, rtol=TOL, atol=TOL)


def test_dropout_under_a_split_draws_the_documented_stream():
    """Each shard's dropout bits are the key's bits with the shard index folded in, so
    masks differ from the unsplit call's (XLA's own backend does not differ: its hash
    reads global positions). Checked shard by shard against that rule."""
    mesh = _mesh((4,), ("dp",))
    q, k, v = (_normal(i, (4, 16, 2, 8)) for i in range(3))
    key = jax.random.PRNGKey(3)
    f = jax.jit(_native(dict(dropout=0.3, rng=key)))
    shard = NamedSharding(mesh, P("dp"))
    sharded = np.asarray(f(*(jax.device_put(x, shard) for x in (q, k, v))))
    config, _ = build_call(q, k, v, dropout=0.3, rng=key)
    bits = native_call.rng_bits(config, key)
    local = dataclasses.replace(config, batch=1)
    for r in range(4):
        folded = bits.at[0].add(jnp.uint32(r) * jnp.uint32(0x9E3779B9))
        want = native_call.forward("xla", local, AttnInputs(q[r:r + 1], k[r:r + 1], v[r:r + 1],
                                                            rng=folded), False)[0]
        np.testing.assert_allclose(sharded[r:r + 1], want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(sharded, np.asarray(f(q, k, v)))


def test_explicit_mesh_batch_split():
    """Sharding in types (Explicit axes, JAX's default mesh): the batch split runs."""
    mesh = jax.make_mesh((4,), ("dp",), axis_types=(jax.sharding.AxisType.Explicit,))
    q, k, v, d_out = (_normal(i, (4, 16, 4, 8)) for i in range(4))
    single, sharded, counts, _ = sc.run(_native(dict(mask="causal")), [q, k, v],
                                        [NamedSharding(mesh, P("dp"))] * 3, d_out)
    assert counts["all-gather"] == 0, counts
    sc.assert_same(single, sharded, TOL)


@pytest.mark.parametrize("spec", [P("dp"), P(None, None, "dp")], ids=["batch", "heads"])
def test_explicit_mesh_xla_backend_with_learnable_score_mod_args(spec):
    """The XLA backend under Explicit axes: its tiles reshape heads and scatter into
    the per-head argument's gradient, which sharding in types refuses when heads are
    split; they run with the axes Auto (partitioning.in_auto_axes), typed as q."""
    mesh = jax.make_mesh((2,), ("dp",), axis_types=(jax.sharding.AxisType.Explicit,))
    q, k, v, d_out = (_normal(i, (4, 32, 4, 8)) for i in range(4))
    slopes = jnp.linspace(0.1, 0.8, 4, dtype=jnp.float32)

    def f(q, k, v, slopes):
        return fusedattn.fused_attn(q, k, v, mask="causal", backend="xla", score_mod_args=(slopes,),
                                    score_mod=lambda s, b, h, i, j, sl: s + sl[h] * (j - i))
    single, sharded, counts, _ = sc.run(f, [q, k, v, slopes],
                                        [NamedSharding(mesh, spec)] * 3 + [None], d_out, n_diff=4)
    assert counts["all-gather"] == 0, counts
    sc.assert_same(single, sharded, TOL)


def _typed_as_ffi(kernel):
    """An XLA kernel whose results are typed as an FFI call's are: with no sharding type.
    Where the operands carry Explicit types (native_op tracing its call at the global
    shapes) an ffi_call of the kernel's result shapes stands in; it is never lowered, as
    the partitioner runs the per-device body, whose arrays carry none."""
    def run(config, *args):
        leaves, tree = jax.tree_util.tree_flatten(args)
        at = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
        arrays = [leaves[i] for i in at]
        if all(partitioning.explicit_mesh(x) is None for x in arrays):
            return kernel(config, *args)

        def on(*arrays):
            full = list(leaves)
            for i, x in zip(at, arrays):
                full[i] = x
            return kernel(config, *jax.tree_util.tree_unflatten(tree, full))
        shapes = jax.eval_shape(on, *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays))
        flat, out_tree = jax.tree_util.tree_flatten(shapes)
        outs = jax.ffi.ffi_call("fusedattn_test_never_lowered",
                                [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat])(*arrays)
        return jax.tree_util.tree_unflatten(out_tree, outs)
    return run


native_call.register("xla_typed_as_ffi",
                     native_call.Kernels(*(_typed_as_ffi(k) for k in (xla.forward, xla.backward))),
                     native_call.Kernels(*(_typed_as_ffi(k) for k in (xla_fp8.fp8_forward,
                                                                      xla_fp8.fp8_backward))))


def _typed_as_ffi_call(precision):
    """A causal call on the FFI-typed kernels, BF16 or with FP8 current scaling."""
    def f(q, k, v):
        config, inputs = build_call(q, k, v, mask="causal", precision=precision)
        if precision == "fp8":
            return fp8_op.current_scaling_attention(config, inputs, "xla_typed_as_ffi")
        return native_call.attention("xla_typed_as_ffi", config, inputs)[0]
    return f


@pytest.mark.parametrize("spec", [P("dp"), P(None, None, "dp")], ids=["batch", "heads"])
@pytest.mark.parametrize("precision", [None, "fp8"], ids=["bf16", "fp8"])
def test_explicit_mesh_native_calls_typed_by_the_rule(partitioner, precision, spec):
    """Under Explicit axes an FFI kernel's results carry no sharding type; FP8 current
    scaling dequantizes them, which typed the results unsharded, and the partitioner
    gathered the FP8 tensors (cuDNN on 2 GPUs). native_op types every call's results
    as the rule splits them: no gather. (The BF16 cases passed before too: nothing meets
    their results before the step returns them.)"""
    mesh = jax.make_mesh((2,), ("dp",), axis_types=(jax.sharding.AxisType.Explicit,))
    q, k, v, d_out = (_normal(i, (4, 32, 4, 16)).astype(jnp.bfloat16) for i in range(4))

    single, sharded, counts, _ = sc.run(_typed_as_ffi_call(precision), [q, k, v],
                                        [NamedSharding(mesh, spec)] * 3, d_out)
    assert counts["all-gather"] == counts["all-to-all"] == 0, counts
    sc.assert_same(single, sharded, 1e-2)


@pytest.mark.parametrize("spec,h_kv", [(P(None, "dp"), 4), (P(None, None, "dp"), 1)],
                         ids=["sequence", "heads-not-dividing-kv"])
@pytest.mark.parametrize("precision", [None, "fp8"], ids=["bf16", "fp8"])
def test_explicit_mesh_native_calls_the_rule_gathers(partitioner, precision, spec, h_kv):
    """Splits the rule cannot keep (the sequence without context parallelism, heads that
    do not divide the kv heads): the call gathers, as documented, and the gradients are
    still typed as their primals (custom_vjp's rule) under Explicit axes."""
    mesh = jax.make_mesh((2,), ("dp",), axis_types=(jax.sharding.AxisType.Explicit,))
    q, d_out = (_normal(i, (4, 32, 4, 16)).astype(jnp.bfloat16) for i in (0, 3))
    k, v = (_normal(i, (4, 32, h_kv, 16)).astype(jnp.bfloat16) for i in (1, 2))

    kv_spec = spec if h_kv % 2 == 0 else P()   # (one kv head: replicated)
    shardings = [NamedSharding(mesh, spec)] + [NamedSharding(mesh, kv_spec)] * 2
    single, sharded, counts, _ = sc.run(_typed_as_ffi_call(precision), [q, k, v], shardings,
                                        d_out)
    assert counts["all-gather"] > 0, counts
    sc.assert_same(single, sharded, 1e-2)


@pytest.fixture
def cuda_lowering(monkeypatch):
    monkeypatch.setenv("FUSEDATTN_PLATFORM", "cuda")
    fusedattn.dispatch.clear_cache()
    with cudnn.assume_supported(workspace_bytes=1 << 20):
        yield
    fusedattn.dispatch.clear_cache()


@pytest.mark.parametrize("backend,platform", [("cudnn", "cuda"), ("small_seq", "cuda"),
                                              ("ck", "rocm")])
def test_native_calls_lowered_without_a_gpu_carry_the_rule(monkeypatch, backend, platform):
    """Lowered for CUDA / ROCm on this CPU host with sharded inputs: the native calls
    sit inside custom_partitioning ops that carry the Shardy rule."""
    monkeypatch.setenv("FUSEDATTN_PLATFORM", platform)
    fusedattn.dispatch.clear_cache()
    mesh = _mesh((2, 4), ("dp", "tp"))
    s_kv = 16 if backend == "small_seq" else 64
    shape_q = (8, 1 if backend == "small_seq" else 64, 8, 64)
    q = jax.ShapeDtypeStruct(shape_q, jnp.bfloat16, sharding=NamedSharding(mesh, P("dp")))
    kv = jax.ShapeDtypeStruct((8, s_kv, 8, 64), jnp.bfloat16,
                              sharding=NamedSharding(mesh, P("dp")))

    def loss(q, k, v):
        config, inputs = build_call(q, k, v)
        return native_call.attention(backend, config, inputs)[0].astype(jnp.float32).sum()
    with cudnn.assume_supported(workspace_bytes=1 << 20):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
            lowering_platforms=(platform,)).as_text()
    fusedattn.dispatch.clear_cache()
    assert text.count("CustomSPMDPartitioning") == 2  # the training forward and the backward
    assert text.count("sdy.sharding_rule") >= 2


@pytest.mark.parametrize("spec", [P("dp"), P(None, None, "dp")], ids=["batch", "heads"])
def test_fp8_backward_in_groups_lowers_under_explicit_axes(monkeypatch, spec):
    """cuDNN's causal FP8 backward runs in calls of at most 32 (batch, head) pairs,
    sliced from the call's arrays. The body of a native call is also traced at the
    global shapes, where those slices met batch rows split 4 ways by sharding in types
    and were refused (b8 h16 on 4 devices). Lowered for CUDA on this CPU host, both splits
    lower, the backward's groups inside the partitioned call."""
    monkeypatch.setenv("FUSEDATTN_PLATFORM", "cuda")
    fusedattn.dispatch.clear_cache()
    mesh = jax.make_mesh((4,), ("dp",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = jax.ShapeDtypeStruct((8, 128, 16, 64), jnp.bfloat16, sharding=NamedSharding(mesh, spec))

    def loss(q, k, v):
        out = fusedattn.fused_attn(q, k, v, mask="causal", precision="fp8", backend="cudnn")
        return out.astype(jnp.float32).sum()
    try:
        with cudnn.assume_supported(workspace_bytes=1 << 20):
            assert len(cudnn.fp8.backward_groups(build_call(
                *(jnp.zeros(x.shape, x.dtype),) * 3, mask="causal", precision="fp8")[0])) == 4
            text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x).lower(
                lowering_platforms=("cuda",)).as_text()
    finally:
        fusedattn.dispatch.clear_cache()
    assert text.count("CustomSPMDPartitioning") == 2  # the training forward and the backward
